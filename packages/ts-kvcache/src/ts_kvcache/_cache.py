"""PagedKVCache: resident layers keep their keys and values in VRAM; offloaded layers
keep every token in host pages (the last one partly filled) and borrow one of a few
device slots while they run, filled ahead of time on a copy stream. VRAM holds the
resident layers and the slots, nothing per offloaded layer.

Ordering on CUDA (nothing here blocks the host, except ``release``):
- a prefetch into a slot waits, on the H2D stream, for the compute stream as it was when
  the prefetch was issued (the slot's previous layer has enqueued its attention by then)
  and for the last tokens written to host memory;
- the compute stream waits for a slot's fill before it touches the slot, and for the last
  D2H copy (which may still read the slot);
- an update's new tokens leave on the D2H stream, into their host pages, once the compute
  stream has written them into the slot. A fill reads only tokens written before it was
  issued; later D2H copies write other bytes of the same pages.
"""

from __future__ import annotations

import torch

from ._args import check_fraction, check_int, check_resident, spread
from ._native import copy_pages
from ._pool import HostPagePool

__all__ = ["PagedKVCache"]

_COPY_METHODS = ("auto", "engine", "kernel")


class _Slot:
    """A device buffer that holds one offloaded layer's tokens while it runs."""

    __slots__ = ("buffer", "layer", "prefetched", "ready", "stamp", "tokens")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.layer: int | None = None
        self.tokens = 0  # tokens of `layer` valid in the buffer (its pages first)
        self.prefetched = False  # filled ahead of time and not used yet
        self.ready: torch.cuda.Event | None = None  # the H2D fill in flight
        self.stamp = 0  # last use, for least-recently-used replacement


