"""PagedKVCache.update returns exactly what a torch.cat cache returns, whatever the page size,
batch, resident/offloaded mix, update order, growth past max_tokens and resets; and its
counters agree with what happened (CPU: the same page tables and slots the GPU runs)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import ts_kvcache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ts_kvcache import _cache
from ts_kvcache.reference import ConcatCache

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw):
    layers = draw(st.integers(1, 5))
    resident = draw(
        st.one_of(
            st.integers(0, layers),
            st.lists(st.integers(0, layers - 1), unique=True, max_size=layers),
        )
    )
    return {
        "num_layers": layers,
        "max_tokens": draw(st.integers(1, 12)),
        "resident_layers": resident,
        "page_tokens": draw(st.integers(1, 7)),
        "slots": draw(st.sampled_from([2, 3])),
    }


@st.composite
def shapes(draw):
    return (draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 5)))


def _kv(gen, batch, heads, n, dim, dtype):
    k = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    return k, v


@contextlib.contextmanager
def counting_copies():
    """Counts the tokens the cache really copies each way (the native calls it makes)."""
    copied = {"h2d": 0, "d2h": 0}
    real = _cache.copy_pages

    def spy(addresses, slot, page_tokens, first, to_pages, offset=0, tokens=None, **kwargs):
        per_page = page_tokens - offset if tokens is None else tokens
        copied["d2h" if to_pages else "h2d"] += addresses.numel() * per_page
        return real(addresses, slot, page_tokens, first, to_pages, offset=offset, tokens=tokens, **kwargs)

    with mock.patch.object(_cache, "copy_pages", spy):
        yield copied


class Tracker:
    """What the counters must say, from the updates alone."""

    def __init__(self, cache: ts_kvcache.PagedKVCache):
        self.cache = cache
        self.bytes_written = 0
        self.fills = 0  # offloaded updates that found host pages

    def before(self, layer: int) -> None:
        if layer in self.cache.offloaded:
            self._start = self.cache.seq_length(layer)
            self.fills += self._start > 0

    def after(self, layer: int) -> None:
        if layer in self.cache.offloaded:  # every new token goes to host memory at once
            written = self.cache.seq_length(layer) - self._start
            self.bytes_written += written * token_bytes(self.cache)

    def check(self) -> None:
        cache = self.cache
        cache.check_invariants()
        stats = cache.stats
        expected_pages = sum(-(-cache.seq_length(i) // cache.page_tokens) for i in cache.offloaded)
        assert stats["pages"] == expected_pages
        assert stats["d2h_bytes"] == self.bytes_written
        assert stats["prefetched"] + stats["gathered"] + stats["reused"] == self.fills
        assert set(cache.resident) | set(cache.offloaded) == set(range(cache.num_layers))
        assert not set(cache.resident) & set(cache.offloaded)


def token_bytes(cache) -> int:
    """Bytes of one token's keys and values, every batch row and head."""
    return cache.plan["page_bytes"] // cache.page_tokens


def _check_step(cache, ref, tracker, layer, k, v):
    tracker.before(layer)
    keys, values = cache.update(layer, k, v)
    tracker.after(layer)
    want_k, want_v = ref.update(layer, k, v)
    assert keys.shape == want_k.shape and values.shape == want_v.shape
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert cache.seq_length(layer) == ref.seq_length(layer)


@SETTINGS
@given(config=configs(), shape=shapes(), chunks=st.lists(st.integers(0, 9), min_size=1, max_size=8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_generation_order_matches_cat(config, shape, chunks, dtype, seed):
    """A prompt, then decode steps, every layer in order (as a model runs)."""
    gen = torch.Generator().manual_seed(seed)
    cache = ts_kvcache.PagedKVCache(**config)
    ref = ConcatCache(config["num_layers"])
    tracker = Tracker(cache)
    batch, heads, dim = shape
    with counting_copies() as copied:
        for n in chunks:
            for layer in range(config["num_layers"]):
                _check_step(cache, ref, tracker, layer, *_kv(gen, batch, heads, n, dim, dtype))
            tracker.check()
            per_token = token_bytes(cache) if cache.plan else 0
            assert cache.stats["h2d_bytes"] == copied["h2d"] * per_token
            assert cache.stats["d2h_bytes"] == copied["d2h"] * per_token


@SETTINGS
@given(config=configs(), shape=shapes(), seed=st.integers(0, 2**16),
       ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 8), st.booleans()), min_size=1, max_size=25))
def test_any_update_order_and_resets_match_cat(config, shape, seed, ops):
    """Layers updated in any order, with resets between sequences (and a new batch after one)."""
    gen = torch.Generator().manual_seed(seed)
    layers = config["num_layers"]
    cache = ts_kvcache.PagedKVCache(**config)
    ref = ConcatCache(layers)
    tracker = Tracker(cache)
    batch, heads, dim = shape
    for layer, n, reset in ops:
        if reset and layer == 0:
            cache.reset()
            ref = ConcatCache(layers)
            batch = 1 + (batch % 3)  # a new batch size: the cache re-plans its buffers
            tracker.check()
            continue
        _check_step(cache, ref, tracker, layer % layers, *_kv(gen, batch, heads, n, dim, torch.float32))
        tracker.check()


