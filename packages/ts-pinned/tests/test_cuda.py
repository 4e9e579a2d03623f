"""GPU tests (marker `cuda`, skipped without a GPU): arena memory is page-locked,
non-blocking copies from it are correct and fast, copy_to_device is bit-exact."""

from __future__ import annotations

import time

import pytest
import torch
import ts_pinned

pytestmark = pytest.mark.cuda
MIB = 1 << 20


def random_of(dtype, numel, seed):
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def test_arena_tensors_are_pinned():
    # torch answers is_pinned() from its own CUDA context: create it first (the
    # arena's memory is page-locked either way; the copy tests measure that).
    torch.zeros(1, device="cuda")
    a = ts_pinned.PinnedArena(64 * MIB, cap_bytes=128 * MIB)
    a.reserve(64 * MIB)
    assert a.stats()["pinned"] is True
    t = a.empty((1000, 1000), torch.float32)
    grown = a.empty(62 * MIB, torch.uint8)  # does not fit beside t: grows a second slab
    fallback = a.empty(200 * MIB, torch.uint8)  # beyond the cap: page-locked on its own
    view = t[10:20, ::2]
    for x in (t, grown, fallback, view):
        assert x.is_pinned()
    s = a.stats()
    assert s["arena_slabs"] == 2 and s["arena_fallbacks"] == 1 and s["pageable_fallbacks"] == 0
    assert ts_pinned.empty(100).is_pinned()  # the default arena too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int64])
def test_non_blocking_copies_round_trip(dtype):
    a = ts_pinned.PinnedArena(256 * MIB)
    a.reserve(256 * MIB)
    numel = (40 * MIB) // torch.empty((), dtype=dtype).element_size() + 7
    host = a.empty(numel, dtype)
    host.copy_(random_of(dtype, numel, seed=1))
    expected = host.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = host.to("cuda", non_blocking=True)
        back = a.empty(numel, dtype)
        back.copy_(dev, non_blocking=True)
    stream.synchronize()
    assert same_bits(dev, expected)
    assert same_bits(back, expected)


def _h2d_gbps(src: torch.Tensor, repeats: int = 5) -> float:
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return src.numel() * src.element_size() / sorted(times)[len(times) // 2] / 1e9


def test_arena_copies_run_at_pinned_speed():
    nbytes = 512 * MIB
    a = ts_pinned.PinnedArena(nbytes)
    a.reserve(nbytes)
    arena_t = a.empty(nbytes, torch.uint8).fill_(1)
    torch_pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    arena_rate = _h2d_gbps(arena_t)
    torch_rate = _h2d_gbps(torch_pinned)
    assert arena_rate >= 0.8 * torch_rate, (arena_rate, torch_rate)


CASES = [(dtype, nbytes) for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64)
         for nbytes in (1024 + 8, 16 * MIB, 3 * 16 * MIB + 5 * 1024 + 8)]
CASES += [(torch.float32, 200 * MIB + 8), (torch.uint8, 9 * 16 * MIB + 1)]  # beyond the 8-slot ring