class PagedKVCache:
    """A KV cache for autoregressive generation whose offloaded layers keep their keys and
    values in host pages (page-locked, from ts-pinned). Inference only.

    ``num_layers``: attention layers. ``max_tokens``: the longest sequence expected (prompt
    plus new tokens); it sizes the buffers and the ``"auto"`` plan; longer ones reallocate.
    ``resident_layers``: ``"auto"`` (as many layers as fit in ``vram_fraction`` of the free
    VRAM at the first update; all of them on the CPU), an integer (the offloaded ones spread
    through the stack) or a list of layer indices. ``page_tokens``: tokens per host page.
    ``slots``: device slots for offloaded layers (2 or 3; one is filled ahead while another
    runs). ``copy``: ``"auto"``/``"engine"`` (strided copies on the copy engines) or
    ``"kernel"`` (an SM kernel that reads the page-locked pages directly).
    ``streams``: ``(h2d, d2h)`` CUDA streams to copy on, or a function of the device that
    returns them (default: the cache's own).
    ``arena``: the ``ts_pinned.PinnedArena`` the host pages come from (default: the
    process-wide one).
    ``working_bytes``: VRAM the caller's own computation needs beside the cache while it
    generates (its activations, logits): ``"auto"`` takes ``vram_fraction`` of the free VRAM
    but leaves at least 1.25 times this free. Bytes, or a function of the first update's keys that
    returns them (TrainStreamCache estimates it from the model's shapes).
    """

    def __init__(
        self,
        num_layers: int,
        max_tokens: int,
        *,
        resident_layers: str | int | list[int] = "auto",
        page_tokens: int = 256,
        vram_fraction: float = 0.5,
        slots: int = 2,
        copy: str = "auto",
        streams: tuple | None = None,
        arena=None,
        working_bytes=0,
    ):
        self.num_layers = check_int(num_layers, "num_layers", 1)
        self.max_tokens = check_int(max_tokens, "max_tokens", 1)
        self._resident_spec = check_resident(resident_layers, self.num_layers)
        self.page_tokens = check_int(page_tokens, "page_tokens", 1)
        self.vram_fraction = check_fraction(vram_fraction, "vram_fraction")
        self.slot_count = check_int(slots, "slots", 2, 3)
        if copy not in _COPY_METHODS:
            raise ValueError(f"copy={copy!r} is not valid; use one of {', '.join(_COPY_METHODS)}")
        self._copy = "engine" if copy == "auto" else copy
        if streams is not None and not callable(streams) and (not isinstance(streams, (tuple, list)) or len(streams) != 2):
            raise ValueError(
                f"streams={streams!r} must be None, a pair (h2d, d2h) of torch.cuda.Stream, or a function of the "
                "device returning one"
            )
        self._user_streams = streams
        if not callable(working_bytes) and (isinstance(working_bytes, bool) or not isinstance(working_bytes, int)
                                            or working_bytes < 0):
            raise ValueError(f"working_bytes={working_bytes!r} must be a non-negative integer or a function of the keys")
        self._working_bytes = working_bytes
        self._arena = arena
        self.plan: dict = {}
        self._stats = dict.fromkeys(
            ("h2d_bytes", "d2h_bytes", "prefetched", "gathered", "reused", "discarded", "reallocations"), 0
        )
        self._lengths = [0] * self.num_layers
        self._pages: list[list[int]] = [[] for _ in range(self.num_layers)]
        self._geometry: tuple | None = None
        spec = self._resident_spec
        self._resident: set[int] = set(spec or ())
        self._offloaded: list[int] = [] if spec is None else [i for i in range(self.num_layers) if i not in spec]
        self._upcoming: dict[int, list[int]] = {}
        self._buffers: dict[int, torch.Tensor] = {}
        self._slots: list[_Slot] = []
        self._capacity = 0
        self._pool: HostPagePool | None = None
        self._h2d = self._d2h = None
        self._d2h_done: torch.cuda.Event | None = None
        self._clock = 0

    # ---- public -----------------------------------------------------------

    @property
    def resident(self) -> list[int]:
        """Layers kept in VRAM (decided at the first update when ``"auto"``; empty before)."""
        return sorted(self._resident)

    @property
    def offloaded(self) -> list[int]:
        """Layers whose full pages live in host memory."""
        return list(self._offloaded)

    @property
    def stats(self) -> dict:
        """Counters: ``h2d_bytes``/``d2h_bytes`` copied (cumulative), ``pages`` (host pages
        holding tokens now), ``prefetched`` (an offloaded layer found its pages in a slot filled
        ahead of time), ``gathered`` (copied on demand), ``reused`` (still in the slot since the
        layer last ran), ``discarded`` (fills never used), ``reallocations`` (growth past
        ``max_tokens``)."""
        return dict(self._stats, pages=self._pool.in_use if self._pool else 0)

    def seq_length(self, layer: int = 0) -> int:
        """Tokens cached in ``layer``."""
        return self._lengths[self._check_layer(layer)]

    def memory(self) -> dict:
        """Bytes held: ``device_bytes`` (resident buffers and slots) and ``host_bytes``
        (host pages, used or free)."""
        tensors = [*self._buffers.values(), *(s.buffer for s in self._slots)]
        return {
            "device_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "host_bytes": self._pool.host_bytes if self._pool else 0,
        }

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``k``/``v`` ``[batch, kv_heads, new_tokens, head_dim]`` to ``layer`` and returns
        its keys and values so far, as strided views. An offloaded layer's views live in a shared
        slot: use them before the next offloaded layer's update (as attention does)."""
        layer = self._check_layer(layer)
        k, v = self._check_kv(layer, k, v)
        self._setup(k)
        n = k.shape[-2]
        if layer in self._resident:
            out = self._update_resident(layer, k, v, n)
        else:
            out = self._update_offloaded(layer, k, v, n)
        if self._slots:
            self._prefetch_after(layer)
        return out

    def reset(self) -> None:
        """Forgets every token; buffers and host pages are kept for the next sequences."""
        if self._h2d is not None:
            # Host pages are about to be rewritten: after any fill still reading them.
            self._d2h.wait_stream(self._h2d)
        for slot in self._slots:
            self._evict(slot)
        if self._pool is not None:
            for pages in self._pages:
                self._pool.free(pages)
        self._pages = [[] for _ in range(self.num_layers)]
        self._lengths = [0] * self.num_layers

    def release(self) -> None:
        """Forgets every token and frees every buffer and host page (waits for the cache's copies)."""
        self.reset()
        self._drop_buffers()
        self._geometry = None

    def check_invariants(self) -> None:
        """RuntimeError unless the page tables and the pool agree (for tests): every page in use
        belongs to exactly one offloaded layer, and each holds ``ceil(length / page_tokens)`` pages."""
        owned = [p for pages in self._pages for p in pages]
        if len(owned) != len(set(owned)):
            raise RuntimeError("PagedKVCache: a host page belongs to two layers")
        if self._pool is not None:
            self._pool.check_invariants()
            if set(owned) != self._pool._used:
                raise RuntimeError("PagedKVCache: the pool's pages in use differ from the page tables")
        for layer in range(self.num_layers):
            expected = 0 if layer in self._resident else -(-self._lengths[layer] // self.page_tokens)
            if len(self._pages[layer]) != expected:
                raise RuntimeError(f"PagedKVCache: layer {layer} holds {len(self._pages[layer])} pages, not {expected}")
        for slot in self._slots:
            if slot.layer is not None and slot.tokens > self._lengths[slot.layer]:
                raise RuntimeError(f"PagedKVCache: a slot holds more tokens than layer {slot.layer}")

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, max_tokens={self.max_tokens}, "
            f"resident={self.resident}, offloaded={self.offloaded}, page_tokens={self.page_tokens})"
        )

    # ---- checks and setup -------------------------------------------------

    def _check_layer(self, layer: int) -> int:
        return check_int(layer, "layer", 0, self.num_layers - 1)

    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError("update takes keys and values as torch tensors")
        if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                "update: keys and values must be [batch, kv_heads, new_tokens, head_dim] tensors of one shape, "
                f"dtype and device; got keys {tuple(k.shape)} {k.dtype} on {k.device}, values {tuple(v.shape)} "
                f"{v.dtype} on {v.device}"
            )
        if k.device.type not in ("cpu", "cuda"):
            raise ValueError(f"update: tensors must be on the CPU or a CUDA device, got {k.device}")
        return k.detach(), v.detach()

    def _setup(self, k: torch.Tensor) -> None:
        batch, heads, _new, head_dim = k.shape
        geometry = (batch, heads, head_dim, k.dtype, k.device)
        if geometry == self._geometry:
            return
        if self._geometry is not None:
            if any(self._lengths):
                b, h, d, dtype, device = self._geometry
                raise ValueError(
                    f"update: got keys {tuple(k.shape)} {k.dtype} on {k.device}, but the cache holds batch {b}, "
                    f"{h} kv heads, head_dim {d}, {dtype} on {device}; call reset() before a new batch"
                )
            self._drop_buffers()
        try:
            self._plan_and_allocate(k, geometry)
        except BaseException:
            self._drop_buffers()  # out of memory (host or device): a later update starts over
            self._geometry = None
            raise

    def _plan_and_allocate(self, k: torch.Tensor, geometry: tuple) -> None:
        batch, heads, _new, head_dim = k.shape
        self._geometry = geometry
        itemsize = k.element_size()
        capacity = self.max_tokens  # full pages lie below the length, so any capacity holds them
        layer_bytes = 2 * batch * heads * capacity * head_dim * itemsize
        page_bytes = 2 * batch * heads * self.page_tokens * head_dim * itemsize
        if self._resident_spec is not None:
            resident = self._resident_spec
        else:
            working = self._working_bytes(k) if callable(self._working_bytes) else self._working_bytes
            resident = self._auto_resident(k.device, layer_bytes, int(working))
        self._resident = set(resident)
        self._offloaded = [i for i in range(self.num_layers) if i not in self._resident]
        self.plan.update(layer_bytes=layer_bytes, page_bytes=page_bytes, resident=len(resident))
        self._upcoming = {}
        ahead = min(self.slot_count, len(self._offloaded)) - 1
        for layer in range(self.num_layers):
            after = [i for i in self._offloaded if i > layer] + [i for i in self._offloaded if i <= layer]
            self._upcoming[layer] = [i for i in after if i != layer][:ahead]
        self.plan["plans"] = self.plan.get("plans", 0) + 1
        self.plan["message"] = self._describe(layer_bytes)
        # Every buffer now, before generation's transient tensors: fewer holes in the allocator's pools.
        shape = (2, batch, heads, max(capacity, k.shape[-2]), head_dim)
        for layer in sorted(self._resident):
            self._buffers[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
        if not self._offloaded:
            return
        shape = (2, batch, heads, capacity, head_dim)
        self._capacity = capacity
        self._slots = [
            _Slot(torch.empty(shape, dtype=k.dtype, device=k.device))
            for _ in range(min(self.slot_count, len(self._offloaded)))
        ]
        self._pool = HostPagePool(page_bytes, arena=self._arena)
        self._pool.reserve(len(self._offloaded) * -(-self.max_tokens // self.page_tokens))
        if k.device.type == "cuda":
            if callable(self._user_streams):
                self._h2d, self._d2h = self._user_streams(k.device)
            elif self._user_streams is not None:
                self._h2d, self._d2h = self._user_streams
            else:
                self._h2d, self._d2h = torch.cuda.Stream(k.device), torch.cuda.Stream(k.device)

    def _describe(self, layer_bytes: int) -> str:
        gib = 1 << 30
        why = "as asked"
        if self._resident_spec is None:
            budget = self.plan.get("budget")
            why = ("auto, on the CPU" if budget is None else
                   f"auto: {budget / gib:.2f} GiB, {self.vram_fraction:g} of {self.plan['free_vram'] / gib:.2f} GiB "
                   f"free VRAM" + (f" but at most what leaves 1.25 x the model's own "
                                   f"{self.plan['working_bytes'] / gib:.2f} GiB free" if self.plan["working_bytes"]
                                   else ""))
        text = (f"KV cache: {len(self._resident)} of {self.num_layers} layers in VRAM ({why}), "
                f"{layer_bytes / gib:.3f} GiB each at {self.max_tokens} tokens")
        if self._offloaded:
            slots = min(self.slot_count, len(self._offloaded))
            text += (f"; layers {self._offloaded} in host pages of {self.page_tokens} tokens, "
                     f"run in {slots} device slot{'s' if slots > 1 else ''}")
        return text

    def _auto_resident(self, device: torch.device, layer_bytes: int, working_bytes: int = 0) -> list[int]:
        if device.type != "cuda":
            self.plan.update(budget=None, working_bytes=working_bytes)
            return list(range(self.num_layers))  # nothing to save on the host: keep every layer
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        # Memory torch has cached counts as free, except the holes inside segments still in use
        # ("inactive split" blocks): a layer's buffer rarely fits in one. (Counting such holes as free,
        # a third generate() in one process ran out of memory; docs/kvcache.md.)
        holes = torch.cuda.memory_stats(device).get("inactive_split_bytes.all.current", 0)
        free += torch.cuda.memory_reserved(device) - allocated - holes
        # A cap set with torch.cuda.set_per_process_memory_fraction is not in mem_get_info.
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)
        free = max(0, min(free, int(fraction * total) - allocated - holes))
        # vram_fraction of the free VRAM, but never into 1.25 x the caller's estimated working set: the
        # estimate leaves out attention scores, sampling and the allocator's slack. (The measured peak
        # matched TrainStreamCache's estimate to about 1 %; twice it, the earlier margin, left about the
        # working set's size of VRAM idle and kept more layers off the GPU; docs/kvcache.md.)
        budget = int(max(0, min(self.vram_fraction * free, free - working_bytes - working_bytes // 4)))
        self.plan.update(free_vram=free, working_bytes=working_bytes, budget=budget)
        if self.num_layers * layer_bytes <= budget:
            return list(range(self.num_layers))
        slot_bytes = min(self.slot_count, self.num_layers) * layer_bytes
        if slot_bytes + working_bytes + working_bytes // 4 > free:
            # Not even the device slots fit beside the working set: refuse now, with the numbers,
            # rather than run out of memory some layers into generation.
            gib = 1 << 30
            raise torch.OutOfMemoryError(
                f"KV cache: {min(self.slot_count, self.num_layers)} device slot(s) of {layer_bytes / gib:.3f} GiB "
                f"({self.max_tokens} tokens) and 1.25 x the {working_bytes / gib:.2f} GiB working estimate need "
                f"{(slot_bytes + working_bytes * 1.25) / gib:.2f} GiB; {free / gib:.2f} GiB of VRAM is free. "
                "Generate with a smaller batch or fewer new tokens, or free VRAM first.")
        room = budget - self.slot_count * layer_bytes
        count = min(max(room // layer_bytes, 0), self.num_layers - 1)
        offloaded = set(spread(self.num_layers, self.num_layers - count))
        return [i for i in range(self.num_layers) if i not in offloaded]

    def _drop_buffers(self) -> None:
        self._synchronize()
        self._buffers, self._slots = {}, []
        self._pool = None
        self._capacity = 0
        self._h2d = self._d2h = self._d2h_done = None

    def _synchronize(self) -> None:
        """Host waits for every copy of the cache (before its memory can go back)."""
        if self._d2h_done is not None:
            self._d2h_done.synchronize()
        for slot in self._slots:
            if slot.ready is not None:
                slot.ready.synchronize()
                slot.ready = None

    # ---- resident layers --------------------------------------------------

    def _update_resident(self, layer: int, k: torch.Tensor, v: torch.Tensor, n: int):
        start, end = self._lengths[layer], self._lengths[layer] + n
        buffer = self._buffers.get(layer)
        if buffer is None or buffer.shape[3] < end:
            old = buffer
            capacity = max(self.max_tokens, end) if old is None else max(end, old.shape[3] * 3 // 2)
            batch, heads, head_dim, dtype, device = self._geometry
            buffer = torch.empty((2, batch, heads, capacity, head_dim), dtype=dtype, device=device)
            if old is not None:
                buffer[:, :, :, :start].copy_(old[:, :, :, :start])
                self._stats["reallocations"] += 1
            self._buffers[layer] = buffer
        buffer[0, :, :, start:end].copy_(k)
        buffer[1, :, :, start:end].copy_(v)
        self._lengths[layer] = end
        return buffer[0, :, :, :end], buffer[1, :, :, :end]

    # ---- offloaded layers -------------------------------------------------

    def _update_offloaded(self, layer: int, k: torch.Tensor, v: torch.Tensor, n: int):
        start = self._lengths[layer]
        end = start + n
        if end > self._capacity:
            self._grow_slots(end)
        slot = self._acquire(layer)
        buffer = slot.buffer
        buffer[0, :, :, start:end].copy_(k)
        buffer[1, :, :, start:end].copy_(v)
        pages = self._pages[layer]
        short = -(-end // self.page_tokens) - len(pages)
        if short > 0:
            pages.extend(self._pool.allocate(short))
        if n:
            self._scatter(buffer, layer, start, end)
        slot.tokens = end
        self._lengths[layer] = end
        return buffer[0, :, :, :end], buffer[1, :, :, :end]

    def _acquire(self, layer: int) -> _Slot:
        """The slot that holds ``layer``'s tokens so far, filled now where a prefetch did not."""
        slot = next((s for s in self._slots if s.layer == layer), None)
        if slot is None:
            slot = self._victim(exclude=self._upcoming[layer]) or self._victim(exclude=())
            self._evict(slot)
            slot.layer = layer
        self._wait_slot(slot)
        length = self._lengths[layer]
        if length:
            if slot.tokens >= length:
                self._stats["prefetched" if slot.prefetched else "reused"] += 1
            else:
                self._gather(slot, slot.tokens, length, prefetch=False)
                self._stats["gathered"] += 1
        slot.prefetched = False
        slot.tokens = length
        self._clock += 1
        slot.stamp = self._clock
        return slot

    def _prefetch_after(self, current: int) -> None:
        """Fills free slots with the next offloaded layers' host pages, on the H2D stream."""
        targets = self._upcoming[current]
        protected = {current, *targets}
        for layer in targets:
            length = self._lengths[layer]
            if not length:
                continue
            slot = next((s for s in self._slots if s.layer == layer), None)
            if slot is not None and slot.tokens >= length:
                continue
            if slot is None:
                slot = self._victim(exclude=protected)
                if slot is None:
                    return
                self._evict(slot)
                slot.layer = layer
            self._gather(slot, slot.tokens, length, prefetch=True)
            slot.tokens = length
            slot.prefetched = True
            self._clock += 1
            slot.stamp = self._clock

    def _victim(self, exclude) -> _Slot | None:
        free = [s for s in self._slots if s.layer not in exclude]
        return min(free, key=lambda s: s.stamp) if free else None

    def _evict(self, slot: _Slot) -> None:
        if slot.layer is not None and slot.prefetched:
            self._stats["discarded"] += 1
        slot.layer, slot.tokens, slot.prefetched = None, 0, False

    def _grow_slots(self, tokens: int) -> None:
        capacity = max(tokens, self._capacity * 3 // 2)
        batch, heads, head_dim, dtype, device = self._geometry
        for slot in self._slots:
            self._wait_slot(slot)  # the compute stream orders the old buffer's reuse after its copies
            self._evict(slot)
            slot.buffer = torch.empty((2, batch, heads, capacity, head_dim), dtype=dtype, device=device)
        self._capacity = capacity
        self._stats["reallocations"] += 1

    # ---- copies -----------------------------------------------------------

    def _method(self) -> str:
        return self._copy if self._pool.pinned else "engine"

    def _wait_slot(self, slot: _Slot) -> None:
        if self._h2d is None:
            return
        current = torch.cuda.current_stream(slot.buffer.device)
        if slot.ready is not None:
            current.wait_event(slot.ready)
            slot.ready = None
        if self._d2h_done is not None:
            current.wait_event(self._d2h_done)

    def _copy_tokens(self, buffer: torch.Tensor, layer: int, start: int, end: int, to_pages: bool, stream) -> int:
        """Copies tokens ``start .. end`` of ``layer`` between ``buffer`` and its host pages, split at
        page boundaries: whole pages in one native call, a partly covered page at either end in its
        own. Returns the bytes copied."""
        pt = self.page_tokens
        pages = self._pages[layer]
        runs: list[list[int]] = []  # [first page, last page + 1, offset, tokens]
        for page in range(start // pt, -(-end // pt)):
            lo, hi = max(start, page * pt) - page * pt, min(end, page * pt + pt) - page * pt
            if runs and lo == 0 and hi == pt and runs[-1][2:] == [0, pt]:
                runs[-1][1] += 1
            else:
                runs.append([page, page + 1, lo, hi - lo])
        extra = {} if stream is None else {"method": self._method(), "stream": stream}
        for first, stop, offset, tokens in runs:
            copy_pages(self._pool.addresses(pages[first:stop]), buffer, pt, first, to_pages, offset=offset,
                       tokens=tokens, **extra)
        return (end - start) * (self._pool.page_bytes // pt)

    def _gather(self, slot: _Slot, start: int, end: int, *, prefetch: bool) -> None:
        """Tokens ``start .. end`` of the slot's layer from its host pages into the slot."""
        layer = slot.layer
        if self._h2d is None:
            self._stats["h2d_bytes"] += self._copy_tokens(slot.buffer, layer, start, end, False, None)
            return
        device = slot.buffer.device
        if not prefetch:  # on the compute stream, which _wait_slot ordered
            stream = torch.cuda.current_stream(device).cuda_stream
            self._stats["h2d_bytes"] += self._copy_tokens(slot.buffer, layer, start, end, False, stream)
            return
        issued = torch.cuda.Event()
        issued.record(torch.cuda.current_stream(device))
        self._h2d.wait_event(issued)
        if self._d2h_done is not None:
            self._h2d.wait_event(self._d2h_done)
        self._stats["h2d_bytes"] += self._copy_tokens(slot.buffer, layer, start, end, False, self._h2d.cuda_stream)
        slot.ready = torch.cuda.Event()
        slot.ready.record(self._h2d)

    def _scatter(self, buffer: torch.Tensor, layer: int, start: int, end: int) -> None:
        """Tokens ``start .. end`` of ``layer`` from ``buffer`` into its host pages."""
        if self._d2h is None:
            self._stats["d2h_bytes"] += self._copy_tokens(buffer, layer, start, end, True, None)
            return
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(buffer.device))
        self._d2h.wait_event(written)
        self._stats["d2h_bytes"] += self._copy_tokens(buffer, layer, start, end, True, self._d2h.cuda_stream)
        self._d2h_done = torch.cuda.Event()
        self._d2h_done.record(self._d2h)
