"""The CUDA ordering protocol, run on the CPU with stand-in streams and events that log what the
cache asks for: every copy on a copy stream waits for the compute stream as it was when the copy
was issued, a fill never reads a page before its D2H copy, and the compute stream waits for a
slot's fill before the slot is used. (The copies themselves run on the CPU, so results are also
checked against torch.cat.)"""

from __future__ import annotations

from unittest import mock

import torch
import ts_kvcache
from ts_kvcache import _cache
from ts_kvcache.reference import ConcatCache


class Log:
    def __init__(self):
        self.ops: list[tuple] = []


class FakeEvent:
    log: Log

    def __init__(self, *args, **kwargs):
        self.stream = None
        self.index = None

    def record(self, stream):
        self.stream = stream
        self.index = len(stream.ops)  # everything queued on `stream` so far
        self.log.ops.append(("record", stream.name, self))

    def synchronize(self):
        self.log.ops.append(("host-sync", self))


class FakeStream:
    def __init__(self, name, log):
        self.name = name
        self.log = log
        self.ops: list[tuple] = []
        self.cuda_stream = hash(name)

    def wait_event(self, event):
        self.ops.append(("wait", event))
        self.log.ops.append(("wait", self.name, event))

    def wait_stream(self, other):
        event = FakeEvent()
        event.record(other)
        self.wait_event(event)


def _run(cache, ops, log, compute, streams):
    ref = ConcatCache(cache.num_layers)
    real = _cache.copy_pages
    by_handle = {s.cuda_stream: s for s in streams}

    def copy(addresses, slot, page_tokens, first, to_pages, method="engine", stream=0, **span):
        target = by_handle[stream]
        target.ops.append(("copy", to_pages, slot.data_ptr(), addresses.tolist()))
        log.ops.append(("copy", target.name, to_pages, slot.data_ptr(), addresses.tolist(), len(target.ops) - 1))
        return real(addresses, slot, page_tokens, first, to_pages, **span)

    gen = torch.Generator().manual_seed(0)
    with mock.patch.object(_cache, "copy_pages", copy), \
            mock.patch.object(torch.cuda, "Event", FakeEvent), \
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: compute):
        for layer, n in ops:
            k = torch.randn(2, 1, n, 4, generator=gen)
            log.ops.append(("update", layer))
            keys, values = cache.update(layer, k, k + 1)
            want_k, want_v = ref.update(layer, k, k + 1)
            assert torch.equal(keys, want_k) and torch.equal(values, want_v)
            log.ops.append(("use", layer, keys.data_ptr()))


def _cache_on_fake_streams(**kwargs):
    log = Log()
    FakeEvent.log = log
    compute, h2d, d2h = (FakeStream(name, log) for name in ("compute", "h2d", "d2h"))
    cache = ts_kvcache.PagedKVCache(streams=(h2d, d2h), **kwargs)
    # Plan on the CPU, then run the CUDA branches with the stand-ins.
    cache.update(0, torch.zeros(2, 1, 0, 4), torch.zeros(2, 1, 0, 4))
    cache._h2d, cache._d2h = h2d, d2h
    return cache, log, compute, (compute, h2d, d2h)


def _decode_ops(layers, prompt, steps):
    return [(layer, prompt) for layer in range(layers)] + [(layer, 1) for _ in range(steps) for layer in range(layers)]


def test_copies_wait_for_compute_and_pages_land_before_they_are_read():
    cache, log, compute, streams = _cache_on_fake_streams(num_layers=6, max_tokens=64, resident_layers=2,
                                                          page_tokens=3)
    _run(cache, _decode_ops(6, 7, 8), log, compute, streams)
    assert cache.stats["prefetched"] > 0
    _, h2d, d2h = streams
    assert any(op[0] == "copy" for op in h2d.ops) and any(op[0] == "copy" for op in d2h.ops)
    for stream in (h2d, d2h):
        waited_compute = False
        for op in stream.ops:
            if op[0] == "wait":
                waited_compute |= op[1].stream is compute
            elif op[0] == "copy":
                assert waited_compute, f"a copy on {stream.name} ran without waiting for compute"
    # A fill reads tokens of pages written by D2H copies issued before it: each one already waited
    # for (later D2H copies write other tokens of a partly filled page).
    waited_d2h = {"h2d": -1, "compute": -1}  # d2h ops before the newest D2H event each stream waited for
    written_so_far: list[tuple[int, set]] = []  # (index on d2h, pages)
    fills = 0
    for op in log.ops:
        if op[0] == "wait" and op[2].stream is d2h and op[1] in waited_d2h:
            waited_d2h[op[1]] = max(waited_d2h[op[1]], op[2].index)
        elif op[0] == "copy" and op[1] == "d2h":
            written_so_far.append((op[5], set(op[4])))
        elif op[0] == "copy" and not op[2]:
            fills += 1
            written = [i for i, pages in written_so_far if pages & set(op[4])]
            assert written and all(i < waited_d2h[op[1]] for i in written), "a fill may read a page before it lands"
    assert fills > 0


