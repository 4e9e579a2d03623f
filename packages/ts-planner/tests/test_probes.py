"""The native probes and the cached HardwareProfile."""

from __future__ import annotations

import json

import pytest
import torch
import ts_planner
from ts_planner import _core


def test_host_bandwidth_is_measured():
    rate = ts_planner.measure_host_bandwidth(32 << 20, threads=1, repeats=2)
    assert 0.1 < rate < 10_000  # GB/s: any real machine lands here


def test_probe_arguments_are_checked():
    with pytest.raises(ValueError, match="at least 1 MiB"):
        _core.host_copy_gbps(1000, 0, 1)
    with pytest.raises(ValueError, match="threads"):
        ts_planner.measure_host_bandwidth(threads=0)


def test_link_probe_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="CUDA"):
        ts_planner.measure_link()
    with pytest.raises(RuntimeError):
        _core.link_gbps(1 << 20, 0, 1)


def test_profile_is_cached_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    first = ts_planner.profile_hardware()
    files = list(tmp_path.glob("hardware-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["host_cores"] == first.host_cores
    assert first.host_copy_gbps > 0 and first.host_ram_bytes > 0
    assert "host cores" in first.summary()
    # A cached profile comes back as is; force measures again.
    data = json.loads(files[0].read_text())
    data["host_copy_gbps"] = 123.0
    files[0].write_text(json.dumps(data))
    assert ts_planner.profile_hardware().host_copy_gbps == 123.0
    assert ts_planner.profile_hardware(force=True).host_copy_gbps != 123.0


def test_the_cache_folder_follows_xdg_cache_home(tmp_path, monkeypatch):
    from ts_planner._profile import _cache_root

    monkeypatch.delenv("TRAINSTREAM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _cache_root() == tmp_path / "xdg" / "trainstream"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec: only an absolute path counts
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _cache_root() == tmp_path / "home" / ".cache" / "trainstream"
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path / "own"))  # the explicit folder wins
    assert _cache_root() == tmp_path / "own"


def test_a_corrupt_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    ts_planner.profile_hardware()
    (path,) = tmp_path.glob("hardware-*.json")
    path.write_text("{not json")
    assert ts_planner.profile_hardware().host_copy_gbps > 0


@pytest.mark.cuda
def test_link_rates_on_a_gpu():
    rates = ts_planner.measure_link(0, 64 << 20)
    assert rates["h2d_gbps"] > 1 and rates["d2h_gbps"] > 1
    assert rates["both_gbps"] >= 0.9 * max(rates["h2d_gbps"], rates["d2h_gbps"])
    profile = ts_planner.profile_hardware(force=True)
    assert profile.gpu and profile.link_h2d_gbps > 1


def test_profile_honours_the_cgroup_memory_limit(tmp_path, monkeypatch):
    root = tmp_path / "root"
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 12582912 kB\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/job\n")
    fs = root / "sys" / "fs" / "cgroup"
    (fs / "job").mkdir(parents=True)
    (fs / "cgroup.controllers").write_text("cpu memory\n")
    (fs / "job" / "memory.max").write_text(f"{3 << 30}\n")
    (fs / "job" / "memory.current").write_text(f"{1 << 30}\n")
    monkeypatch.setenv("TS_CGROUP_ROOT", str(root))
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    profile = ts_planner.profile_hardware(force=True)
    assert profile.host_ram_bytes == 3 << 30 and profile.host_available_bytes == 2 << 30
    assert profile.host_memory_source == "cgroup v2" and "cgroup v2 limit" in profile.summary()


@pytest.mark.parametrize("threads", [2**70, True, 1.5])
def test_probe_thread_counts_are_bounded(threads):
    with pytest.raises(ValueError, match=f"1 to {_core.max_host_threads()}"):
        ts_planner.measure_host_bandwidth(threads=threads)


def test_profile_threads_are_checked_and_cached_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=f"1 to {_core.max_host_threads()}"):
        ts_planner.profile_hardware(threads=0)
    assert not list(tmp_path.glob("hardware-*.json"))  # refused before anything was measured
    one = ts_planner.profile_hardware(threads=1)
    ts_planner.profile_hardware()
    names = sorted(p.name for p in tmp_path.glob("hardware-*.json"))
    assert len(names) == 2 and any(n.endswith("-t1.json") for n in names)
    assert one.host_copy_gbps > 0
