"""TrainStreamSession: the state behind a wrapped model, and its automatic decisions."""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref

import torch
import ts_adamw
import ts_pinned

from . import _habits as habits
from ._dropped import track
from ._events import EventLog
from ._options import WrapOptions
from ._schedule import ATTENTION_AGREE_STEPS, StepFacts, due
from ._stalls import StallClock
from ._units import fmt_bytes, fmt_rate, fmt_seconds
from ._weak import weakly
from .activations.policy import ActivationPolicy
from .attention import AttentionChooser, resolve_wrap_default
from .distributed.sharding import host_shares
from .engine import ForwardGuard, ParamSlot, UpdateEngine, interrupts
from .engine.disk_tier import DiskTier
from .engine.hooks import EngineHook
from .engine.placement_trial import MappedTrial
from .engine.slots import dense_layout_problem, flat
from .memory.disk_plan import segment_values
from .memory.sizing import GiB, device_state_bytes, vram_budget
from .planning.plan import Transition
from .weights import peer

__all__ = ["TrainStreamSession"]


def _reserve_with_progress(arena: ts_pinned.PinnedArena, total: int, verbose: bool) -> None:
    """Reserves `total` bytes slab by slab; with `verbose`, shows progress on large
    reservations (page-locking runs at about 1.5 GB/s, so 20 GB takes over ten seconds)."""
    stats = arena.stats()
    step = max(stats["slab_bytes"], 1)
    # Earlier sessions may hold part of the arena: grow it by what its free space lacks.
    done = stats["arena_bytes"]
    target = done + max(0, total - (done - stats["arena_used"]))
    show = verbose and target - done > 2 * GiB
    started = time.perf_counter()
    while done < target:
        done = arena.reserve(min(target, done + step))
        if show:
            rate = done / max(time.perf_counter() - started, 1e-9)
            sys.stderr.write(f"\rtrainstream: page-locking host memory {fmt_bytes(done, 'GiB', 1):>9} / "
                             f"{fmt_bytes(target, 'GiB', 1)} ({fmt_rate(rate, 'GiB', 1)})")
            sys.stderr.flush()
    if show:
        sys.stderr.write("\n")


