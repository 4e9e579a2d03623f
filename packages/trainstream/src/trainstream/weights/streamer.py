"""WeightStreamer: the weights of chosen blocks live in host memory and visit the GPU.

Frozen weights always stream with their block. Trained weights stream too when they are most of
the block's bytes (a full fine-tune; LoRA adapters stay in VRAM): their optimizer state is on the
host, the host AdamW writes each rounded update straight into the block's host copy, and the
block's next fetch carries it, so a streamed trained weight is never uploaded on its own
(``engine/slots.py``, invariant 7).

Each streamed block's frozen parameters are packed into one page-locked host buffer (beyond the
page-lock budget, pageable), and the block has one device buffer whose *storage* exists only
while the block is resident: at most ``prefetch_depth + 2`` blocks at once. A block is fetched
(one H2D copy) when it is about to run, in forward, recomputation and backward alike (a forward
pre-hook on the block, and a hook on its output's gradient), and the next ``prefetch_depth`` blocks
in that direction are fetched behind it. The hooks are the block's, not its modules': a compiled
forward (``compile_blocks``) is one backward node, which the output's hook still precedes, and the hooks
never trace (``torch.compiler.disable``), so ``torch.compile`` of the block or the model runs them eagerly.

While a block is resident its parameters point at the device buffer (``param.data``); otherwise
at their host copies, so a read of the model (``state_dict``, ``deepcopy``, user code) always sees
the right values (as CPU tensors when not resident). Why the storage,
not a new tensor per visit: autograd saves views of a weight (``W.t()`` for a linear layer);
views share the storage object, so re-materializing the same storage makes them valid again in
backward. (A tensor per visit would leave those views on memory another block has reused.)

Invariants:
  1. The host copy is complete and authoritative (frozen weights do not change in training); a
     device buffer is a copy of it while resident, and has no storage otherwise.
  2. A device buffer's storage is allocated while the H2D stream is current and handed to the
     compute stream at each use (``record_stream``), so freeing it waits for the kernels that
     read it, and the copy into it never races memory the compute stream just freed.
  3. The compute stream uses a block only after its copy (an event), and the block in use is
     never evicted.
  4. VRAM held by streamed blocks stays near ``capacity`` blocks although the host runs ahead of
     the GPU: an evicted buffer returns to the allocator only once the compute stream is past its
     last use, so before a fetch allocates, the host waits for all but ``_FREEING_SLACK`` of the
     evictions still pending on the GPU. (Unbounded, the host queues the copies of the whole
     stack; under a VRAM cap the allocator then frees its cache and synchronizes, mid-step.)
  5. A block with trained weights is *stale* from the moment an update of one of them is queued until
     its next fetch, which first waits for those updates (``update_queued``, ``wait_applied``). A stale
     block's device copy is dropped at ``step()`` (``drop_stale``) and, outside backward, when it is
     used again; never during backward, whose later nodes still read the weights the forward used.
     The host never writes a host copy while a copy from it is in flight: the worker waits for the
     block's newest fetch (the slot's ``upload_event``). A weight written in place while resident (a
     user edit: its version moves) is copied back to the host before the device copy is dropped.
  6. Under data parallel with several ranks on a machine (``shared``), the host copies of all streamed
     blocks are one shared-memory region per machine (``shared_host``), filled once by the machine's
     lowest rank and never written by a fetch; each process page-locks its mapping for itself.
     (``load_state_dict`` writes it from every rank: the same values, as every rank loads the same state.)
"""

from __future__ import annotations

import collections
import time

import torch
import ts_pinned

from .._units import fmt_bytes
from ..engine import interrupts
from ..engine.channel import ChannelOwner, channel_for
from ..engine.hooks import EngineHook
from .copy_timer import CopyTimer
from .packed_source import PackedHostSource
from .sources import HostSource, PeerSource
from .streamed_block import (
    StreamedBlock,
    frozen_params_of,
    nbytes_of,
    quantized_tensors,
    streams_trained,
    tensors_in,
    trained_params_of,
    view_in,
)