@pytest.mark.parametrize("dtype, nbytes", CASES)
def test_copy_to_device_bit_exact_on_a_side_stream(dtype, nbytes):
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = nbytes // itemsize
    src = random_of(dtype, numel, seed=nbytes)
    dst = torch.full((numel,), 0, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # dst's fill is done before the copy
    ts_pinned.copy_to_device(src, dst, stream=stream)
    stream.synchronize()
    assert same_bits(dst, src)


def test_copy_to_device_default_and_raw_stream_handles():
    src = random_of(torch.float32, 5 * MIB + 3, seed=3)
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    ts_pinned.copy_to_device(src, dst)  # current stream
    torch.cuda.synchronize()
    assert same_bits(dst, src)
    stream = torch.cuda.Stream()
    dst2 = torch.empty_like(dst)
    ts_pinned.copy_to_device(src, dst2, stream=stream.cuda_stream)
    stream.synchronize()
    assert same_bits(dst2, src)


def test_ring_reused_back_to_back_without_sync():
    # Many copies queued without synchronizing, through the same slots and two
    # streams: a slot refilled before its previous DMA finished would corrupt an
    # earlier copy. Sources are overwritten as soon as each call returns ("returns
    # once src has been read"), so a copy that read src late is caught as well.
    slot = ts_pinned.staging_stats()["slot_bytes"]
    copies = ts_pinned.staging_stats()["copies"]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    expected, dsts = [], []
    for i in range(10):
        nbytes = int(slot * (0.5 + i * 0.7)) + 4 * i
        src = random_of(torch.uint8, nbytes, seed=100 + i)
        expected.append(src.clone())
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        streams[i % 2].wait_stream(torch.cuda.current_stream())
        ts_pinned.copy_to_device(src, dst, stream=streams[i % 2])
        src.fill_(0xAB)
        dsts.append(dst)
        if i == 6:
            # A host-to-host copy through the same ring while DMAs are in flight.
            host_src = random_of(torch.uint8, 3 * slot + 1, seed=7)
            host_dst = torch.empty_like(host_src)
            ts_pinned.copy_to_device(host_src, host_dst)
            assert torch.equal(host_src, host_dst)
    torch.cuda.synchronize()
    for i, (dst, want) in enumerate(zip(dsts, expected)):
        assert same_bits(dst, want), f"copy {i} corrupted"
    assert ts_pinned.staging_stats()["copies"] == copies + 11


def test_copy_to_device_non_contiguous_src_and_views():
    src = torch.randn(2048, 3000).t()
    dst = torch.empty(src.shape, device="cuda")
    ts_pinned.copy_to_device(src, dst)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    big = torch.zeros(10_000_000, device="cuda")
    part = torch.arange(1_000_000, dtype=torch.float32)
    ts_pinned.copy_to_device(part, big[5_000_000:6_000_000])
    torch.cuda.synchronize()
    assert torch.equal(big[5_000_000:6_000_000].cpu(), part)
    assert float(big[:5_000_000].abs().sum()) == 0.0


def test_copy_to_device_errors_on_cuda():
    with pytest.raises(ValueError, match="src must be a CPU tensor"):
        ts_pinned.copy_to_device(torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda"))
    with pytest.raises(ValueError, match="must match"):
        ts_pinned.copy_to_device(torch.zeros(4), torch.zeros(4, device="cuda", dtype=torch.float16))


def test_copy_to_device_beats_the_pageable_path():
    # Both paths in the same run on the same pageable source, interleaved (so drift
    # of clocks or of the link hits both), best of 3 each. Measured on the H200
    # machine: 53.7 GB/s staged against 9.1 GB/s pageable (5.9x). A copy_to_device
    # that fell back to the driver's pageable path would give a ratio near 1, so 2x
    # cannot pass without the ring; the staging counters show the ring ran.
    nbytes = 1 << 30
    src = random_of(torch.uint8, 64 * MIB, seed=11).repeat(nbytes // (64 * MIB))
    src[-1] = 7  # the last slot's bytes differ from the first's
    assert not src.is_pinned()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(copy) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    pageable_out = []
    timed(lambda: ts_pinned.copy_to_device(src, dst))  # warm-up: ring, allocator, context
    timed(lambda: pageable_out.append(src.to("cuda")))
    staged_s, pageable_s = [], []
    for _ in range(3):
        before = ts_pinned.staging_stats()
        staged_s.append(timed(lambda: ts_pinned.copy_to_device(src, dst)))
        after = ts_pinned.staging_stats()
        assert after["copies"] == before["copies"] + 1 and after["bytes"] == before["bytes"] + nbytes
        pageable_out.clear()
        pageable_s.append(timed(lambda: pageable_out.append(src.to("cuda"))))
    assert same_bits(dst, src) and same_bits(pageable_out[0], src)
    staged = nbytes / min(staged_s) / 1e9
    pageable = nbytes / min(pageable_s) / 1e9
    print(f"copy_to_device {staged:.1f} GB/s, pageable .to('cuda') {pageable:.1f} GB/s")
    assert staged >= 2.0 * pageable, f"copy_to_device at {staged:.1f} GB/s, pageable .to('cuda') at {pageable:.1f}"
    assert staged >= 20.0, f"copy_to_device at {staged:.1f} GB/s (design target: 20)"


@pytest.mark.multigpu
def test_copy_to_device_on_another_device():
    src = random_of(torch.float32, 3 * MIB, seed=9)
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda:1")
    with torch.cuda.device(0):
        ts_pinned.copy_to_device(src, dst)
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert same_bits(dst, src)
    with pytest.raises(ValueError, match="stream is on"):
        ts_pinned.copy_to_device(src, dst, stream=torch.cuda.Stream(device=0))