class TrainStreamSession:
    """Holds the engine, the hooks and the decision log of one wrapped model.

    ``.events`` is the decision log, ``.config`` the options in effect, ``.steps``
    the optimizer steps so far, ``.adapting`` True until the placement is final, ``.attention``
    the attention chooser, ``.peer`` the peer-GPU pool (ts-peer) once set up at step 10, else None.
    """

    def __init__(self, model: torch.nn.Module, optimizer, options: WrapOptions, device: torch.device, plan, *,
                 weights=None, quantized: dict | None = None, shards=None):
        self.model = model
        self.shards = shards  # FSDP2: the optimizer's proxies of the local shards (distributed/fsdp.py)
        self.optimizer = optimizer
        self.config = options
        self.device = device
        self.events = EventLog(verbose=options.verbose)
        self.steps = 0
        self.adapting = False
        self.trial = None  # a MappedTrial while offload='auto' measures host against mapped AdamW
        self._last_step_at = None  # perf_counter at the previous step(): the trial's step periods
        self.peer = None  # the ts-peer pool the streamed weights come from, once set up (weights/peer.py)
        self.quantized = quantized  # {"quantize", "tensors", "bytes_before", "bytes_after"} when wrap() quantized
        self.engine = None
        self.guard = None
        self.activations = None
        self.attention = self._attention = None
        self.weights = weights  # the WeightStreamer of param_offload=, attached below
        self.host_embedding = None  # weights/host_embedding.py: the input embedding's table in host memory
        self.stalls = None  # the StallClock timing the training loop's waits (_stalls.py), from __init__'s end
        self._handles: list = []
        self._hooks: list[EngineHook] = []
        self._interrupts = False
        self.closed = False  # close() ran: the model trains as a plain one again
        track(self)

        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        slots = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                slots.append(ParamSlot(param=p, index=len(slots), group=group, name=names.get(id(p), "")))
        if not slots:
            raise ValueError("the optimizer has no parameters to train")
        trained = [s for s in slots if s.param.requires_grad]
        self._check_devices(slots)
        _check_layouts(model, trained)
        frozen = len(slots) - len(trained)
        if frozen:
            self.events.add("optimizer", f"{frozen} parameters of the optimizer are frozen: skipped, as torch skips "
                                         f"them; they start training if unfrozen")

        mode = options.optimizer_mode
        on_gpu = device.type == "cuda"
        if mode == "gpu" and not on_gpu:
            raise ValueError("optimizer_mode='gpu' needs a CUDA device; use 'cpu' or 'auto'")
        initial = "mapped" if mode == "gpu" else "host"
        from . import distributed as tsd

        self.world = tsd.world_of(options.distributed)  # one answer for every decision below
        own = _own_share(trained, self.world)
        # The plan decided the moments on the largest rank's share, so every rank chose the same.
        self.plan = plan  # the plan applied; each run-time transition replaces it by its adapted() successor
        self.moment_dtype = plan.moment_dtype
        self.host_state_bytes = plan.host_state_bytes
        self.events.add("plan", plan.host_message)

        self.arena = ts_pinned.default_arena()
        # Page-lock everything now, in slabs, so no training step ever page-locks.
        slack = 1024 * len(own) * 5
        _reserve_with_progress(self.arena, self.host_state_bytes + slack, options.verbose)
        pinned = self.arena.stats()["pinned"]
        share = sum(t.numel() for t in own) / max(1, sum(s.numel for s in trained))
        kind = "" if device.type != "cuda" else "page-locked " if pinned else "pageable "  # a GPU's distinction
        self.events.add("memory", f"reserved {fmt_bytes(self.host_state_bytes)} of {kind}host memory for the "
                                  f"optimizer state" + ("" if pinned or device.type != "cuda" else " (no GPU driver)")
                                  + ("" if self.world < 2 else f" ({share:.1%} of the trained values are this rank's)"))
        if options.threads is not None and not ts_adamw.set_host_threads(options.threads):
            self.events.add("optimizer", f"threads={options.threads} ignored: the host pool already runs "
                                         f"with {ts_adamw.host_threads()} threads")
        if on_gpu and ts_adamw.streaming_stores() == "auto":
            # The rounded weights are next read by the H2D DMA, never by this CPU:
            # writing them past the cache saves a read-for-ownership of every line.
            ts_adamw.set_streaming_stores("on")
            self.events.add("optimizer", "host AdamW writes the weights for upload with streaming stores")
        # Collective under data parallel (every rank builds its session); before the engine's worker starts,
        # so a refusal leaks nothing.
        if shards is not None:  # FSDP2 reduces the gradients; the norm is the only collective left
            from .distributed.fsdp import ShardedNorm

            step_hook = ShardedNorm(shards.group)
        else:
            step_hook = tsd.setup(slots, device, self.events, enabled=options.distributed,
                                  timeout=options.distributed_timeout, settings={
                "max_grad_norm": options.max_grad_norm, "moment_dtype": self.moment_dtype,
                "accumulation_steps": options.accumulation_steps})
        self.engine = UpdateEngine(slots, device, self.moment_dtype, self.arena, self.events,
                                   max_grad_norm=options.max_grad_norm, accumulation_steps=options.accumulation_steps,
                                   seed=options.seed, guard_params=options.guard_params, placement=initial,
                                   step_hook=step_hook)
        try:
            if self.weights is not None:
                self._bind_streamed_slots(slots)
            if plan.disk_state:
                self._put_state_on_disk([trained[i] for i in plan.disk_state], options.nvme_path)
            for slot in trained:
                self.engine.activate(slot)
            if shards is not None:
                during = shards.overlap(model, self.engine)
                self.events.add("distributed", f"FSDP2: this rank trains its local shards of {len(shards.pairs)} "
                                               f"sharded parameters; each group's gradient shards go to host AdamW "
                                               + ("as FSDP2's reduce-scatter assigns them, during backward" if during
                                                  else "at step() (this torch's FSDP2 offers no per-group hand-over)")
                                               + "; clipping sums the norm over the mesh")
            self.guard = ForwardGuard(model, self.engine)
            if self.weights is not None:
                self.weights.attach()
                self.events.add("weights", self._streaming_message())
                if self.weights.shared_message:
                    self.events.add("weights", self.weights.shared_message)
            # The session owns its components; what they call back into it is weak, so nothing keeps a
            # closed session (and its page-locked state) alive until a garbage collection finds the cycle.
            self.activations = ActivationPolicy(model, options, device, self.arena, self.events,
                                                reserved_link_bytes=weakly(self._backward_h2d_bytes),
                                                reserved_vram_bytes=weakly(self._state_bytes_to_move))
            if self.weights is not None and self.activations.offloader is not None:
                # Streamed weights are not activations. Weak: the offloader's pack hook may outlive unwrap()
                # (an autograd graph keeps it), and must not keep the streamer's host copies with it.
                self.activations.offloader.skip = weakly(self.weights.owns, gone=False)
            attention = resolve_wrap_default(options.attention, device, self.world, self.events)
            self.attention = AttentionChooser(attention, events=self.events,
                                              may_reset_peak=weakly(self._adapting))
            self._attention = self.attention.install(model)
            # Reads of the whole model wait for updates; a load waits too, so no upload lands on top of it.
            self._model_hook(model.register_state_dict_pre_hook, lambda *args, **kwargs: self.synchronize())
            self._model_hook(model.register_load_state_dict_pre_hook,
                             lambda module, state_dict, prefix, *args, **kwargs: self._before_load(state_dict, prefix))
            if self.weights is not None:
                self._model_hook(model.register_load_state_dict_post_hook, lambda *args: self.weights.after_load())
            self._interrupts = interrupts.install()
            habits.install()  # clip_grad_norm_ on this model's parameters: refused with the fix
            self._start_stall_clock()
        except BaseException:
            self.close()
            self.engine.release_disk()  # nothing will export its state: a failed wrap() changes nothing
            raise
        what = {"host": "host AdamW on CPU threads", "mapped": "CUDA AdamW over mapped host memory (zero-copy)"}
        self.events.add("optimizer", f"optimizer_mode={mode!r}: {what[initial]}; gradients stream to host memory "
                                     f"during backward" + ("" if on_gpu else " (model on the CPU: memory copies)"))
        ordering = ("step() returns once the last update is issued; the GPU waits for the uploads" if on_gpu
                    else "step() returns once the updates are applied")
        self.events.add("optimizer", f"guard_params={options.guard_params}: " + (
            f"reads of a weight after step() see its update ({ordering})" if options.guard_params else
            "reads after step() outside a forward may see the previous weight until synchronize()"),
            level=None if on_gpu else logging.DEBUG)  # on the CPU step() returns with the weights updated
        self.adapting = on_gpu and (options.offload == "auto" or mode == "auto")
        if not on_gpu and (options.offload == "auto" or mode == "auto"):
            self.events.add("plan", "no CUDA device: the optimizer stays on host threads")

    def _bind_streamed_slots(self, slots: list[ParamSlot]) -> None:
        """Trained weights that stream with their blocks: their state stays on the host (slots.py,
        invariant 7) and the streamer hears of their updates (weights.py, invariant 5)."""
        weights = self.weights
        streamed = {id(p): i for i in weights.trained_blocks for _m, _n, p in weights.streamed[i].trained_params}
        for slot in slots:
            slot.streamed_block = streamed.get(id(slot.param))
        self.engine.frozen_streamed = weights.param_ids - set(streamed)
        if streamed:
            self.engine.streamer = weights
            weights.bind_updates(slots, self.engine.host.wait_applied)

    def _put_state_on_disk(self, slots: list[ParamSlot], directory: str) -> None:
        """The plan's disk tier: these slots' master weights and moments in one scratch file (slots.py,
        invariant 7b), made from their weights before any of them is activated."""
        streamer = self.engine.streamer
        values = [streamer.host_copy(s.param) if s.streamed else flat(s.param.detach()) for s in slots]
        tier = DiskTier(slots, values, directory, self.moment_dtype, segment_values(sum(s.numel for s in slots)))
        self.engine.disk = tier
        for slot in slots:
            slot.disk = tier
        self.events.add("optimizer", f"nvme_path: the master weights and moments of {len(slots)} parameters "
                                     f"({fmt_bytes(tier.state.nbytes)}) are in a scratch file in {directory!r} "
                                     f"({'direct I/O' if tier.state.direct else 'buffered I/O: the filesystem has no O_DIRECT'});"
                                     f" their updates read and write it on the host worker")

    def _before_load(self, state_dict: dict, prefix: str) -> None:
        if self.weights is not None:
            self.weights.check_load(self.model, state_dict, prefix)  # a refusal comes before any change
        self.synchronize()
        if self.weights is not None:
            self.weights.evict_all()  # the load writes the host copies: no stale device copy may stay

    def _streaming_message(self) -> str:
        w = self.weights
        streams = set(w.param_ids)
        resident = sum(1 for b in w.streamed.values() for p in w.blocks[b.index].parameters()
                       if p.requires_grad and id(p) not in streams)
        moving = len(w.trained_blocks)
        return (f"param_offload: the weights of {len(w.streamed)} of {len(w.blocks)} blocks "
                f"({fmt_bytes(w.host_bytes())}) live in host memory and stream to the GPU, at most "
                f"{w.capacity} blocks resident ({w.prefetch_depth} fetched ahead)"
                + (f"; the trained weights of {moving} of them ({fmt_bytes(w.trained_bytes())}) stream too: "
                   f"their AdamW state stays on host threads, each update is written into the host copy the "
                   f"block's next fetch carries" if moving else "")
                + (f"; {resident} trained parameters in those blocks (small beside the frozen weights) stay in VRAM"
                   if resident else ""))

    def _adapting(self) -> bool:
        return self.adapting

    def _backward_h2d_bytes(self) -> int:
        """Host->device bytes that share the link with activation pages coming back in backward: the
        host updates' uploads (the weights of host-placed slots; a streamed slot uploads nothing, its
        block's fetch carries it) and the streamed blocks' fetches for backward."""
        uploads = sum(s.param.numel() * s.param.element_size() for s in self.engine.active
                      if s.placement == "host" and not s.streamed)
        return uploads + (self.weights.h2d_bytes_per_pass() if self.weights is not None else 0)

    def _state_bytes_to_move(self) -> int:
        """VRAM offload='auto' will move the whole optimizer state into after the activation policy
        settles (0 once moved, or when it never moves all of it)."""
        if not self.adapting or self.config.offload != "auto":
            return 0
        return sum(device_state_bytes(s) for s in self.engine.active if s.placement != "device" and not s.streamed)

    def _start_stall_clock(self) -> None:
        """Times the training loop's waits: on the host updates as host-optimizer stalls, on copies (the
        engine's, the weight streamer's, the activation pager's channels) as link stalls."""
        host = self.engine.host
        # Over the updater, not the engine or the session: the worker's thread holds the updater (and through
        # its observer the clock), so a reference to the engine here would keep a dropped model alive.
        engine = weakref.ref(self.engine)
        tier = self.engine.disk  # the disk tier (nvme_path) or None; its counters, not the engine
        self.stalls = StallClock(self.device, busy=lambda: host.busy_seconds,
                                 disk_wait=(lambda: 0.0) if tier is None else tier.wait_seconds,
                                 forwards=lambda: getattr(engine(), "training_forwards", 0))
        self._observe(self.stalls)
        blocks = self.activations.blocks if self.activations is not None else []
        if blocks:  # the batch each step trains, as the first block sees it (the plan prices batch x sequence)
            self._model_hook(functools.partial(blocks[0].register_forward_pre_hook, with_kwargs=True),
                             self.stalls.block_input)

    def _observe(self, observer) -> None:
        for owner in (self.engine, self.weights, getattr(self.activations, "offloader", None)):
            if owner is not None:
                owner.observe(observer)

    def _model_hook(self, register, fn) -> None:
        hook = EngineHook(fn)
        self._hooks.append(hook)
        self._handles.append(register(hook))

    # A copy of a wrapped model (copy.deepcopy, torch.save) is a plain model: its session copies as None.
    def __reduce__(self):
        return (_no_session, ())

    def _check_devices(self, slots: list[ParamSlot]) -> None:
        streamed = self.weights.param_ids if self.weights is not None else set()  # in host memory until fetched
        for slot in slots:
            if slot.param.device != self.device and id(slot.param) not in streamed:
                raise ValueError(f"parameter {slot.index} is on {slot.param.device} but the model trains on "
                                 f"{self.device}; build the optimizer from the model's parameters")

    # ---- called by OffloadAdamW -----------------------------------------------

    def optimizer_step(self) -> None:
        interrupts.ensure()
        # The optimizer's placement adapts to the VRAM the settled activation policy leaves.
        settled = self.activations.settled
        self.activations.step_finished()
        if self.shards is not None:
            self.shards.hand_over_grads()  # FSDP2's reduce-scattered shards become the proxies' gradients
        try:
            late_edits = self.engine.step()
        finally:  # also when step() is interrupted: updates queued before it make device copies stale
            if self.weights is not None:
                self.weights.drop_stale()  # reads after step() see the host copies the updates write
        self.activations.sweep()
        self.steps += 1
        now = time.perf_counter()
        period = None if self._last_step_at is None else now - self._last_step_at
        self._last_step_at = now
        facts = StepFacts(self.steps, period, settled, self.adapting, self.trial is not None, self.world)
        run = {"peer_pools": self._set_up_peer_pools, "optimizer_placement": self._adapt,
               "mapped_trial": lambda: self._advance_trial(period), "attention_agreement": self._agree_on_attention}
        for name in due(facts):  # _schedule.py owns what happens at which step
            reason, changes = run[name]()  # each says what it changed: the plan's next state (Plan -> Plan)
            self.plan = self.plan.adapted(Transition(self.steps, name, reason, tuple(changes)))
        if self.stalls is not None:
            self.stalls.step_finished()
        if late_edits is not None:  # the step is complete and counted; the loop that edits too late stops here
            raise RuntimeError(late_edits)

    def _placements(self) -> dict[str, int]:
        """Values of trained parameters by where their optimizer state is (memory_report's placements)."""
        out: dict[str, int] = {}
        for slot in self.engine.active:
            out[slot.placement] = out.get(slot.placement, 0) + slot.numel
        return out

    def _set_up_peer_pools(self) -> tuple[str, list]:
        self.peer = peer.setup_peer(self.weights, self.config.peer, self.device, self.config.vram_headroom,
                                    self.events)
        if self.peer is None:
            return f"peer={self.config.peer!r}: no peer pool (the events say why)", []
        return "streamed frozen blocks come from the peer GPUs' pools", [("weights_source", "host", "peer")]

    def _agree_on_attention(self) -> tuple[str, list]:
        """attention='auto' under data parallel: after each of the first steps every rank takes the mean
        of all ranks' timings, so all pin the same kernels (collective: every rank, same steps)."""
        chooser = self.attention
        if chooser is None or chooser.mode != "auto":
            return "attention is not 'auto': nothing to agree on", []
        everyone = [None] * self.world
        torch.distributed.all_gather_object(everyone, chooser.timings_to_share())
        changed = chooser.adopt(everyone)
        message = (f"auto under data parallel, step {self.steps}: each shape's timings are the mean over the "
                   f"{self.world} ranks, so every rank pins the same kernels ({changed} choices changed); shapes "
                   f"first seen after step {ATTENTION_AGREE_STEPS} are measured by each rank alone")
        if self.steps == 1 or changed:
            self.events.add("attention", message)
        return message, [("attention_choices_changed", 0, changed)] if changed else []

    def synchronize(self) -> None:
        """Waits until every update is applied and every weight written back; streamed weights are then read
        from their host copies, which the updates wrote."""
        self.engine.synchronize()
        if self.weights is not None:
            self.weights.drop_stale()

    # ---- adaptation after the first measured step --------------------------------

    def _adapt(self) -> tuple[str, list]:
        """After the first step: move optimizer state into the VRAM the step left free. Returns the transition's
        reason and changes (as every scheduled transition does).

        offload='auto' moves all of it when it fits (the stock fused-AdamW
        arrangement, fp32 master weights in VRAM); optimizer_mode='auto' moves
        the parameters whose gradients arrive last in backward (the first
        layers), whose host updates could not overlap backward anyway.
        """
        self.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = vram_budget(self.device, self.config.vram_headroom)
        room = budget - peak
        movable = [s for s in self.engine.active if s.placement != "device" and not s.streamed]
        need = sum(device_state_bytes(s) for s in movable)
        self.adapting = False
        before = self._placements()
        if not movable:
            return "no optimizer state outside VRAM to move", []
        if self.config.offload == "auto" and need <= room:
            self.engine.place(movable, "device")
            self._state_moved_to_vram(need)
            message = (f"offload='auto': the optimizer state ({fmt_bytes(need)}) fits beside the measured peak "
                       f"({fmt_bytes(peak)} of a {fmt_bytes(budget)} budget): AdamW now runs on the GPU with "
                       f"fp32 master weights, as stock fused AdamW would")
            self.events.add("switch", message)
        elif self.config.optimizer_mode == "auto" and room > 0:
            chosen, used = [], 0
            for slot in sorted(movable, key=lambda s: s.index):
                cost = device_state_bytes(slot)
                if used + cost > room:
                    continue
                chosen.append(slot)
                used += cost
            if chosen:
                self.engine.place(chosen, "device")
                self._state_moved_to_vram(used)
            share = sum(s.numel for s in chosen) / max(1, sum(s.numel for s in self.engine.active))
            message = (f"optimizer_mode='auto': {len(chosen)} of {len(movable)} parameters ({share:.0%} of the "
                       f"values, {fmt_bytes(used)}) moved their state to VRAM left free by the measured peak "
                       f"({fmt_bytes(peak)} of {fmt_bytes(budget)}); their updates run on the GPU, the rest on "
                       f"host threads")
            self.events.add("switch", message)
        else:
            message = (f"the optimizer state ({fmt_bytes(need)}) does not fit in the VRAM left after the measured "
                       f"peak ({fmt_bytes(max(room, 0))}): it stays in host memory")
            self.events.add("plan", message)
            if self._start_mapped_trial(room):
                message += "; a trial of CUDA AdamW over mapped host memory starts"
        torch.cuda.reset_peak_memory_stats(self.device)
        after = self._placements()
        return message, [("optimizer_placement", before, after)] if after != before else []

    def _state_moved_to_vram(self, nbytes: int) -> None:
        tuner = self.activations.tuner if self.activations is not None else None
        if tuner is not None:
            tuner.static_grew(nbytes)  # the watchdog's numbers were measured without it

    def _start_mapped_trial(self, room: int) -> bool:
        """offload='auto' with mapped_trial=True (a prototype), state in host memory: measure mapped CUDA AdamW
        against host AdamW when the gradients it keeps in VRAM until step() fit twice in the room the measured
        peak left."""
        host = [s for s in self.engine.active if s.placement == "host" and not s.streamed]
        grads = sum(s.numel * s.param.element_size() for s in host)
        if (not self.config.mapped_trial or self.config.offload != "auto" or not host
                or self.engine.step_hook is not None or 2 * grads > room):
            return False
        self.trial = MappedTrial()
        self.events.add("plan", f"offload='auto': trying CUDA AdamW over mapped host memory against host AdamW "
                                f"for {len(host)} tensors: no gradient hooks, the {fmt_bytes(grads)} of gradients "
                                f"wait in VRAM until step() and the state crosses the link there; "
                                f"{self.trial.steps} steps each, the faster stays")
        return True

    def _advance_trial(self, period: float) -> tuple[str, list]:
        trial = self.trial
        action = trial.record(period)
        if action is None:
            return f"the mapped-AdamW trial timed a step ({fmt_seconds(period)})", []
        before = self._placements()
        wanted = "mapped" if action == "switch" else "host"
        slots = [s for s in self.engine.active if s.placement in ("host", "mapped") and not s.streamed]
        if action in ("switch", "revert"):
            self.synchronize()
            self.engine.fused_mapped = wanted == "mapped"  # before place(): it decides the slots' hooks
            self.engine.place(slots, wanted)
        if action == "switch":  # the summary needs both phases' timings: only once the trial ends
            message = "offload='auto': the trial switches to CUDA AdamW over mapped host memory"
        elif action == "keep":
            message = f"offload='auto': CUDA AdamW over mapped host memory stays: {trial.summary()}"
        else:
            message = f"offload='auto': back to host AdamW: {trial.summary()}"
        if action != "switch":
            self.events.add("switch", message)
            self.trial = None
        after = self._placements()
        return message, [("optimizer_placement", before, after)] if after != before else []

    def install_host_embedding(self, embedding) -> None:
        """host_embedding: the frozen input embedding's table moves to page-locked host memory (or an event
        says why it stays)."""
        from .weights.host_embedding import HostEmbedding

        table = HostEmbedding(embedding, self.device, self.arena)
        try:
            self.host_embedding = table.install()
        except RuntimeError as error:
            table.remove()
            self.events.add("memory", f"host_embedding: the input embedding stays in VRAM: {error}")
            return
        self.events.add("memory", f"host_embedding: the input embedding ({fmt_bytes(table.nbytes)}, frozen) lives in "
                                  f"page-locked host memory; each lookup reads its rows over the link "
                                  f"({table.weight.shape[1] * table.weight.element_size()} bytes a token)")

    # ---- teardown -------------------------------------------------------------------

    def _remove_weights(self) -> None:
        """The streamed weights become ordinary tensors: on the device when they fit, else on the host."""
        weights, self.weights = self.weights, None
        self.peer = None  # weights.remove() closes it (collective: every rank unwraps)
        fits = _weights_fit(weights, self.device)
        weights.remove(to_device=fits)
        if not fits:
            import warnings
            warnings.warn(f"trainstream: the streamed weights ({fmt_bytes(weights.host_bytes())}) do not fit in the "
                          f"free VRAM; they stay on the CPU after unwrap()", stacklevel=3)

    def close(self) -> None:
        """Waits for the updates, then removes every hook and thread, even when something fails."""
        try:
            if self.engine is not None:
                self.engine.close()
        finally:
            if self._attention is not None:
                self._attention.remove()
                self._attention = None
            if self.weights is not None:
                self._remove_weights()
            if self.host_embedding is not None:
                self.host_embedding.remove()
                self.host_embedding = None
            if self.activations is not None:
                self.activations.remove()
            if self.guard is not None:
                self.guard.remove()
            if self.shards is not None:
                self.shards.restore()
            for handle in self._handles:
                handle.remove()
            for hook in self._hooks:
                hook.disable()
            self._handles, self._hooks = [], []
            if self._interrupts:
                interrupts.uninstall()
                self._interrupts = False
            if self.stalls is not None:
                self._observe(None)  # the owners' views refer to the clock: nothing keeps it once closed
            self.closed = True




def _own_share(trained: list[ParamSlot], world: int) -> list[torch.Tensor]:
    """This rank's trained tensors (whole, or flat views of its pieces): its share by
    distributed.sharding.host_shares, the rule the plan used."""
    own, _ = host_shares([s.param for s in trained], world, torch.distributed.get_rank() if world > 1 else 0)
    return own


def _weights_fit(weights, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _total = torch.cuda.mem_get_info(device)
    return weights.host_bytes() * 1.05 < free


def _no_session():
    return None


def _check_layouts(model: torch.nn.Module, trained: list[ParamSlot]) -> None:
    """Refuses, before anything is allocated, parameters the engine cannot train."""
    by_id = {id(s.param): s for s in trained}
    for slot in trained:
        problem = dense_layout_problem(slot.param)
        if problem:
            raise ValueError(f"{slot.label} cannot be trained by trainstream: {problem}. Make it dense "
                             f"(e.g. param.data = param.data.contiguous()) before wrap()")
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            slot = by_id.get(id(module.weight))
            if slot is not None:
                raise ValueError(f"{slot.label} belongs to an embedding with sparse=True; trainstream trains dense "
                                 f"gradients only: build it with sparse=False")
