"""The host page pool (no page lost or shared, hypothesis) and the native page copies
against the plain-PyTorch reference (CPU path; the CUDA paths are in test_cuda.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
import ts_kvcache
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_kvcache import _native
from ts_kvcache.reference import copy_pages_reference


@settings(max_examples=80, deadline=None)
@given(page_bytes=st.integers(1, 64), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=40))
def test_pool_never_loses_or_shares_a_page(page_bytes, ops):
    pool = ts_kvcache.HostPagePool(page_bytes)
    owners: list[list[int]] = []
    for allocate, n in ops:
        if allocate or not owners:
            owners.append(pool.allocate(n))
        else:
            pool.free(owners.pop(n % len(owners)))
        pool.check_invariants()
        held = [p for pages in owners for p in pages]
        assert len(held) == len(set(held)) == pool.in_use
        # Held pages are disjoint byte ranges of the pool's memory.
        spans = sorted((a, a + page_bytes) for a in pool.addresses(held).tolist())
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
        assert pool.host_bytes == pool.capacity * page_bytes


def test_pool_refuses_a_double_free_and_keeps_its_state():
    pool = ts_kvcache.HostPagePool(8)
    pages = pool.allocate(3)
    pool.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages)
    pool.check_invariants()
    assert pool.in_use == 2


def test_pool_pages_view_their_memory():
    pool = ts_kvcache.HostPagePool(16)
    a, b = pool.allocate(2)
    pool.page(a).fill_(1)
    pool.page(b).fill_(2)
    assert pool.page(a).data_ptr() == pool.addresses([a]).item()
    assert pool.page(a).sum().item() == 16 and pool.page(b).sum().item() == 32


def test_out_of_host_memory_is_a_memory_error_naming_the_fix(monkeypatch):
    import ts_pinned

    def refuse(*args, **kwargs):
        raise MemoryError("page-locking refused")

    real = ts_pinned.empty
    monkeypatch.setattr(ts_pinned, "empty", refuse)
    cache = ts_kvcache.PagedKVCache(2, 8, resident_layers=0, page_tokens=2)
    k = torch.arange(6.0).view(1, 1, 3, 2)
    with pytest.raises(MemoryError, match=r"resident_layers=.*page-locking refused"):
        cache.update(0, k, k)
    assert cache.seq_length(0) == 0 and cache.memory() == {"device_bytes": 0, "host_bytes": 0}
    # Once memory is back, the same cache works.
    monkeypatch.setattr(ts_pinned, "empty", real)
    keys, values = cache.update(0, k, k + 1)
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    # Running out while the pool grows mid-sequence leaves the cache as it was.
    monkeypatch.setattr(ts_pinned, "empty", refuse)
    more = torch.arange(40.0).view(1, 1, 20, 2)
    with pytest.raises(MemoryError):
        cache.update(0, more, more)
    assert cache.seq_length(0) == 3
    cache.check_invariants()
    monkeypatch.setattr(ts_pinned, "empty", real)
    keys, _ = cache.update(0, more, more)
    assert torch.equal(keys, torch.cat([k, more], dim=2))


def _pages_for(pool, count, dtype):
    ids = pool.allocate(count)
    for i in ids:
        pool.page(i).copy_(torch.randint(0, 256, (pool.page_bytes,), dtype=torch.uint8))
    return ids


@st.composite
def spans(draw, page_tokens):
    """(offset, tokens) within a page, or None for whole pages."""
    if draw(st.booleans()):
        return None
    offset = draw(st.integers(0, page_tokens - 1))
    return offset, draw(st.integers(1, page_tokens - offset))


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), dim=st.integers(1, 9), page_tokens=st.integers(1, 5),
       extra=st.integers(0, 6), first=st.integers(0, 3), count=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]), to_pages=st.booleans(), data=st.data())
def test_native_copy_matches_reference(batch, heads, dim, page_tokens, extra, first, count, dtype, to_pages, data):
    span = data.draw(spans(page_tokens))
    offset, tokens = span or (0, None)
    # A span may end short of the last page's end: the slot then needs only its tokens.
    short = 0 if span is None or count == 0 else page_tokens - offset - tokens
    capacity = (first + count) * page_tokens - short + extra
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool = ts_kvcache.HostPagePool(2 * batch * heads * page_tokens * dim * itemsize)
    ids = _pages_for(pool, count, dtype)
    slot = torch.randint(0, 100, (2, batch, heads, capacity, dim)).to(dtype)
    want_slot = slot.clone()
    want_pages = [pool.page(i).clone() for i in ids]
    copy_pages_reference(want_pages, want_slot, page_tokens, first, to_pages, offset, tokens)
    _native.copy_pages(pool.addresses(ids), slot, page_tokens, first, to_pages, offset=offset, tokens=tokens)
    assert torch.equal(slot.view(torch.uint8) if dtype != torch.uint8 else slot,
                       want_slot.view(torch.uint8) if dtype != torch.uint8 else want_slot)
    for i, want in zip(ids, want_pages):
        assert torch.equal(pool.page(i), want)


def test_native_copy_refuses_pages_past_the_slot():
    pool = ts_kvcache.HostPagePool(2 * 1 * 1 * 2 * 4 * 4)
    ids = pool.allocate(3)
    slot = torch.zeros(2, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="run past the slot row"):
        _native.copy_pages(pool.addresses(ids), slot, 2, 0, False)
    with pytest.raises(ValueError, match="null address"):
        _native.copy_pages(torch.zeros(1, dtype=torch.int64), slot, 2, 0, False)
    with pytest.raises(ValueError, match="must lie within"):
        _native.copy_pages(pool.addresses(ids[:1]), slot, 2, 0, False, offset=1, tokens=2)
    # A slot row of 4 tokens holds pages 0 and 1 of 2 tokens, not a token of page 2.
    _native.copy_pages(pool.addresses(ids[:1]), slot, 2, 1, False, offset=0, tokens=2)
    with pytest.raises(ValueError, match="run past the slot row"):
        _native.copy_pages(pool.addresses(ids[:1]), slot, 2, 2, False, offset=0, tokens=1)


def test_native_copy_refuses_a_slot_that_is_not_the_whole_buffer():
    from ts_kvcache import _core

    slot = torch.zeros(2, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="must equal the slot's"):
        _core.copy_pages(torch.ones(1, dtype=torch.int64), slot, 2, 8, 8, 0, False, 0, 0)

