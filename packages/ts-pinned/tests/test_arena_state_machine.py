"""Property-based test of the allocator: random reserve / alloc / free / set_slab_bytes / trim
sequences against a model of the arena; every step checks the invariants."""

from __future__ import annotations

import itertools

import torch
import ts_pinned
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from ts_pinned import _core

ALIGN = _core.ALIGNMENT
DTYPES = [torch.uint8, torch.bool, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int64,
          torch.float64, torch.complex64]
TAGS = ["", "weights", "grads", "opt"]


def aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


class Live:
    """One allocation: the tensor, an optional view of it, and what the model expects."""

    def __init__(self, tensor, view, ptr, length, requested, tag, fallback, seed):
        self.tensor, self.view = tensor, view
        self.ptr, self.length, self.requested, self.tag = ptr, length, requested, tag
        self.fallback, self.seed = fallback, seed

    def expected_bytes(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 256, (self.requested,), dtype=torch.uint8, generator=g)

    def holder(self) -> torch.Tensor:
        return self.tensor if self.tensor is not None else self.view


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.live: dict[int, Live] = {}
        self.next_id = 0
        self.slots: list[int | None] = []  # model of the slab sizes by slot; None: trimmed, reused first

    @initialize(
        slab=st.sampled_from([ALIGN, 1000, 4096, 3 * ALIGN + 7, 16384, 65536]),
        cap=st.one_of(st.none(), st.just(0), st.integers(1, 96).map(lambda k: k * 1024 + 100)),
    )
    def make_arena(self, slab, cap):
        self.arena = ts_pinned.PinnedArena(slab, cap)
        self.slab = slab
        self.cap = cap

    # ---- model helpers -------------------------------------------------------------

    def stats(self) -> dict:
        return self.arena.stats()

    @property
    def slabs(self) -> list[int]:
        return [b for b in self.slots if b is not None]

    def add_slab(self, nbytes: int) -> None:
        if None in self.slots:
            self.slots[self.slots.index(None)] = nbytes
        else:
            self.slots.append(nbytes)

    def growth(self, length: int, reserved: int) -> int:
        """Bytes the arena adds for a request of `length` it cannot carve; 0 = fallback."""
        want = max(aligned(self.slab), length)
        if self.cap is None:
            return want
        room = max(self.cap - reserved, 0) // ALIGN * ALIGN
        return min(want, room) if room >= length else 0

    # ---- rules ---------------------------------------------------------------------

    @rule(extra=st.integers(0, 40_000), cap_mode=st.sampled_from(["keep", "raise", "exact"]))
    def reserve(self, extra, cap_mode):
        before = self.stats()
        reserved = before["arena_bytes"]
        bytes_now = reserved + extra
        cap = {"keep": 0, "raise": bytes_now + 50_000, "exact": bytes_now}[cap_mode]
        result = self.arena.reserve(bytes_now, cap)
        if cap > 0:
            self.cap = max(cap, reserved)
        while reserved < bytes_now:
            want = aligned(min(self.slab, bytes_now - reserved))
            self.add_slab(want)
            reserved += want
        if self.cap is not None:
            self.cap = max(self.cap, reserved)
        after = self.stats()
        assert result == after["arena_bytes"] == reserved
        assert after["arena_cap"] == self.cap
        assert after["arena_used"] == before["arena_used"]
        assert after["live_blocks"] == before["live_blocks"]

    @rule(
        numel=st.one_of(st.integers(0, 64), st.integers(65, 30_000)),
        dtype=st.sampled_from(DTYPES),
        tag=st.sampled_from(TAGS),
        two_d=st.booleans(),
        make_view=st.sampled_from(["none", "slice", "reshape", "dtype"]),
        seed=st.integers(0, 2**31 - 1),
    )
    def alloc(self, numel, dtype, tag, two_d, make_view, seed):
        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = (2, numel) if two_d else (numel,)
        requested = 2 * numel * itemsize if two_d else numel * itemsize
        before = self.stats()
        t = self.arena.empty(shape, dtype, tag)
        after = self.stats()
        assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
        if requested == 0:
            assert after == before
            return
        length = aligned(requested)
        fallback = after["arena_fallbacks"] == before["arena_fallbacks"] + 1
        # The model decides whether the arena carves, grows or falls back.
        if before["arena_largest_free"] >= length:
            assert not fallback
            assert after["arena_bytes"] == before["arena_bytes"]
        else:
            grow = self.growth(length, before["arena_bytes"])
            if grow:
                assert not fallback
                assert after["arena_bytes"] == before["arena_bytes"] + grow
                self.add_slab(grow)
            else:
                assert fallback, "fell back although the cap left room"
                assert after["arena_bytes"] == before["arena_bytes"]
                assert after["fallback_bytes"] == before["fallback_bytes"] + length
        assert after["arena_cap"] == before["arena_cap"]
        assert after["live_blocks"] == before["live_blocks"] + 1

        raw = t.view(-1).view(torch.uint8) if t.numel() else t
        entry = Live(t, None, t.data_ptr(), length, requested, tag, fallback, seed)
        raw.copy_(entry.expected_bytes())
        if make_view == "slice":
            entry.view = t.view(-1)[1:] if t.numel() > 1 else t.view(-1)
        elif make_view == "reshape":
            entry.view = t.reshape(-1)
        elif make_view == "dtype":
            entry.view = raw
        self.live[self.next_id] = entry
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        key = data.draw(st.sampled_from(sorted(self.live)))
        entry = self.live[key]
        if entry.view is not None and entry.tensor is not None:
            # Drop the tensor first: the view alone must keep the block alive.
            used = self.stats()["arena_used"]
            entry.tensor = None
            assert self.stats()["arena_used"] == used
            self.check_contents(entry)
            if data.draw(st.booleans(), label="keep view for now"):
                return
        del self.live[key]
        entry.tensor = entry.view = None

    @rule(slab=st.sampled_from([ALIGN, 777, 4096, 8192 + 1, 65536]))
    def set_slab_bytes(self, slab):
        self.arena.set_slab_bytes(slab)
        self.slab = slab
        assert self.stats()["slab_bytes"] == slab

    @precondition(lambda self: not self.live)
    @rule(keep=st.integers(0, 200_000))
    def trim(self, keep):
        """With nothing allocated every slab is free: the latest go first while more than keep is reserved."""
        reserved = sum(self.slabs)
        expect = 0
        for i in reversed(range(len(self.slots))):
            if reserved <= keep:
                break
            if self.slots[i] is not None:
                reserved -= self.slots[i]
                expect += self.slots[i]
                self.slots[i] = None
        assert self.arena.trim(keep) == expect
        assert self.stats()["arena_bytes"] == reserved

    @precondition(lambda self: self.live)
    @rule()
    def free_everything(self):
        self.live.clear()
        self.check_all_returned()

    # ---- invariants ----------------------------------------------------------------

    def check_contents(self, entry: Live) -> None:
        holder = entry.holder()
        base = torch.empty(0, dtype=torch.uint8).set_(holder.untyped_storage())
        got = base[: entry.requested]
        assert holder.untyped_storage().data_ptr() == entry.ptr
        assert torch.equal(got, entry.expected_bytes()), "block contents changed"

    def check_all_returned(self) -> None:
        s = self.stats()
        assert s["arena_used"] == 0
        assert s["live_blocks"] == 0
        assert s["fallback_bytes"] == 0
        assert s["by_tag"] == {}
        # Every slab has coalesced back into one free range.
        assert s["arena_largest_free"] == (max(self.slabs) if self.slabs else 0)
        self.arena.check_invariants()

    @invariant()
    def native_invariants(self):
        if hasattr(self, "arena"):
            self.arena.check_invariants()

    @invariant()
    def stats_add_up(self):
        if not hasattr(self, "arena"):
            return
        s = self.stats()
        arena_blocks = [e for e in self.live.values() if not e.fallback]
        assert s["arena_used"] == sum(e.length for e in arena_blocks)
        assert s["fallback_bytes"] == sum(e.length for e in self.live.values() if e.fallback)
        assert s["live_blocks"] == len(self.live)
        tags: dict[str, int] = {}
        for e in self.live.values():
            tags[e.tag] = tags.get(e.tag, 0) + e.requested
        assert s["by_tag"] == tags
        assert s["arena_slabs"] == len(self.slabs)
        assert s["arena_bytes"] == sum(self.slabs)
        assert s["arena_used"] <= s["arena_bytes"]
        assert s["arena_largest_free"] <= s["arena_bytes"] - s["arena_used"]
        if self.cap is not None:
            assert s["arena_bytes"] <= s["arena_cap"] == self.cap

    @invariant()
    def blocks_aligned_and_disjoint(self):
        ranges = sorted((e.ptr, e.ptr + e.length) for e in self.live.values())
        for start, _ in ranges:
            assert start % ALIGN == 0
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, "two live blocks overlap"

    @invariant()
    def contents_intact(self):
        for entry in self.live.values():
            self.check_contents(entry)

    def teardown(self):
        # No assertions here: after a failing step the traceback still holds that
        # step's tensors and would mask the real error. `free_everything` checks
        # that every byte comes back.
        self.live.clear()


ArenaMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestArenaStateMachine = ArenaMachine.TestCase