def test_growth_past_max_tokens_reallocates_and_stays_exact():
    gen = torch.Generator().manual_seed(1)
    cache = ts_kvcache.PagedKVCache(3, 8, resident_layers=[1], page_tokens=4)
    ref = ConcatCache(3)
    tracker = Tracker(cache)
    for n in [6, 1, 1, 1, 7, 1, 20]:
        for layer in range(3):
            _check_step(cache, ref, tracker, layer, *_kv(gen, 3, 2, n, 8, torch.float32))
    tracker.check()
    assert cache.seq_length() == 37
    assert cache.stats["reallocations"] >= 2  # the slots and the resident buffer both grew


def test_decode_prefetches_every_offloaded_layer_after_the_first_step():
    """Steady-state decode: each offloaded layer finds its pages prefetched into a slot."""
    gen = torch.Generator().manual_seed(2)
    cache = ts_kvcache.PagedKVCache(6, 40, resident_layers=3, page_tokens=4)
    assert cache.offloaded == [1, 3, 5] and cache.resident == [0, 2, 4]  # spread through the stack
    for n in [12, 1, 1]:
        for layer in range(6):
            cache.update(layer, *_kv(gen, 2, 2, n, 4, torch.float32))
    before = cache.stats
    for _ in range(5):
        for layer in range(6):
            cache.update(layer, *_kv(gen, 2, 2, 1, 4, torch.float32))
    after = cache.stats
    assert after["prefetched"] - before["prefetched"] == 15
    assert after["gathered"] == before["gathered"]
    # Each fill moves every token of its layer once (2*2*2*4 floats each): layers 3 and 5 at 14..18
    # tokens; layer 1 is filled after layer 5's update, a step ahead, so at 15..19.
    assert token_bytes(cache) == 2 * 2 * 2 * 4 * 4
    moved = sum(range(15, 20)) + 2 * sum(range(14, 19))
    assert after["h2d_bytes"] - before["h2d_bytes"] == moved * token_bytes(cache)


def test_a_lone_offloaded_layer_keeps_its_slot_and_copies_nothing_back():
    """One offloaded layer gets one slot, which still holds it at its next update: its pages go
    to host memory but never need to come back."""
    gen = torch.Generator().manual_seed(4)
    cache = ts_kvcache.PagedKVCache(3, 16, resident_layers=2, page_tokens=2)
    assert cache.offloaded == [1]
    for n in [5, 1, 1, 1]:
        for layer in range(3):
            cache.update(layer, *_kv(gen, 1, 1, n, 2, torch.float32))
    stats = cache.stats
    assert stats["reused"] == 3 and stats["prefetched"] == stats["gathered"] == 0
    assert stats["h2d_bytes"] == 0 and stats["pages"] == 4


def test_reset_forgets_tokens_and_keeps_memory_for_the_next_prompt():
    gen = torch.Generator().manual_seed(3)
    cache = ts_kvcache.PagedKVCache(4, 16, resident_layers=1, page_tokens=2)
    for layer in range(4):
        cache.update(layer, *_kv(gen, 2, 1, 9, 4, torch.float32))
    held = cache.memory()
    assert held["host_bytes"] > 0 and held["device_bytes"] > 0
    assert cache.stats["pages"] == 3 * 5  # 9 tokens: 4 full pages and a partly filled one
    cache.reset()
    assert [cache.seq_length(i) for i in range(4)] == [0, 0, 0, 0]
    assert cache.stats["pages"] == 0
    assert cache.memory() == held  # buffers and pages kept for reuse
    ref = ConcatCache(4)
    for layer in range(4):
        k, v = _kv(gen, 2, 1, 5, 4, torch.float32)
        keys, values = cache.update(layer, k, v)
        want_k, want_v = ref.update(layer, k, v)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    cache.check_invariants()
    cache.release()
    assert cache.memory() == {"device_bytes": 0, "host_bytes": 0}


def test_memory_counts_resident_buffers_slots_and_pages():
    cache = ts_kvcache.PagedKVCache(5, 10, resident_layers=[0, 4], page_tokens=4)
    k = torch.zeros(2, 3, 1, 8)
    for layer in range(5):
        cache.update(layer, k, k)
    itemsize = 4
    layer_bytes = 2 * 2 * 3 * 10 * 8 * itemsize  # capacity: max_tokens
    page_bytes = 2 * 2 * 3 * 4 * 8 * itemsize
    # 2 resident buffers + 2 slots, nothing per offloaded layer; 3 offloaded layers x 3 pages reserved.
    assert cache.memory()["device_bytes"] == 4 * layer_bytes
    assert cache.memory()["host_bytes"] == 3 * 3 * page_bytes


def test_all_resident_on_cpu_with_auto():
    cache = ts_kvcache.PagedKVCache(3, 8)
    assert cache.resident == [] and cache.offloaded == []  # decided at the first update
    cache.update(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert cache.resident == [0, 1, 2] and cache.offloaded == []
    assert cache.memory()["host_bytes"] == 0


@pytest.mark.parametrize("page_tokens", [1, 3, 256])
def test_views_are_strided_into_the_buffers(page_tokens):
    cache = ts_kvcache.PagedKVCache(2, 300, resident_layers=[0], page_tokens=page_tokens)
    k = torch.randn(2, 2, 5, 4)
    for layer in range(2):
        keys, values = cache.update(layer, k, k + 1)
        assert keys.shape == (2, 2, 5, 4) and torch.equal(values, k + 1)
        assert keys.stride(2) == 4 and keys.stride(1) >= 300 * 4  # a view of the capacity
