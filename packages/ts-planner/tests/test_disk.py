"""The disk tier in the planner: the probe measures a directory's direct-I/O rates and leaves nothing there;
the rates are cached per filesystem; the estimate takes the state on disk off host RAM and the plan's lower
bound gains the disk's time."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import ts_planner
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_planner import Budget, ModelShape, Options, estimate_memory

SHAPE = ModelShape(3584, 18944, 28, 28, 4, 152064)  # the Qwen2.5-7B shape
BUDGET = Budget(vram_bytes=24 << 30, host_bytes=64 << 30, pinned_bytes=60 << 30,
                disk_read_gbps=1.5, disk_write_gbps=2.0, disk_mixed_gbps=3.5)


def test_the_probe_measures_and_leaves_nothing(tmp_path):
    rates = ts_planner.measure_disk(tmp_path, 8 << 20, repeats=1)
    assert rates.read_gbps > 0 and rates.write_gbps > 0 and rates.mixed_gbps > 0 and rates.probe_bytes == 8 << 20
    assert str(tmp_path) in rates.summary() and os.listdir(tmp_path) == []


def test_the_probe_names_a_directory_it_cannot_use(tmp_path):
    with pytest.raises(OSError, match=f"cannot create a scratch file in '{tmp_path / 'nope'}'") as info:
        ts_planner.measure_disk(tmp_path / "nope", 1 << 20)
    assert info.value.errno == errno.ENOENT
    for nbytes in (0, (1 << 20) + 1, True):
        with pytest.raises(ValueError, match="multiple of"):
            ts_planner.measure_disk(tmp_path, nbytes)
    with pytest.raises(ValueError, match="repeats"):
        ts_planner.measure_disk(tmp_path, 1 << 20, repeats=0)


def test_rates_are_cached_per_filesystem(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake(directory, nbytes=0, repeats=0):
        calls.append(directory)
        return ts_planner.DiskRates(1.25, 2.5, True, os.fspath(directory), 1 << 20, 2.0)

    monkeypatch.setattr("ts_planner._disk.measure_disk", fake)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ts_planner.disk_rates(tmp_path / "a")
    again = ts_planner.disk_rates(tmp_path / "b")  # the same filesystem: not measured again
    assert calls == [str(tmp_path / "a")] and again.read_gbps == first.read_gbps == 1.25
    assert again.directory == str(tmp_path / "b")
    ts_planner.disk_rates(tmp_path / "a", force=True)
    assert len(calls) == 2


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_the_state_on_disk_leaves_host_ram_and_bounds_the_step(moments):
    ram = estimate_memory(SHAPE, Options(train="full", moment_dtype=moments))
    disk = estimate_memory(SHAPE, Options(train="full", moment_dtype=moments, disk_state_share=0.5))
    m = 4 if moments == "float32" else 2
    on_disk = round(ram.host_optimizer_params * 0.5)
    assert disk.disk_bytes == on_disk * (4 + 2 * m)
    # bf16 weights: master and moments leave RAM; the gradient and upload buffers stay.
    assert ram.host["optimizer_state"] - disk.host["optimizer_state"] == on_disk * (4 + 2 * m)
    assert disk.host_optimizer_params == ram.host_optimizer_params  # host AdamW still updates every value
    plan = ts_planner.check_plan(SHAPE, BUDGET, Options(train="full", moment_dtype=moments, disk_state_share=0.5))
    assert plan.disk_s == pytest.approx(disk.disk_bytes / 1.5e9)  # the slower direction: reads at 1.5 GB/s
    half_duplex = ts_planner.check_plan(SHAPE, dataclasses.replace(BUDGET, disk_mixed_gbps=2.0),
                                        Options(train="full", moment_dtype=moments, disk_state_share=0.5))
    assert half_duplex.disk_s == pytest.approx(2 * disk.disk_bytes / 2.0e9)  # both ways share 2 GB/s
    assert plan.lower_bound_s >= plan.disk_s and plan.to_dict()["lower_bound_s"]["disk"] == plan.disk_s
    assert "disk" in plan.explain()
    assert ts_planner.check_plan(SHAPE, BUDGET, Options(train="full", moment_dtype=moments)).disk_s == 0


@settings(max_examples=40, deadline=None)
@given(a=st.floats(0, 1), b=st.floats(0, 1), moments=st.sampled_from(["float32", "bfloat16"]),
       train=st.sampled_from(["full", "lora"]))
def test_more_state_on_disk_never_takes_more_host_ram(a, b, moments, train):
    low, high = sorted((a, b))
    small = estimate_memory(SHAPE, Options(train=train, moment_dtype=moments, disk_state_share=low))
    large = estimate_memory(SHAPE, Options(train=train, moment_dtype=moments, disk_state_share=high))
    assert large.host_bytes <= small.host_bytes and large.disk_bytes >= small.disk_bytes
    assert large.allocator_bytes == small.allocator_bytes  # VRAM does not change


def test_bad_shares_and_the_gpu_optimizer_are_refused():
    for share in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="disk_state_share"):
            Options(disk_state_share=share)
    with pytest.raises(ValueError, match="host AdamW"):
        Options(disk_state_share=0.5, optimizer="gpu")
    plan = ts_planner.plan_memory(SHAPE, BUDGET, train="full", disk_state_share=0.5)
    assert plan.options.optimizer == "host" and plan.disk_s > 0
