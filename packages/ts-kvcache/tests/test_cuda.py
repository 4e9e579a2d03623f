"""GPU tests (marker `cuda`, skipped without a GPU): the CUDA page copies (copy engine and
kernel) against the PyTorch reference, PagedKVCache on CUDA against torch.cat, the copies
overlapping compute, and decode without a host synchronization."""

from __future__ import annotations

import time

import pytest
import torch
import ts_kvcache
from ts_kvcache import _native
from ts_kvcache.reference import ConcatCache, copy_pages_reference

pytestmark = pytest.mark.cuda


def _random(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("method", ["engine", "kernel"])
@pytest.mark.parametrize("dtype, dim", [(torch.bfloat16, 128), (torch.float32, 2), (torch.bfloat16, 3)])  # 16-, 4-, 1-byte paths
@pytest.mark.parametrize("to_pages", [False, True])
@pytest.mark.parametrize("span", [None, (3, 1), (0, 5), (7, 9)])  # whole pages, one token, a head, a tail
def test_cuda_copies_match_reference(method, dtype, dim, to_pages, span):
    torch.zeros(1, device="cuda")  # torch's context first, so is_pinned() can answer
    gen = torch.Generator().manual_seed(0)
    batch, heads, page_tokens, count, first = 3, 4, 16, 5, 2
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool = ts_kvcache.HostPagePool(2 * batch * heads * page_tokens * dim * itemsize)
    ids = pool.allocate(count)
    assert pool.pinned
    for i in ids:
        pool.page(i).copy_(torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8, generator=gen))
    capacity = (first + count) * page_tokens + 7
    slot = _random((2, batch, heads, capacity, dim), dtype, gen).cuda()
    want_slot = slot.cpu()
    want_pages = [pool.page(i).clone() for i in ids]
    offset, tokens = span or (0, None)
    copy_pages_reference(want_pages, want_slot, page_tokens, first, to_pages, offset, tokens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    _native.copy_pages(pool.addresses(ids), slot, page_tokens, first, to_pages, method=method,
                       stream=stream.cuda_stream, offset=offset, tokens=tokens)
    stream.synchronize()
    assert torch.equal(slot.cpu().view(torch.uint8), want_slot.view(torch.uint8))
    for i, want in zip(ids, want_pages):
        assert torch.equal(pool.page(i), want)


@pytest.mark.parametrize("resident", [0, 2, 6, [0, 5]])
@pytest.mark.parametrize("copy", ["engine", "kernel"])
def test_cuda_cache_matches_cat(resident, copy):
    gen = torch.Generator().manual_seed(1)
    cache = ts_kvcache.PagedKVCache(6, 24, resident_layers=resident, page_tokens=8, copy=copy)
    ref = ConcatCache(6)
    for n in [13, 1, 1, 1, 2, 5, 1, 1, 9, 1]:  # page boundaries and growth past max_tokens
        for layer in range(6):
            k = _random((3, 2, n, 64), torch.bfloat16, gen).cuda()
            v = _random((3, 2, n, 64), torch.bfloat16, gen).cuda()
            keys, values = cache.update(layer, k, v)
            want_k, want_v = ref.update(layer, k, v)
            assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        cache.check_invariants()
    torch.cuda.synchronize()
    if cache.offloaded and len(cache.offloaded) > 2:
        assert cache.stats["prefetched"] > 0


def test_cuda_auto_plan_keeps_what_fits_and_offloads_the_rest():
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    layers, batch, heads, dim, tokens = 8, 4, 8, 128, 4096
    layer_bytes = 2 * batch * heads * tokens * dim * 2
    fraction = min(1.0, 5.5 * layer_bytes / free)  # room for about 5 layers' worth
    cache = ts_kvcache.PagedKVCache(layers, tokens, vram_fraction=fraction)
    k = torch.zeros(batch, heads, 1, dim, dtype=torch.bfloat16, device="cuda")
    for layer in range(layers):
        cache.update(layer, k, k)
    assert 0 < len(cache.offloaded) < layers
    assert cache.memory()["device_bytes"] <= cache.plan["budget"] + layer_bytes


def test_cuda_decode_never_synchronizes_the_host():
    cache = ts_kvcache.PagedKVCache(6, 64, resident_layers=2, page_tokens=4)
    k = torch.randn(2, 2, 20, 64, device="cuda")
    for layer in range(6):
        cache.update(layer, k, k)
    torch.cuda.synchronize()
    one = torch.randn(2, 2, 1, 64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            for layer in range(6):
                cache.update(layer, one, one)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert cache.stats["prefetched"] > 0


def _decode(cache, layers, one, work=None, steps=4):
    for _ in range(steps):
        for layer in range(layers):
            keys, _values = cache.update(layer, one, one)
            if work is not None:
                work()
            keys.sum()  # the layer's attention reads its keys


def test_cuda_prefetch_overlaps_compute():
    """Offloaded layers' H2D fills run while the resident layers compute: decode with compute
    takes clearly less than the copies and the compute one after the other."""
    layers, batch, heads, dim, tokens = 8, 8, 8, 128, 4096
    cache = ts_kvcache.PagedKVCache(layers, tokens + 64, resident_layers=4, page_tokens=256)
    prompt = torch.randn(batch, heads, tokens, dim, dtype=torch.bfloat16, device="cuda")
    for layer in range(layers):
        cache.update(layer, prompt, prompt)
    one = torch.randn(batch, heads, 1, dim, dtype=torch.bfloat16, device="cuda")
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")

    def work():
        for _ in range(4):
            a @ a

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(lambda: _decode(cache, layers, one, work, steps=1))  # warm-up
    copies = timed(lambda: _decode(cache, layers, one))
    compute = timed(lambda: [work() for _ in range(4 * layers)])
    both = timed(lambda: _decode(cache, layers, one, work))
    print(f"copies {copies * 1e3:.1f} ms, compute {compute * 1e3:.1f} ms, both {both * 1e3:.1f} ms")
    assert cache.stats["prefetched"] >= 4 * 4
    assert both < 0.85 * (copies + compute)