def test_compute_waits_for_each_fill_before_using_the_slot():
    cache, log, compute, streams = _cache_on_fake_streams(num_layers=5, max_tokens=64, resident_layers=[0, 2],
                                                          page_tokens=2)
    _run(cache, _decode_ops(5, 5, 6), log, compute, streams)
    pending: dict[int, FakeEvent] = {}  # slot address -> the fill event recorded after its copy
    last_copy_slot = None
    for op in log.ops:
        if op[0] == "copy" and op[1] == "h2d":
            last_copy_slot = op[3]
        elif op[0] == "record" and op[1] == "h2d" and last_copy_slot is not None:
            pending[last_copy_slot] = op[2]
            last_copy_slot = None
        elif op[0] == "wait" and op[1] == "compute":
            for slot, event in list(pending.items()):
                if event is op[2]:
                    del pending[slot]
        elif op[0] == "use":
            assert op[2] not in pending, f"layer {op[1]} used a slot whose fill the compute stream never waited for"


def test_a_fill_waits_for_the_compute_stream_recorded_after_the_slots_last_use():
    """The event a prefetch waits on is recorded after the update that last used its slot returned."""
    cache, log, compute, streams = _cache_on_fake_streams(num_layers=4, max_tokens=64, resident_layers=0,
                                                          page_tokens=2)
    _run(cache, _decode_ops(4, 6, 5), log, compute, streams)
    last_use: dict[int, int] = {}
    waited_at = -1
    for position, op in enumerate(log.ops):
        if op[0] == "use":
            last_use[op[2]] = position
        elif op[0] == "wait" and op[1] == "h2d" and op[2].stream is compute:
            waited_at = position
        elif op[0] == "copy" and op[1] == "h2d" and op[3] in last_use:
            assert last_use[op[3]] < waited_at, "a prefetch overwrote a slot before its last reader was queued"


def test_a_slot_changes_hands_only_after_its_d2h_copies_and_on_demand_fills_wait_for_pages():
    """Growth past max_tokens empties the slots, so layers refill on the compute stream too."""
    cache, log, compute, streams = _cache_on_fake_streams(num_layers=4, max_tokens=6, resident_layers=[1],
                                                          page_tokens=2)
    _run(cache, _decode_ops(4, 5, 9), log, compute, streams)
    assert cache.stats["gathered"] > 0 and cache.stats["reallocations"] > 0
    layer = None
    d2h_from: dict[int, list[tuple[int, int]]] = {}  # slot -> (layer, d2h op index) of copies out of it
    covered = -1  # d2h ops before the newest D2H event the compute stream waited for
    for position, op in enumerate(log.ops):
        if op[0] == "update":
            layer = op[1]
        elif op[0] == "copy" and op[1] == "d2h":
            d2h_from.setdefault(op[3], []).append((layer, op[5]))
        elif op[0] == "wait" and op[1] == "compute" and op[2].stream.name == "d2h":
            covered = max(covered, op[2].index)
        elif op[0] == "copy" and op[1] == "compute":  # an on-demand fill reads pages written so far: landed?
            d2h = [o for o in log.ops[:position] if o[0] == "copy" and o[1] == "d2h" and set(o[4]) & set(op[4])]
            assert all(o[5] < covered for o in d2h), "an on-demand fill may read a page before it lands"
        elif op[0] == "use":
            others = [index for owner, index in d2h_from.get(op[2], []) if owner != op[1]]
            assert all(index < covered for index in others), (
                f"layer {op[1]} took a slot another layer's D2H copy may still be reading")
