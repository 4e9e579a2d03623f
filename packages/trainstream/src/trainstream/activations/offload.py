"""ActivationOffloader: the saved activations of chosen blocks wait for backward in host memory.

While a paged block runs forward, every tensor autograd saves for backward goes through
``torch.autograd.graph.saved_tensors_hooks``: a tensor worth moving (dense, at least ``min_bytes``,
not a parameter or buffer) is copied on the D2H stream into a block of the pinned arena and its
VRAM is released once the copy is done; autograd keeps a ``Page`` in its place. In backward, the
first page a block needs brings back all of that block's pages, and those of the next
``prefetch_depth`` paged blocks, on the H2D stream, each after its own D2H copy; the compute stream
waits for a page only when autograd unpacks it.

A tensor saved more than once in one block's forward (the same tensor object at the same version:
the 16-bit input q/k/v's compact LoRA layers share) is one page with a user count; its device copy
in backward lives until the last user unpacks it.

Invariants: a page's host block is returned to the arena only after every copy that reads it has
completed (a page that dies retires its block with the event of its last copy; retired blocks are
freed once that event is done), so a reused block is never overwritten while still being read.
Device memory a D2H copy is reading is handed to that stream (``record_stream``), and at most
``max_inflight_bytes`` of it are in flight: beyond that the host waits for the oldest copy.
On the CPU the same path runs with memory copies.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch
import ts_pinned

from ..engine.channel import ChannelOwner, channel_for
from ..engine.hooks import EngineHook
from ..engine.interrupts import critical
from ..engine.slots import dense_layout_problem, flat

__all__ = ["ActivationOffloader"]


def _identity(t):
    return t


class Page:
    """One saved tensor in host memory (or kept as is when not worth moving)."""

    __slots__ = ("__weakref__", "block", "device", "done_d2h", "dtype", "fetched", "fetched_event", "host",
                 "kept", "offloader", "shape", "stride", "users")

    def __init__(self, offloader, block: int, kept: torch.Tensor | None = None):
        self.offloader = offloader
        self.block = block
        self.kept = kept
        self.users = 1  # saved variables holding this page; the fetched copy is dropped after the last
        self.host = self.fetched = self.fetched_event = self.done_d2h = None

    def __del__(self):
        offloader = self.offloader
        if offloader is not None and self.host is not None:
            offloader._retire(self.host, self.fetched_event or self.done_d2h)


class ActivationOffloader(ChannelOwner):
    """Pages the saved tensors of ``blocks[i]`` for each i in ``paged`` to host memory during forward.

    ``device``: where the model trains. ``prefetch_depth``: paged blocks brought back ahead of the one
    backward is in. ``max_inflight_bytes``: VRAM held by device-to-host copies not yet complete
    (default 1 GiB). ``min_bytes``: smaller tensors stay on the device. ``attach()`` installs the
    hooks, ``detach()`` removes them; ``stats()`` counts bytes and pages.
    """

    def __init__(self, blocks: list[torch.nn.Module], paged, *, device: torch.device, prefetch_depth: int = 1,
                 max_inflight_bytes: int | None = None, min_bytes: int = 1 << 20,
                 arena: ts_pinned.PinnedArena | None = None, candidates=None):
        self.blocks = list(blocks)
        self.paged = sorted(set(paged))
        # Blocks with hooks installed; set_paged() moves blocks among them between steps.
        self.candidates = sorted(set(self.paged if candidates is None else candidates) | set(self.paged))
        self.counted: set[int] = set()  # blocks whose saved bytes are measured but stay in VRAM
        self.skip = lambda t: False  # tensors that are not activations (streamed weights)
        self.device = torch.device(device)
        self.prefetch_depth = prefetch_depth
        self.max_inflight_bytes = (1 << 30) if max_inflight_bytes is None else max_inflight_bytes
        self.min_bytes = min_bytes
        self.arena = arena or ts_pinned.default_arena()
        self.channel = channel_for(self.device)
        self._pages: dict[int, list[weakref.ref]] = collections.defaultdict(list)
        self._retired: collections.deque = collections.deque()
        self._inflight: collections.deque = collections.deque()  # (event, nbytes) of D2H copies
        self._inflight_bytes = 0
        self._lock = threading.Lock()
        self._own: set[int] = set()  # storages of parameters and buffers: never paged
        self._handles, self._hooks, self._active = [], [], []
        # id(tensor) -> (weakref, version, Page or None) of what the block in forward saved so far: the
        # weakref proves the id still names that tensor (an id is reused only after its object died).
        self._saved: dict[int, tuple[weakref.ref, int, Page | None]] = {}
        self.counters = {"pages": 0, "shared": 0, "kept": 0, "d2h_bytes": 0, "h2d_bytes": 0, "prefetched": 0,
                         "pool_grown": 0, "pool_released": 0}
        self._live_bytes = 0  # host bytes held by pages (and retired blocks not yet freed)
        self.peak_live_bytes = 0  # the most held at once since the last grow_pool()
        self.block_bytes = [0] * len(self.blocks)  # bytes paged per block in the last forward

    # ---- installing ----------------------------------------------------------------

    def set_paged(self, paged, counted=()) -> None:
        """Between steps: which candidate blocks page (and which only count their saved bytes)."""
        paged, counted = set(paged), set(counted)
        unknown = sorted((paged | counted) - set(self.candidates))
        if unknown:
            raise ValueError(f"blocks {unknown} have no paging hooks (candidates: {self.candidates})")
        self.paged, self.counted = sorted(paged), counted - paged

    def attach(self) -> ActivationOffloader:
        for index in self.candidates:
            block = self.blocks[index]
            for t in [*block.parameters(), *block.buffers()]:
                self._own.add(t.untyped_storage().data_ptr())
            enter, leave = EngineHook(self._enter(index)), EngineHook(self._leave)
            self._hooks += [enter, leave]
            self._handles.append(block.register_forward_pre_hook(enter))
            self._handles.append(block.register_forward_hook(leave, always_call=True))  # also when forward raises
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        for hook in self._hooks:
            hook.disable()
        self._handles, self._hooks = [], []
        self._exit_interrupted()

    # The block hooks run eagerly under torch.compile: dynamo traced this bookkeeping of weak references
    # in a compiled model and put the pages themselves in the lists (backward then failed on them).
    def _enter(self, index: int):
        @torch.compiler.disable
        def enter(_module, _args):
            self._exit_interrupted()
            if not torch.is_grad_enabled() or (index not in self.paged and index not in self.counted):
                self._active.append(None)
                return
            self.block_bytes[index] = 0
            self._saved = {}
            self._pages[index] = [r for r in self._pages[index] if r() is not None]
            if index in self.counted:
                hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._count(index, t), _identity)
            else:
                hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(index, t), self._unpack)
            with critical():  # a Ctrl-C between the push and its record would leave the hooks on autograd's stack
                hooks.__enter__()
                self._active.append(hooks)

        return enter

    def _exit_interrupted(self) -> None:
        """Blocks are siblings, so when one is entered no other is active: what `_active` still holds was pushed by
        a forward that an interrupt stopped inside a block (torch runs always-called forward hooks on an
        Exception, not on a KeyboardInterrupt), and is popped here before it pages anything else."""
        if self._active:
            with critical():
                while self._active:
                    hooks = self._active.pop()
                    if hooks is not None:
                        hooks.__exit__(None, None, None)

    @torch.compiler.disable
    def _leave(self, _module, _args, _output) -> None:
        self._saved = {}
        with critical():  # popped from the record and from autograd's stack together, as pushed
            hooks = self._active.pop() if self._active else None
            if hooks is not None:
                hooks.__exit__(None, None, None)

    # ---- forward: out to host ---------------------------------------------------------

    def _worth_moving(self, t: torch.Tensor) -> bool:
        return (t.device == self.device and t.numel() * t.element_size() >= self.min_bytes
                and dense_layout_problem(t) is None and t.untyped_storage().data_ptr() not in self._own
                and not self.skip(t))

    def _seen(self, t: torch.Tensor) -> tuple[bool, Page | None]:
        """(whether this block's forward saved ``t`` already, unchanged since; its page)."""
        entry = self._saved.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return True, entry[2]
        return False, None

    def _count(self, index: int, t: torch.Tensor) -> torch.Tensor:
        if self._worth_moving(t) and not self._seen(t)[0]:
            self._saved[id(t)] = (weakref.ref(t), t._version, None)
            self.block_bytes[index] += t.numel() * t.element_size()
        return t

    def _pack(self, index: int, t: torch.Tensor) -> Page | torch.Tensor:
        if not self._worth_moving(t):
            self.counters["kept"] += 1
            return t
        seen, page = self._seen(t)
        if seen and page is not None:
            page.users += 1
            self.counters["shared"] += 1
            return page
        self._sweep()
        nbytes = t.numel() * t.element_size()
        self._bound_inflight(nbytes)
        page = Page(self, index)
        page.shape, page.stride, page.dtype = t.shape, t.stride(), t.dtype
        host = self.arena.empty(nbytes, torch.uint8, tag="activations", allow_pageable=True)
        after = self.channel.mark_compute()
        page.done_d2h = self.channel.to_host(flat(t.detach()), host.view(t.dtype), after)
        page.host = host
        with self._lock:
            self._live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self._live_bytes)
        if page.done_d2h is not None:
            with self._lock:
                self._inflight.append((page.done_d2h, nbytes))
                self._inflight_bytes += nbytes
        self._pages[index].append(weakref.ref(page))
        self._saved[id(t)] = (weakref.ref(t), t._version, page)
        self.counters["pages"] += 1
        self.counters["d2h_bytes"] += nbytes
        self.block_bytes[index] += nbytes
        return page

    def _bound_inflight(self, nbytes: int) -> None:
        while True:
            with self._lock:
                while self._inflight and self._inflight[0][0].query():
                    self._inflight_bytes -= self._inflight.popleft()[1]
                if not self._inflight or self._inflight_bytes + nbytes <= self.max_inflight_bytes:
                    return
                oldest = self._inflight[0][0]
            oldest.synchronize()

    # ---- backward: back to the device ------------------------------------------------------

    def _unpack(self, page: Page | torch.Tensor) -> torch.Tensor:
        if not isinstance(page, Page):
            return page
        if page.kept is not None:
            return page.kept
        if page.fetched is None:
            self._fetch_block(page.block)
            self._prefetch_after(page.block)
        self.channel.compute_wait(page.fetched_event)
        t = page.fetched
        page.users -= 1
        if page.users <= 0:  # the last user: the device copy is autograd's alone from here
            page.fetched = None
        if self.channel.is_cuda:
            t.record_stream(torch.cuda.current_stream(self.device))  # freed by compute: reuse waits for it
        return t

    def _fetch(self, page: Page) -> None:
        """Brings `page` back on the H2D stream, after its D2H copy (backward can reach the last paged
        block while the copies of its pages are still in flight: a fetch reading the host block before
        then read stale bytes and gave NaN)."""
        if page.fetched is not None or page.host is None:
            return
        page.fetched, page.fetched_event = self.channel.to_new_device_tensor(
            page.host.view(page.dtype), page.shape, page.stride, page.dtype, after=page.done_d2h)
        self.counters["h2d_bytes"] += page.host.numel()

    def _fetch_block(self, index: int) -> None:
        alive = [p for p in (ref() for ref in self._pages[index]) if p is not None]
        self._pages[index] = [weakref.ref(p) for p in alive]
        for page in alive:
            self._fetch(page)

    def _prefetch_after(self, index: int) -> None:
        earlier = [b for b in self.paged if b < index][::-1][: self.prefetch_depth]
        for b in earlier:
            before = self.counters["h2d_bytes"]
            self._fetch_block(b)
            if self.counters["h2d_bytes"] > before:
                self.counters["prefetched"] += 1

    # ---- returning host blocks ----------------------------------------------------------------

    def _retire(self, host: torch.Tensor, event) -> None:
        self._retired.append((event, host))  # deque.append: safe from autograd's threads

    def _sweep(self) -> None:
        """Frees retired host blocks whose last copy is done (the oldest first)."""
        while self._retired:
            event, _host = self._retired[0]
            if event is not None and not event.query():
                return
            _, host = self._retired.popleft()
            with self._lock:
                self._live_bytes -= host.numel()

    def synchronize(self) -> None:
        """Waits for every copy in flight and frees every retired host block."""
        self.channel.synchronize()
        with self._lock:
            self._inflight.clear()
            self._inflight_bytes = 0
        while self._retired:
            _, host = self._retired.popleft()
            with self._lock:
                self._live_bytes -= host.numel()

    def grow_pool(self, expected: int = 0) -> int:
        """Between steps: reserves page-locked slabs for as many page bytes as the last steps held at
        once (or ``expected``, when more), so the next steps carve pages from the arena instead of
        page-locking (and, on release, synchronizing for) each one on its own. Returns the bytes
        added (0 when the pool sufficed)."""
        needed = max(self.peak_live_bytes, expected)
        self.peak_live_bytes = self._live_bytes
        if needed == 0:
            return 0  # nothing pages: no pool (its margin alone would page-lock 4 MiB each step)
        stats = self.arena.stats()
        free = stats["arena_bytes"] - stats["arena_used"]
        want = int(needed * 1.05) + (4 << 20)
        if want <= free:
            return 0
        before = stats["arena_bytes"]
        after = self.arena.reserve(before + want - free)
        self.counters["pool_grown"] += after - before
        return after - before

    def shrink_pool(self, expected: int = 0) -> int:
        """Once a setting is final: returns to the system the wholly free slabs beyond what pages of
        ``expected`` bytes need (a paging trial that lost grew the pool for nothing). Waits for the
        copies in flight first, so their pages are free. Returns the bytes released."""
        self.synchronize()
        self.peak_live_bytes = self._live_bytes  # the trials' peaks no longer size the pool
        stats = self.arena.stats()
        want = int(expected * 1.05) + (4 << 20) if expected else 0
        if stats["arena_bytes"] - stats["arena_used"] <= want:
            return 0
        released = self.arena.trim(keep_bytes=stats["arena_used"] + want)
        self.counters["pool_released"] += released
        return released

    def stats(self) -> dict:
        """Cumulative pages, bytes each way and prefetched blocks; host bytes held by pages now."""
        live = sum(p.host.numel() for refs in self._pages.values() for p in (r() for r in refs)
                   if p is not None and p.host is not None)
        return {**self.counters, "host_bytes": live, "retired": len(self._retired)}