__all__ = ["HostSource", "PeerSource", "WeightStreamer", "frozen_params_of", "trained_params_of"]


# What a streamed QuantLinear says when a new weight is assigned (PEFT's merge): the streamer's host copy of
# its codes would keep the old values.
ASSIGN_REFUSAL = ("this quantized weight streams from host memory while the model is wrapped (param_offload), "
                  "so a new value would not reach its host copy; call trainstream.unwrap(model) first, then merge")
_FREEING_SLACK = 1


class _StateDictHook(EngineHook):
    """An EngineHook that ``register_state_dict_post_hook`` can mark (it sets an attribute on the hook)."""  # evicted buffers still in use on the GPU when a fetch allocates (invariant 4)


class WeightStreamer(ChannelOwner):
    """Streams the weights of ``blocks[i]`` for each i in ``streamed`` (frozen ones; trained ones per ``trained``).

    ``prepare()`` (before the model moves to the device) copies them into host buffers and points
    the parameters there; ``attach()`` creates the device buffers (without storage) and installs
    the hooks; ``remove()`` puts the weights back on the device (``to_device``) or leaves them on
    the host, as ordinary tensors.
    """

    def __init__(self, blocks: list[torch.nn.Module], streamed, *, device: torch.device, prefetch_depth: int = 1,
                 arena: ts_pinned.PinnedArena | None = None, shared: bool | None = None,
                 timeout: float | None = None, trained: bool | None = False):
        """``shared``: the host copies of a data-parallel run are one per machine (invariant 7); None: when
        an initialized process group has more than one rank (as ``distributed=None``), False: never.
        ``timeout``: of its set-up's collectives (default ``trainstream.distributed.DEFAULT_TIMEOUT_S``).
        ``trained``: whether the blocks' trained weights stream too (None: where they are most of a
        block's bytes, ``streams_trained``); they then need ``bind_updates`` before training."""
        if shared is not None and not isinstance(shared, bool):
            raise ValueError(f"shared={shared!r} is not valid; use None, True or False")
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.prefetch_depth = prefetch_depth
        self.arena = arena or ts_pinned.default_arena()
        self.channel = channel_for(self.device)
        blocks_ = {}
        for i in sorted(set(streamed)):
            extra = trained_params_of(self.blocks[i]) if streams_trained(self.blocks[i], trained) else []
            blocks_[i] = StreamedBlock(i, frozen_params_of(self.blocks[i]) + extra, trained=len(extra))
        self.streamed = {i: b for i, b in blocks_.items() if b.params}
        self.capacity = self.prefetch_depth + 2  # resident blocks at most
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # resident streaming blocks
        self._freeing: collections.deque = collections.deque()  # compute-stream events after evictions
        self._current: int | None = None
        # (block, direction) whose next blocks its use() prefetched; any eviction clears it. Another use() of
        # the block in that direction (one hook per output that needs a gradient, a checkpoint's recomputation
        # through the block's call) then skips the walk over the block list.
        self._prefetched_after: tuple[int, int] | None = None
        self._handles, self._hooks = [], []
        self.peak_resident = 0
        self.source: HostSource | PeerSource = HostSource()  # where fetched bytes come from
        self._qweights: dict[int, tuple] = {}  # id(QuantLinear) -> (module, its streamed QuantizedTensor)
        self.shared, self.timeout = shared, timeout
        self.region = None  # shared_host.SharedRegion when the host copies are the machine's (invariant 7)
        self.shared_message = None  # what prepare() decided about sharing, for the event log
        self.copy_timer = CopyTimer()  # the rate the fetches reach while copying
        self.counters = {"fetches": 0, "h2d_bytes": 0, "link_bytes": 0, "prefetched": 0, "evictions": 0, "host_waits": 0,
                         "update_waits": 0, "written_back": 0}
        # Trained weights (invariant 5): the newest queued update per block, the blocks whose device copy
        # is older than their host copy, and how to wait for updates (the engine's, from bind_updates).
        self._pending: dict[int, int] = {}
        self._stale: set[int] = set()
        self.wait_applied = None

    # ---- setting up -----------------------------------------------------------------

    @property
    def param_ids(self) -> set[int]:
        return {id(p) for b in self.streamed.values() for _m, _n, p in b.params}

    @property
    def trained_blocks(self) -> list[int]:
        """The streamed blocks whose trained weights stream with them."""
        return [i for i, b in self.streamed.items() if b.trained]

    def trained_bytes(self) -> int:
        return sum(nbytes_of(b.trained_params) for b in self.streamed.values() if b.trained)

    def host_copy(self, param: torch.Tensor) -> torch.Tensor:
        """The flat host copy of a streamed parameter (where its updates are written)."""
        for b in self.streamed.values():
            for (_m, _n, p), offset in zip(b.params, b.offsets):
                if p is param:
                    return self._view(b.host, offset, p).view(-1)
        raise KeyError("not a streamed parameter")

    def bind_updates(self, slots, wait_applied) -> None:
        """The engine's slots of the streamed trained weights, and its wait for queued host updates
        (``HostUpdater.wait_applied``). Before the first fetch."""
        by_param = {id(s.param): s for s in slots}
        for b in self.streamed.values():
            b.slots = [by_param[id(p)] for _m, _n, p in b.trained_params if id(p) in by_param]
        self.wait_applied = wait_applied

    def update_queued(self, index: int, sequence: int) -> None:
        """An update of a weight of block `index` was queued (engine, main thread): invariant 5."""
        self._pending[index] = sequence
        self._stale.add(index)

    def _wait_updates(self, index: int) -> None:
        sequence = self._pending.pop(index, None)
        if sequence is not None:
            self.counters["update_waits"] += 1
            self.wait_applied(sequence)
        self._stale.discard(index)

    def drop_stale(self) -> None:
        """step(): the device copies older than their host copies are dropped (invariant 5), so reads
        after step() see the host copies the updates write."""
        for index in [i for i in self._lru if i in self._stale]:
            with interrupts.critical():  # an eviction is several statements: never half done
                self._evict(index)

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.streamed.values())

    _view = staticmethod(view_in)

    def private_host_bytes(self) -> int:
        """Host bytes this process alone holds for streamed blocks (0 when they are the machine's)."""
        return 0 if self.region is not None else self.host_bytes()

    def _wants_sharing(self) -> bool:
        if self.shared is False or not self.streamed:
            return False
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _share(self) -> dict[int, torch.Tensor] | None:
        """Collective: {block index: its host buffer} in the machine's shared region, or None (private)."""
        from .. import distributed as tsd
        from . import shared_host

        bases, total = {}, 0
        for i, b in self.streamed.items():
            bases[i], total = total, total + b.nbytes
        layout = [(i, n, str(p.dtype), tuple(p.shape)) for i, b in self.streamed.items() for _m, n, p in b.params]

        def fill(region: torch.Tensor) -> None:
            for i, b in self.streamed.items():
                for (_m, _n, p), offset in zip(b.params, b.offsets):
                    self._view(region, bases[i] + offset, p).copy_(p.detach())

        timeout = tsd.DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout
        self.region, self.shared_message = shared_host.share(total, shared_host.layout_digest(layout), fill,
                                                             device=self.device, timeout=timeout)
        if self.region is None:
            return None
        return {i: self.region.tensor[bases[i]:bases[i] + b.nbytes] for i, b in self.streamed.items()}

    def prepare(self) -> None:
        """Copies each streamed block's frozen weights into one host buffer; the parameters then
        point at their host copies (the old storage is released where nothing else holds it).
        Collective under data parallel (invariant 7)."""
        for b in self.streamed.values():
            for module, name, _p in b.params:
                if name == "qweight.data":  # what after_load() gives back to the module
                    self._qweights[id(module)] = (module, module.__dict__["qweight"])
                    module.assign_refusal = ASSIGN_REFUSAL  # a merge would miss the host copy
        shared = self._share() if self._wants_sharing() else None
        for i, b in self.streamed.items():
            if shared is not None:  # the machine's leader filled it
                host = shared[i]
            else:
                host = self.arena.empty(b.nbytes, torch.uint8, tag="weights", allow_pageable=True)
                for (_m, _n, p), offset in zip(b.params, b.offsets):
                    self._view(host, offset, p).copy_(p.detach())
            for (_m, _n, p), offset in zip(b.params, b.offsets):
                p.data = self._view(host, offset, p)
            b.host = host

    def use_packing(self) -> str:
        """Frozen bf16 weights of the streamed blocks cross the link exponent-packed (``packed_source.py``),
        after ``prepare()``. Returns what it did, for the event log."""
        if self.region is not None:
            return "stream_packing: not used: the host copies are the machine's shared region"
        host = PackedHostSource(self.arena, self.channel.is_cuda).pack(self.streamed)
        self.source = host
        stats = host.stats()
        if not host.blocks:
            return "stream_packing: no streamed block packs to 90 % of its bytes or less; they stream as stored"
        return (f"stream_packing: {len(host.blocks)} of {len(self.streamed)} streamed blocks cross the link "
                f"exponent-packed, {stats['packed_ratio']:.3f} of their bytes (lossless; "
                f"{fmt_bytes(stats['packed_bytes'])} of host memory beside the plain copies)")

    def _host_source(self):
        return self.source.fallback if isinstance(self.source, PeerSource) else self.source

    def attach(self) -> WeightStreamer:
        if self.region is not None and self.channel.is_cuda:
            why = self.region.register()
            if why is not None:
                self.shared_message += f"; pageable in this process: {why}"
        for b in self.streamed.values():
            b.device = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            b.device.untyped_storage().resize_(0)
            if self.region is not None:
                b.pinned = self.channel.is_cuda and self.region.registered
            else:
                b.pinned = self.channel.is_cuda and self.arena.is_pinned(b.host)
        for index in self.streamed:
            block = self.blocks[index]
            hooks = [EngineHook(self._before_forward(index)), EngineHook(self._after_forward(index))]
            self._hooks += hooks
            self._handles += [block.register_forward_pre_hook(hooks[0]), block.register_forward_hook(hooks[1])]
        self._hook_state_dicts()
        return self

    def _hook_state_dicts(self) -> None:
        """``state_dict()`` gives each streamed weight as a view of its host copy, never of a block's device
        buffer: an eviction frees that buffer's memory under any view of it, and the host copy is the newest
        value anyway (invariant 5). The host copy is freed only when its last view dies, so a state dict
        taken while wrapped stays readable after ``unwrap()`` (``sd = model.state_dict(); unwrap(model);
        torch.save(sd, f)``). Quantized codes travel in their module's extra state and are left alone."""
        owners: dict[int, tuple[torch.nn.Module, list]] = {}
        for b in self.streamed.values():
            for (module, name, p), offset in zip(b.params, b.offsets):
                if "." not in name:
                    owners.setdefault(id(module), (module, []))[1].append((name, b, offset, p))
        for module, entries in owners.values():
            hook = _StateDictHook(self._host_views(entries))
            self._hooks.append(hook)
            self._handles.append(module.register_state_dict_post_hook(hook))

    def _host_views(self, entries: list):
        def hook(_module, state_dict, prefix, _metadata):
            for name, b, offset, p in entries:
                key = prefix + name
                if key in state_dict and not isinstance(state_dict[key], torch.nn.Parameter):  # keep_vars=False
                    state_dict[key] = self._view(b.host, offset, p)
        return hook

    # ---- hooks ---------------------------------------------------------------------------

    def _before_forward(self, index: int):
        @torch.compiler.disable  # traced, the fetch would not happen where the compiled code reads the weights
        def hook(_module, _args):
            # A forward inside backward is a recomputation: the next blocks are the earlier ones.
            self.use(index, -1 if torch._C._current_graph_task_id() >= 0 else 1)
        return hook

    def _after_forward(self, index: int):
        """Backward needs the block again before the first node that reads its weights: those nodes
        all come after the output's own node (a compiled forward's one node included), so a hook on
        the output's gradient fetches it. (A module backward hook would do too, but it reorders
        gradient sums: not bit-exact.)"""
        def on_grad(_grad):
            self.use(index, -1)

        @torch.compiler.disable
        def hook(_module, _args, output):
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad and t.grad_fn is not None:
                        t.register_hook(on_grad)
        return hook

    def use(self, index: int, ahead: int = 1) -> None:
        """Block `index` is about to run: resident before the compute stream continues; the next
        ``prefetch_depth`` streamed blocks in direction `ahead` are fetched behind it."""
        self._current = index
        self._fetch(index)
        b = self.streamed[index]
        if b.ready is not None or not b.used:
            self.channel.compute_wait(b.ready)
        if self.channel.is_cuda and not b.used:
            b.device.record_stream(torch.cuda.current_stream(self.device))  # invariant 2
            b.used = True
        key = (index, 1 if ahead > 0 else -1)
        if key == self._prefetched_after:
            return
        order = sorted(self.streamed) if ahead > 0 else sorted(self.streamed, reverse=True)
        later = [i for i in order if (i > index if ahead > 0 else i < index)][: self.prefetch_depth]
        for i in later:
            if i not in self._lru:
                self._fetch(i)
                self.counters["prefetched"] += 1
        self._prefetched_after = key

    # ---- resident blocks --------------------------------------------------------------------

    def _point(self, b: StreamedBlock, device: bool) -> None:
        """Invariant 1: resident weights are the device copies, the others the host copies."""
        for (_m, _n, p), offset in zip(b.params, b.offsets):
            p.data = self._view(b.device if device else b.host, offset, p)

    def _fetch(self, index: int) -> None:
        if index in self._lru:
            if index not in self._stale or torch._C._current_graph_task_id() >= 0:  # never in backward: inv. 5
                self._lru.move_to_end(index)
                return
            self._evict(index)
        while len(self._lru) >= self.capacity:
            victim = next((i for i in self._lru if i != self._current), None)
            if victim is None:
                break
            self._evict(victim)
        b = self.streamed[index]
        if b.trained:
            self._wait_updates(index)  # the host copy holds every queued update before it is read
        if self.channel.is_cuda:
            self._wait_for_freed()
            h2d = self.channel.h2d
            with torch.cuda.device(self.device), torch.cuda.stream(h2d):
                b.device.untyped_storage().resize_(b.nbytes)
                started = self.copy_timer.start(h2d)
                moved = self.source.copy(index, b.host, b.pinned, b.device, h2d)
                self.copy_timer.finish(started, h2d, moved)
                b.ready = torch.cuda.Event()
                b.ready.record(h2d)
        else:
            b.device.untyped_storage().resize_(b.nbytes)
            started = time.perf_counter()
            moved = self.source.copy(index, b.host, False, b.device, None)
            self.copy_timer.host(time.perf_counter() - started, moved)
            b.ready = None
        b.used = False
        for slot in b.slots:
            slot.upload_event = b.ready  # the worker's next write of this host copy waits for this copy
        b.versions = [p._version for _m, _n, p in b.trained_params]
        self._point(b, device=True)
        self.channel.stats.count("h2d", b.nbytes)
        self._lru[index] = None
        self.peak_resident = max(self.peak_resident, len(self._lru))
        self.counters["fetches"] += 1
        self.counters["h2d_bytes"] += b.nbytes
        self.counters["link_bytes"] += moved

    def _write_back_edits(self, b: StreamedBlock) -> None:
        """Invariant 5: trained weights written in place while resident go back to the host copy."""
        seen = {id(s.param): s.weight_version for s in b.slots}  # an edit the engine followed is in its update
        edited = [(p, offset) for (_m, _n, p), offset, version in zip(b.trained_params, b.trained_offsets, b.versions)
                  if p._version != version and seen.get(id(p)) != p._version]
        if not edited:
            return
        self._wait_updates(b.index)  # an update still queued must not land on top of the edit
        for p, offset in edited:
            self._view(b.host, offset, p).copy_(p.detach())  # p is the device view; blocking copy
            self.counters["written_back"] += 1

    def _evict(self, index: int, free: bool = True) -> None:
        """The block's weights point at their host copies again. free: its device buffer's memory is released
        now, under every view of it (the engine's autograd-saved ones are refilled before use); False (at
        unwrap, for good): the buffer is only let go, its memory freed when the last view of it dies."""
        b = self.streamed[index]
        if b.trained:
            self._write_back_edits(b)
        if self.channel.is_cuda and not b.used:
            # Fetched ahead but never used: the compute stream never saw it; the copy must finish.
            torch.cuda.current_stream(self.device).wait_event(b.ready)
            b.device.record_stream(torch.cuda.current_stream(self.device))
        self._point(b, device=False)
        if not free:
            b.device = torch.empty(0, dtype=torch.uint8, device=self.device)
            self._lru.pop(index, None)
            self.counters["evictions"] += 1
            return
        b.device.untyped_storage().resize_(0)  # freed once the compute stream is past its uses
        if self.channel.is_cuda:
            freed = torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            self._freeing.append(freed)
        self._lru.pop(index, None)
        self._prefetched_after = None
        self.counters["evictions"] += 1

    def _wait_for_freed(self) -> None:
        """Invariant 4: at most _FREEING_SLACK evicted buffers still wait for the GPU."""
        while self._freeing and (len(self._freeing) > _FREEING_SLACK or self._freeing[0].query()):
            event = self._freeing.popleft()
            if not event.query():
                event.synchronize()
                self.counters["host_waits"] += 1

    # ---- peer pools --------------------------------------------------------------------------

    def host_blocks(self) -> dict[int, torch.Tensor]:
        """{block index: its host buffer}: what a peer pool places (the same on every rank)."""
        return {i: b.host for i, b in self.streamed.items()}

    def use_peer(self, pool) -> None:
        """From now on, blocks in `pool` come from their owner GPU (between steps)."""
        self.source = PeerSource(pool, self._host_source())

    def close_peer(self) -> None:
        """Collective when a pool is in use: every rank must call it (unwrap)."""
        if isinstance(self.source, PeerSource):
            self.synchronize_device()
            pool, self.source = self.source.pool, self.source.fallback
            pool.close()

    def synchronize_device(self) -> None:
        if self.channel.is_cuda:
            torch.cuda.synchronize(self.device)

    def evict_all(self) -> None:
        for index in list(self._lru):
            self._evict(index)

    def check_load(self, model: torch.nn.Module, state_dict: dict, prefix: str) -> None:
        """Before ``load_state_dict`` changes anything: a streamed quantized weight may take new values,
        not a new layout (its host copy and device buffer are sized for this one)."""
        from ts_quant import QuantizedTensor

        names = {id(m): n for n, m in model.named_modules()}
        for module, streamed in self._qweights.values():
            key = f"{prefix}{names[id(module)]}{'.' if names[id(module)] else ''}_extra_state"
            if key in state_dict:
                self._check_layout(module, streamed, QuantizedTensor.from_state_dict(state_dict[key]))

    def _check_layout(self, module: torch.nn.Module, streamed, loaded) -> dict:
        ours = dict(quantized_tensors(streamed, "qweight"))
        new = dict(quantized_tensors(loaded, "qweight")) if loaded is not None else {}
        same = (loaded is not None and set(new) == set(ours)
                and all(getattr(loaded, k, None) == getattr(streamed, k) for k in ("format", "shape", "block_size"))
                and all(new[n].shape == t.shape and new[n].dtype == t.dtype for n, t in ours.items()))
        if not same:
            raise ValueError(f"load_state_dict would give the streamed quantized weight of {type(module).__name__} "
                             f"a different layout (format, shape or block size); nothing was loaded. Unwrap the "
                             f"model to load a differently quantized state")
        return new

    def after_load(self) -> None:
        """``load_state_dict`` (after ``evict_all``): a ts-quant ``QuantLinear`` of a streamed block got a
        new ``qweight`` object (its extra state). Its values go into the streamed host copies and the
        module keeps the streamed object, whose derived plans are dropped."""
        replaced = []
        for module, streamed in self._qweights.values():
            loaded = module.__dict__.get("qweight")
            if loaded is streamed:
                continue
            try:
                new = self._check_layout(module, streamed, loaded)  # check_load saw it already, unless bypassed
            except ValueError:
                for m, q in self._qweights.values():  # every streamed weight keeps its values and object
                    m.qweight = q
                raise
            replaced.append((module, streamed, dict(quantized_tensors(streamed, "qweight")), new))
        for module, streamed, ours, new in replaced:
            for name, t in ours.items():
                t.copy_(new[name])
            streamed._cache.clear()  # plans and swizzled scales derive from the old values
            module.qweight = streamed

    # ---- teardown ---------------------------------------------------------------------------

    def origin(self) -> torch.device | None:
        """Where the streamed weights are before prepare() (for undoing a failed wrap())."""
        for b in self.streamed.values():
            return b.params[0][2].device
        return None

    def owns(self, t: torch.Tensor) -> bool:
        """True for a view of a resident block's device buffer (a weight autograd saved)."""
        if t.device != self.device:
            return False
        ptr = t.data_ptr()
        for i in list(self._lru):
            base = self.streamed[i].device
            if base.data_ptr() <= ptr < base.data_ptr() + self.streamed[i].nbytes:
                return True
        return False

    def remove(self, to_device: bool = True, device: torch.device | None = None) -> None:
        """Removes the hooks; the weights become ordinary tensors on the device (or `device`, or the host)."""
        for handle in self._handles:
            handle.remove()
        for hook in self._hooks:
            hook.disable()
        self._handles, self._hooks = [], []
        for module, _q in self._qweights.values():
            module.__dict__.pop("assign_refusal", None)
        for index in list(self._lru):  # a tensor the user took from a resident weight keeps its memory
            self._evict(index, free=False)
        self.close_peer()
        self.source.release()
        for b in self.streamed.values():
            for (_m, _n, p), offset in zip(b.params, b.offsets):
                if b.host is None:
                    continue  # prepare() did not reach this block
                host = self._view(b.host, offset, p)
                where = self.device if to_device else (device or torch.device("cpu"))
                p.data = host.to(where, copy=True)
            b.device = b.ready = None
        if self.region is not None:  # nothing views it any more: this process unmaps it
            for b in self.streamed.values():
                b.host = None
            region, self.region = self.region, None
            region.release()

    def h2d_bytes_per_pass(self) -> int:
        """Host->device bytes the streamed blocks move in one pass over the stack, in steady state: every
        block is fetched for forward and again for backward (a recomputed block's forward runs on
        backward's fetch), except the ``capacity`` blocks a pass's end leaves resident for the next pass's
        start (backward begins where forward ended, the next forward where backward ended)."""
        sizes = sorted(self.source.link_bytes(i, b.nbytes) for i, b in self.streamed.items())
        return sum(sizes[:max(0, len(sizes) - self.capacity)])

    def stats(self) -> dict:
        resident = sum(self.streamed[i].nbytes for i in list(self._lru))
        return {**self.counters, **self.source.stats(), "source": self.source.kind,
                "streamed_blocks": sorted(self.streamed), "host_bytes": self.host_bytes(),
                "trained_blocks": self.trained_blocks, "trained_bytes": self.trained_bytes(),
                "shared_host_bytes": self.region.nbytes if self.region is not None else 0,
                "private_host_bytes": self.private_host_bytes(),
                "host_owner": self.region is None or self.region.leader,
                "local_ranks": self.region.local_ranks if self.region is not None else 1,
                "shared": self.shared_message,
                "resident_blocks": len(self._lru), "peak_resident_blocks": self.peak_resident,
                "link_bytes_per_s": self.copy_timer.rate(),
                "device_bytes": resident}
