"""copy_to_device with a CPU dst: the same staging ring path as the GPU copy, checked bit-exactly."""

from __future__ import annotations

import threading

import pytest
import torch
import ts_pinned
from ts_pinned import _core

DTYPES = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.int32,
          torch.int64, torch.float64, torch.complex64]


def random_of(dtype, shape, seed):
    """Random bit patterns of `dtype` (NaNs and all), compared byte for byte."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 3, 511, 4097, (1 << 20) + 5])
def test_bit_exact(dtype, numel, helpers):
    src = random_of(dtype, (numel,), seed=numel)
    dst = torch.empty_like(src)
    assert ts_pinned.copy_to_device(src, dst) is dst
    assert torch.equal(helpers.as_bytes(dst), helpers.as_bytes(src))


def test_larger_than_several_slots(helpers):
    stats = ts_pinned.staging_stats()
    slot = stats["slot_bytes"]
    nbytes = int(2.5 * slot) + 12345  # three slots, the last one partial and odd
    src = random_of(torch.uint8, (nbytes,), seed=1)
    dst = torch.zeros_like(src)
    ts_pinned.copy_to_device(src, dst)
    assert torch.equal(dst, src)
    after = ts_pinned.staging_stats()
    assert after["copies"] == stats["copies"] + 1
    assert after["bytes"] == stats["bytes"] + nbytes


def test_small_ring_wraps_many_times(helpers):
    # A fresh process, so the ring can be sized before its first use.
    helpers.run_python(
        """
        import torch, ts_pinned
        from ts_pinned import _core
        assert _core.configure_staging(3000, 3)          # rounded up to 3072-byte slots
        s = ts_pinned.staging_stats()
        assert (s["slot_bytes"], s["slots"]) == (3072, 3), s
        assert not _core.configure_staging(4096, 4)      # too late: the ring exists
        g = torch.Generator().manual_seed(0)
        for nbytes in [1, 3071, 3072, 3073, 9216, 9217, 50_000, 1_000_003]:
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
            dst = torch.empty_like(src)
            ts_pinned.copy_to_device(src, dst)
            assert torch.equal(src, dst), nbytes
        src = torch.randn(333, 77, dtype=torch.float64).t()   # non-contiguous, beyond the ring
        dst = torch.empty(77, 333, dtype=torch.float64)
        ts_pinned.copy_to_device(src, dst)
        assert torch.equal(src, dst)
        s = ts_pinned.staging_stats()
        assert s["copies"] == 9 and s["slot_waits"] == 0, s
        """
    )


@pytest.mark.parametrize(
    "make_src",
    [
        lambda: torch.randn(64, 48).t(),
        lambda: torch.randn(100, 30)[::3, 5:],
        lambda: torch.randn(1).expand(1000),
        lambda: torch.randn(20, 20, dtype=torch.complex64).conj(),
        lambda: torch.randn(300)._neg_view(),
        lambda: torch.randn(50, requires_grad=True) * 1,
        lambda: torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
    ],
    ids=["transpose", "strided", "expand", "conj", "neg", "requires_grad", "permute"],
)
def test_non_contiguous_and_lazy_views(make_src):
    src = make_src()
    dst = torch.empty(src.shape, dtype=src.dtype)
    ts_pinned.copy_to_device(src, dst)
    assert torch.equal(dst, src.detach())


def test_scalar_and_empty():
    src = torch.tensor(3.5)
    dst = torch.empty(())
    ts_pinned.copy_to_device(src, dst)
    assert dst.item() == 3.5
    copies = ts_pinned.staging_stats()["copies"]
    empty = torch.empty(0, 5)
    assert ts_pinned.copy_to_device(torch.empty(0, 5), empty) is empty
    assert ts_pinned.staging_stats()["copies"] == copies


def test_into_a_slice_of_a_larger_buffer():
    buf = torch.zeros(1000, dtype=torch.int32)
    src = torch.arange(100, dtype=torch.int32)
    ts_pinned.copy_to_device(src, buf[300:400])
    assert torch.equal(buf[300:400], src)
    assert int(buf[:300].abs().sum()) == 0 and int(buf[400:].abs().sum()) == 0


def test_arena_tensor_as_src_and_dst():
    a = ts_pinned.PinnedArena(1 << 20)
    src = a.empty(1000, torch.float32).copy_(torch.linspace(0, 1, 1000))
    dst = a.empty(1000, torch.float32)
    ts_pinned.copy_to_device(src, dst)
    assert torch.equal(src, dst)


@pytest.mark.parametrize(
    "src, dst, match",
    [
        (torch.zeros(4), torch.zeros(5), "must match"),
        (torch.zeros(2, 3), torch.zeros(3, 2), "must match"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float64), "must match"),
        (torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.float32), "must match"),
        (torch.zeros(4, 4), torch.zeros(4, 4).t(), "contiguous"),
        (torch.zeros(8, dtype=torch.complex64), torch.zeros(8, dtype=torch.complex64).conj(), "conjugate"),
        (torch.zeros(4, device="meta"), torch.zeros(4), "src must be a CPU tensor"),
        (torch.zeros(4), torch.zeros(4, device="meta"), "dst must be a CUDA or CPU tensor"),
        ([1.0, 2.0], torch.zeros(2), "two tensors"),
        (torch.zeros(2), None, "two tensors"),
    ],
)
def test_mismatch_errors(src, dst, match):
    with pytest.raises(ValueError, match=match):
        ts_pinned.copy_to_device(src, dst)


def test_native_size_check():
    with pytest.raises(ValueError, match="src has 4 bytes but dst has 5"):
        _core.copy_to_device(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8), 0)


def test_configure_staging_validation():
    with pytest.raises(ValueError, match="at least 2 slots"):
        _core.configure_staging(4096, 1)
    with pytest.raises(ValueError, match="slot_bytes > 0"):
        _core.configure_staging(0, 4)


def test_threads_share_the_ring():
    errors = []

    def worker(seed):
        try:
            for i in range(5):
                src = random_of(torch.float32, (300_000 + 1000 * seed + i,), seed=seed * 100 + i)
                dst = torch.empty_like(src)
                ts_pinned.copy_to_device(src, dst)
                assert torch.equal(src.view(torch.int32), dst.view(torch.int32))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
