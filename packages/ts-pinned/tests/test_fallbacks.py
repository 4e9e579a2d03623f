"""Growth up to the cap, fallbacks beyond it, reserve semantics and the pageable path."""

from __future__ import annotations

import gc

import pytest
import torch
import ts_pinned
from ts_pinned import _core

KIB = 1 << 10


def test_request_beyond_cap_is_a_counted_fallback():
    a = ts_pinned.PinnedArena(64 * KIB, cap_bytes=128 * KIB)
    calls = a.stats()["host_alloc_calls"]
    t = a.empty(256 * KIB, torch.uint8, tag="big")
    s = a.stats()
    assert s["arena_fallbacks"] == 1 and s["fallback_bytes"] == 256 * KIB
    assert s["arena_bytes"] == 0 and s["arena_used"] == 0
    assert s["host_alloc_calls"] == calls + 1
    assert s["by_tag"] == {"big": 256 * KIB} and s["live_blocks"] == 1
    assert t.data_ptr() % _core.ALIGNMENT == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * 256 * KIB
    del t
    s = a.stats()
    assert s["fallback_bytes"] == 0 and s["live_blocks"] == 0 and s["by_tag"] == {}
    assert s["arena_fallbacks"] == 1  # counted ever, not live
    a.check_invariants()


def test_arena_grows_slab_by_slab_to_the_cap():
    a = ts_pinned.PinnedArena(64 * KIB, cap_bytes=160 * KIB)
    blocks = [a.empty(60 * KIB, torch.uint8) for _ in range(2)]
    assert a.stats()["arena_slabs"] == 2 and a.stats()["arena_bytes"] == 128 * KIB
    # 32 KiB of cap are left: the arena uses them rather than falling back.
    blocks.append(a.empty(30 * KIB, torch.uint8))
    s = a.stats()
    assert s["arena_bytes"] == 160 * KIB and s["arena_slabs"] == 3 and s["arena_fallbacks"] == 0
    blocks.append(a.empty(10 * KIB, torch.uint8))
    s = a.stats()
    assert s["arena_bytes"] == 160 * KIB and s["arena_fallbacks"] == 1
    del blocks
    s = a.stats()
    assert s["arena_used"] == 0 and s["arena_largest_free"] == 64 * KIB
    a.check_invariants()


def test_request_larger_than_a_slab_gets_its_own_slab():
    a = ts_pinned.PinnedArena(64 * KIB)
    t = a.empty(200 * KIB + 1, torch.uint8)
    s = a.stats()
    assert s["arena_slabs"] == 1 and s["arena_bytes"] == 200 * KIB + 512 and s["arena_fallbacks"] == 0
    del t


def test_cap_zero_means_every_request_falls_back():
    a = ts_pinned.PinnedArena(64 * KIB, cap_bytes=0)
    ts = [a.empty(100, torch.float32) for _ in range(3)]
    s = a.stats()
    assert s["arena_bytes"] == 0 and s["arena_fallbacks"] == 3 and s["fallback_bytes"] == 3 * 512
    del ts
    assert a.stats()["fallback_bytes"] == 0


def test_reserve_then_allocate_makes_no_host_calls():
    a = ts_pinned.PinnedArena(256 * KIB)
    assert a.reserve(1 << 20) == 1 << 20
    calls = a.stats()["host_alloc_calls"]
    assert calls == 4
    ts = [a.empty(n, torch.uint8) for n in (1, 1000, 100_000, 200_000, 250_000, 150_000)]
    assert a.stats()["host_alloc_calls"] == calls
    del ts


def test_reserve_partial_slab_and_cap_lifting():
    a = ts_pinned.PinnedArena(64 * KIB, cap_bytes=32 * KIB)
    # Reserving is explicit: it may lift the cap to what it reserves.
    assert a.reserve(96 * KIB) == 96 * KIB
    s = a.stats()
    assert s["arena_slabs"] == 2 and s["arena_cap"] == 96 * KIB
    # Reserving less than what is reserved changes nothing.
    assert a.reserve(10 * KIB) == 96 * KIB
    # A cap below what is reserved is clamped to it.
    a.reserve(0, cap=16 * KIB)
    assert a.stats()["arena_cap"] == 96 * KIB
    a.reserve(0, cap=1 << 20)
    assert a.stats()["arena_cap"] == 1 << 20 and a.stats()["arena_bytes"] == 96 * KIB


def test_reserve_with_unaligned_slab_and_cap_terminates(helpers):
    # Regression: with a slab size that is not a multiple of the alignment and a
    # cap, reserve() used to loop forever. A subprocess, so a regression fails
    # by timeout instead of hanging the suite.
    proc = helpers.run_python(
        """
        import ts_pinned
        a = ts_pinned.PinnedArena(1000, cap_bytes=100)
        print(a.reserve(5000), a.stats()["arena_slabs"], a.stats()["arena_cap"])
        a.check_invariants()
        b = ts_pinned.PinnedArena(1000, cap_bytes=0)
        b.reserve(2500)
        b.check_invariants()
        """,
        timeout=30,
    )
    assert proc.stdout.split() == ["5120", "5", "5120"]


def test_allow_pageable_path():
    a = ts_pinned.PinnedArena(64 * KIB, cap_bytes=0)
    t = a.empty(1000, torch.float32, allow_pageable=True)
    u = ts_pinned.PinnedArena(64 * KIB).empty(1000, allow_pageable=True)
    s = a.stats()
    assert s["arena_fallbacks"] == 1
    # Page-locking only fails when the host refuses it; here it either worked
    # (GPU machine) or was never tried (no GPU), so nothing was made pageable.
    assert s["pageable_fallbacks"] == 0
    assert _core.block_is_pinned(a._arena, t.data_ptr()) == s["pinned"]
    t.copy_(torch.arange(1000, dtype=torch.float32))
    u.copy_(t)
    assert torch.equal(u, torch.arange(1000, dtype=torch.float32))
    del t, u
    gc.collect()
    assert a.stats()["fallback_bytes"] == 0


def test_pinned_flag_matches_the_machine():
    assert ts_pinned.PinnedArena(4096).stats()["pinned"] == _core.cuda_device_present()
    if not torch.cuda.is_available():
        assert ts_pinned.PinnedArena(4096).stats()["pinned"] is False


@pytest.mark.parametrize("cap", [None, 0, 100 * KIB])
def test_stats_fields(cap):
    s = ts_pinned.PinnedArena(64 * KIB, cap).stats()
    for key in ("arena_bytes", "arena_used", "arena_slabs", "arena_cap", "arena_fallbacks", "arena_largest_free",
                "host_alloc_calls", "by_tag", "fallback_bytes", "pageable_fallbacks", "live_blocks", "slab_bytes",
                "pinned"):
        assert key in s
    assert s["arena_cap"] == cap
