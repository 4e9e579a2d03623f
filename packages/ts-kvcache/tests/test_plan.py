"""The "auto" plan, on the CPU with the CUDA memory probes stubbed: what fits stays in VRAM,
a per-process cap counts, more free VRAM never keeps fewer layers, offloaded layers are spread."""

from __future__ import annotations

import pytest
import torch
import ts_kvcache
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_kvcache._args import spread

MIB = 1 << 20


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(free, total, reserved=0, allocated=0, fraction=1.0, holes=0) stubs torch.cuda's probes
    (``holes``: torch's inactive split bytes, free blocks inside segments still in use)."""

    def install(free, total, reserved=0, allocated=0, fraction=1.0, holes=0):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
        monkeypatch.setattr(torch.cuda, "memory_stats",
                            lambda device=None: {"inactive_split_bytes.all.current": holes})
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)

    return install


def _plan(layers, slots=2):
    cache = ts_kvcache.PagedKVCache(layers, 1024, vram_fraction=1.0, slots=slots)
    return cache._auto_resident(torch.device("cuda", 0), MIB)


def test_everything_fits(fake_gpu):
    fake_gpu(free=100 * MIB, total=200 * MIB)
    assert _plan(8) == list(range(8))


def test_what_does_not_fit_is_offloaded_beside_two_slots(fake_gpu):
    fake_gpu(free=6 * MIB, total=200 * MIB)
    resident = _plan(8)
    # 6 MiB: 2 slots leave room for 4 layers (offloaded layers hold no VRAM of their own).
    assert len(resident) == 4
    assert sorted(set(range(8)) - set(resident)) == spread(8, 4)


def test_torch_cached_memory_counts_and_a_cap_limits(fake_gpu):
    fake_gpu(free=2 * MIB, total=200 * MIB, reserved=5 * MIB, allocated=1 * MIB)
    assert len(_plan(8)) == 4  # 2 free + 4 cached-but-unused
    fake_gpu(free=150 * MIB, total=200 * MIB, allocated=94 * MIB, fraction=0.5)
    assert len(_plan(8)) == 4  # the cap leaves 100 - 94 = 6 MiB, not 150


def test_holes_in_used_segments_are_not_free(fake_gpu):
    # 4 MiB cached but unused, 2 of them holes between live blocks: 2 + 2 free, room for 2 layers.
    fake_gpu(free=2 * MIB, total=200 * MIB, reserved=5 * MIB, allocated=1 * MIB, holes=2 * MIB)
    assert len(_plan(8)) == 2
    # Under a cap too: 100 - 94 - 2 = 4 MiB.
    fake_gpu(free=150 * MIB, total=200 * MIB, allocated=94 * MIB, fraction=0.5, holes=2 * MIB)
    assert len(_plan(8)) == 2


def test_no_room_for_the_slots_is_refused_with_the_numbers(fake_gpu):
    fake_gpu(free=1 * MIB, total=200 * MIB)
    with pytest.raises(torch.OutOfMemoryError, match=r"2 device slot\(s\) of 0.001 GiB .* 0.00 GiB of VRAM is free"):
        _plan(8)


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 40), free=st.integers(0, 60), extra=st.integers(0, 30), slots=st.sampled_from([2, 3]))
def test_more_free_vram_never_keeps_fewer_layers(layers, free, extra, slots):
    def resident(mib):
        torch_probe = (mib * MIB, 1000 * MIB)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "mem_get_info", lambda device=None: torch_probe)
            mp.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
            mp.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
            mp.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
            mp.setattr(torch.cuda, "memory_stats", lambda device=None: {})
            return _plan(layers, slots=slots)

    if layers > free and min(slots, layers) > free:  # not even the slots fit: refused, not planned
        with pytest.raises(torch.OutOfMemoryError):
            resident(free)
        return
    low, high = resident(free), resident(free + extra)
    assert len(low) <= len(high)
    if len(low) < layers:  # something offloaded: resident layers and slots fit the budget
        assert len(low) == 0 or (len(low) + slots) * MIB <= free * MIB


def test_working_bytes_are_left_free_before_the_fraction(fake_gpu):
    fake_gpu(free=10 * MIB, total=200 * MIB)
    seen = []

    def working(keys):
        seen.append(tuple(keys.shape))
        return 4 * MIB

    cache = ts_kvcache.PagedKVCache(8, 1024, vram_fraction=0.5, working_bytes=working)
    # 10 - 1.25 x 6 = 2.5 MiB: the 2 slots, no whole layer beside them
    assert len(cache._auto_resident(torch.device("cuda", 0), MIB, 6 * MIB)) == 0
    assert cache.plan["budget"] == 10 * MIB - 6 * MIB - 6 * MIB // 4 and cache.plan["working_bytes"] == 6 * MIB
    assert len(cache._auto_resident(torch.device("cuda", 0), MIB, 4 * MIB + MIB // 2)) == 2  # 10 - 5.625, - 2 slots
    assert len(cache._auto_resident(torch.device("cuda", 0), MIB, 1 * MIB)) == 3  # 0.5 x 10 - 2 slots
    plain = ts_kvcache.PagedKVCache(8, 1024, vram_fraction=0.5)
    assert len(plain._auto_resident(torch.device("cuda", 0), MIB)) == 3
    # On the CPU the function is called with the first update's keys; everything stays resident.
    cache.update(0, torch.zeros(3, 2, 5, 4), torch.zeros(3, 2, 5, 4))
    assert seen == [(3, 2, 5, 4)] and len(cache.resident) == 8


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_working_bytes_are_refused(bad):
    with pytest.raises(ValueError, match="working_bytes"):
        ts_kvcache.PagedKVCache(2, 8, working_bytes=bad)
