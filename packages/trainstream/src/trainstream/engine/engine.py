"""The update engine: gradient hooks, accumulation, clipping, step(), and where updates run.

Without clipping, a mapped parameter's update starts the moment autograd has accumulated its gradient
(the last of ``accumulation_steps`` backward passes), a host parameter's once the rest of its gradient
bucket has too (``buckets.py``; at the latest when the backward pass ends), while backward continues. A parameter
whose state is in VRAM (``device``) has no hook: its gradient stays in ``param.grad`` and step()
updates all of them in one fused multi-tensor launch, as stock fused AdamW does (a hook per tensor
cost about 200 us of host time each). With
``max_grad_norm``, gradients are collected first and every update waits for the global norm at
step(). Without clipping, a step's updates therefore use the param groups' values as they were when
its first gradient arrived; a value changed after that (between backward() and step()) is refused at
the end of step() (``window.py``) rather than applied to part of the step. Every change of a slot goes through ``ParamSlot.move`` inside ``interrupts.critical()``;
waits happen outside, so Ctrl-C is prompt and never leaves a transition half-done.

Data parallel (``step_hook``, from ``trainstream.distributed``): no slot has a hook; at step() the
hook first averages every gradient into its owner's ``param.grad``, the owned slots update as above
(the norm summed over the ranks), then the hook shares the new weights. Slots owned by other ranks
stay DORMANT: no buffers.
"""

from __future__ import annotations

import math
import weakref

import torch
import ts_adamw
import ts_pinned

from . import interrupts
from .buckets import GradBuckets
from .channel import ChannelOwner, UploadMarks, channel_for
from .hooks import EngineHook
from .slots import ParamSlot, SlotState
from .updates import (
    DeviceBatch,
    HostUpdater,
    device_batches,
    group_hypers,
    hyper_of,
    launch_batches,
    launch_device_update,
)
from .window import WindowHypers

__all__ = ["UpdateEngine", "UpdateFailed"]

S = SlotState


def _check_dense(slot: ParamSlot, grad: torch.Tensor) -> None:
    if grad.is_sparse or grad.layout != torch.strided:
        raise ValueError(f"{slot.label} has a {grad.layout} gradient; trainstream trains dense gradients only "
                         f"(use sparse=False in the embedding)")


class UpdateFailed(RuntimeError):
    """A host AdamW update failed; the parameters it names were left as they were."""


class UpdateEngine(ChannelOwner):
    """Owns every slot's transitions (``engine/slots.py`` lists the states and invariants)."""

    def __init__(self, slots: list[ParamSlot], device: torch.device, moment_dtype: torch.dtype,
                 arena: ts_pinned.PinnedArena, events, *, max_grad_norm: float | None, accumulation_steps: int,
                 seed: int, guard_params: bool, placement: str, step_hook=None):
        self.slots = slots
        self.by_param = {id(s.param): s for s in slots}
        self.device = device
        self.moment_dtype = moment_dtype
        self.arena = arena
        self.events = events
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        # Mapped slots update in step()'s fused launch (no per-tensor hooks) instead of during backward:
        # set by offload="auto"'s placement trial (engine/placement_trial.py) before it places them.
        self.fused_mapped = False
        self.seed = seed
        self.guard_params = guard_params
        self.placement = placement  # where a newly trained parameter's state goes
        # Data parallel: what trainstream.distributed.setup() built for these slots (None: one process). The
        # caller builds it, so the engine never imports the layer that builds on it.
        self.step_hook = step_hook
        self.training_forwards = 0  # forwards of the model with gradients on (forward_started)
        self.channel = channel_for(device)
        self.marks = UploadMarks()
        self.host = HostUpdater(self.channel, self.marks, events)
        # A model dropped without unwrap() is collected with its engine (a cycle through the session); the
        # worker's thread holds only the updater, so it would idle forever: stop it then. Never refers to self.
        weakref.finalize(self, self.host.stop_soon).atexit = False  # at exit, updates.py's handler drains them
        self.last_grad_norm: float | None = None
        self._clip_scale: float | None = None  # this step's coefficient, kept until all its updates are queued
        self.window = WindowHypers(seed)  # without clipping: one set of hyper-parameters per step (window.py)
        self._device_done: torch.cuda.Event | None = None  # the newest device update of this step
        # Fused launches' fixed arguments, for the slot set they were built for (None: rebuild).
        self._batches: tuple[tuple, list[DeviceBatch]] | None = None
        # A fused launch's gradients, alive until the compute stream is ordered after it (instead of a
        # record_stream per tensor): (event, gradients).
        self._held_grads: tuple | None = None
        self._dormant = [s for s in slots if s.state is S.DORMANT]
        self._grad_hook = EngineHook(self._on_grad, weak=True)
        self.buckets = GradBuckets()  # host-placed gradients leave a bucket at a time (buckets.py)
        self._after_backward_hook = EngineHook(self._after_backward, weak=True)
        self._after_backward_queued = False
        self.d2h_launches = 0  # gradient D2H launches (one per bucket taken, or per gradient taken alone)
        # Streamed slots (slots.py, invariant 7): set by the session to its WeightStreamer, which gives each
        # its host copy (``host_copy``) and hears of each queued update (``update_queued``).
        self.streamer = None
        self.frozen_streamed: set[int] = set()  # ids of weights streamed as frozen: they cannot start training
        self.disk = None  # the DiskTier of the slots whose state is on disk (nvme_path), set by the session

    def observe(self, observer) -> None:
        """The stall clock (or None): times this engine's waits on its channel as link waits, and the
        training loop's waits on the host worker as host-optimizer waits."""
        super().observe(observer)
        self.host.observer = observer

    @property
    def active(self) -> list[ParamSlot]:
        return [s for s in self.slots if s.state is not S.DORMANT]

    # ---- parameters start training ------------------------------------------------

    def activate(self, slot: ParamSlot, placement: str | None = None) -> None:
        """DORMANT -> IDLE: buffers from the current weight, and the gradient hook. A slot another rank
        owns (data parallel) stays DORMANT."""
        if not slot.owned:
            return
        if slot.streamed:
            slot.allocate("host", self.moment_dtype, self.arena, host_copy=self.streamer.host_copy(slot.param))
        else:
            slot.allocate(placement or self.placement, self.moment_dtype, self.arena)
        self._batches = None
        with interrupts.critical():
            self._hook_for(slot)
            slot.note_weight()
            slot.move(S.IDLE)
        if slot in self._dormant:
            self._dormant.remove(slot)

    def _hook_for(self, slot: ParamSlot) -> None:
        """A gradient hook exactly when the slot's updates start during backward: host slots, and mapped
        ones unless ``fused_mapped`` (then they update in step()'s fused launch, as device slots do);
        never under data parallel (a step hook whose ``updates_at_step`` is not False)."""
        at_step = (slot.placement == "device" or (slot.placement == "mapped" and self.fused_mapped)
                   or (self.step_hook is not None and getattr(self.step_hook, "updates_at_step", True)))
        self.buckets.invalidate()
        if at_step and slot.hook is not None:
            slot.hook.remove()
            slot.hook = None
        elif not at_step and slot.hook is None:
            slot.hook = slot.param.register_post_accumulate_grad_hook(self._grad_hook)

    def forward_started(self) -> None:
        """A forward of the model begins (the root guard): no backward pass is running, so none has a final
        callback queued (one that raised never ran its own); unfrozen parameters start training. Forwards
        with gradients on are counted (data parallel compares the counts at each step)."""
        self._after_backward_queued = False
        self.training_forwards += torch.is_grad_enabled()
        self.activate_unfrozen()

    def activate_unfrozen(self) -> None:
        """Parameters frozen at wrap() that have since been unfrozen start training (as torch's would)."""
        for slot in [s for s in self._dormant if s.param.requires_grad and s.owned]:
            if id(slot.param) in self.frozen_streamed:
                raise RuntimeError(f"{slot.label} streams from host memory as a frozen weight (param_offload) and "
                                   f"was unfrozen: its block's copies are not written by updates. unwrap() the model "
                                   f"and wrap() it again to train it")
            self.activate(slot)
            self.events.add("optimizer", f"{slot.label} is trainable now: its optimizer state was created")

    # ---- gradients arrive -----------------------------------------------------------

    def gradient_ready(self, param: torch.nn.Parameter) -> None:
        """A gradient put in ``param.grad`` outside autograd's accumulation (FSDP2's reduce-scatter, handed to
        the shard's proxy during backward: distributed/fsdp.py) arrives as the post-accumulate hook would."""
        self._on_grad(param)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        slot = self.by_param[id(param)]
        if slot.state is S.QUEUED:
            self._requeue_orphans([slot])
            self.host.wait_slot(slot)  # invariant 2: its buffer is still being read
        if slot.taken:  # invariant 9
            raise RuntimeError(
                f"{slot.label} received a gradient from one backward pass more than accumulation_steps="
                f"{self.accumulation_steps} before step(): the update of the gradient it took is already under "
                f"way, so the two cannot be summed as torch would. Pass accumulation_steps=N to trainstream.wrap() "
                f"(N backward passes per step()), or call step() after each backward")
        if not self.buckets.valid:
            self._rebuild_buckets()
        with interrupts.critical():
            if slot.micro + 1 < self.accumulation_steps:
                slot.micro += 1
                slot.move(S.ACCUMULATING)  # keep summing in param.grad, as autograd does
                return
            bucket = self.buckets.of(slot)
            if bucket is None:
                self._take(slot)
                return
            full = self.buckets.arrive(bucket, slot)
            if full is not None:
                self._take_host(full)
                return
        self._take_pending_after_backward()

    def _take(self, slot: ParamSlot) -> None:
        """IDLE / ACCUMULATING with a complete gradient in param.grad -> ARRIVED, QUEUED or (device) IDLE.
        Runs inside a critical section; everything that can fail comes before the first change."""
        grad = slot.param.grad
        if grad is None:
            return
        if slot.placement == "host":
            self._take_host([slot])
            return
        _check_dense(slot, grad)
        immediate = self.max_grad_norm is None
        hyper = self.window.of([slot])[id(slot.group)] if immediate else None
        self._follow_user_edit(slot)
        src = slot.grad_view(grad) if immediate else None
        if immediate:
            after = self.channel.mark_compute()  # after the layout copy above, which the update reads
            slot.written = self._device_done = launch_device_update(slot, src, hyper, self.channel, after)
            slot.step += 1
            slot.param.grad = None
            slot.micro = 0
            slot.taken = True  # invariant 9
            slot.move(S.IDLE)
        else:
            slot.micro = 0
            slot.taken = True  # invariant 9
            slot.move(S.ARRIVED)  # device gradients wait in param.grad for the norm

    def _take_host(self, slots: list[ParamSlot]) -> None:
        """Host slots with complete gradients in param.grad -> QUEUED (their updates queued) or, with
        clipping, ARRIVED: one event after the compute that produced them, one D2H launch for all, one
        check per param group, the worker woken once. Runs inside a critical section; everything that
        can fail comes before the first change."""
        slots = [s for s in slots if s.param.grad is not None]
        if not slots:
            return
        for s in slots:
            _check_dense(s, s.param.grad)
        immediate = self.max_grad_norm is None
        hypers = self.window.of(slots) if immediate else None
        for s in slots:
            self._follow_user_edit(s)
        sources = [s.grad_view(s.param.grad) for s in slots]
        after = self.channel.mark_compute()  # after any layout copy above, which the D2H copies read
        token = self.channel.to_host_many(sources, [s.grad_host for s in slots], after)
        self.d2h_launches += 1
        for s in slots:
            s.param.grad = None  # its memory now belongs to the D2H stream
            s.micro = 0
            s.taken = True  # invariant 9
            s.grad_token = token
            if immediate:
                s.hyper = hypers[id(s.group)]
                s.move(S.QUEUED)
            else:
                s.move(S.ARRIVED)
        if immediate:
            self._submit(slots)

    # ---- gradient buckets (buckets.py) ----------------------------------------------------

    def _rebuild_buckets(self) -> None:
        self._take_pending()
        self.buckets.build(self.slots)

    def _take_pending(self) -> None:
        """Takes the gradients waiting in partly filled buckets (their parameters got no gradient this pass)."""
        with interrupts.critical():
            pending = self.buckets.take_pending()
            if pending:
                self._take_host(pending)

    def _take_pending_after_backward(self) -> None:
        """The partly filled buckets are taken when this backward pass ends (an autograd final callback,
        queued once per pass), so no gradient waits into the next pass; called by hand outside backward,
        at once."""
        if self._after_backward_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward_hook)
        except RuntimeError:  # not inside a backward pass
            self._take_pending()
            return
        self._after_backward_queued = True

    def _after_backward(self) -> None:
        self._after_backward_queued = False
        self._take_pending()

    def _submit(self, slots: list[ParamSlot]) -> None:
        """Queues QUEUED slots' host updates together (inside a critical section), so the worker takes them in
        one call; each slot's ``written`` is its sequence, and a streamed weight's block learns that its
        device copy is stale and which update its next fetch waits for."""
        for slot, sequence in zip(slots, self.host.submit(slots), strict=True):
            if slot.streamed:
                self.streamer.update_queued(slot.streamed_block, sequence)

    def _requeue_orphans(self, slots: list[ParamSlot]) -> None:
        """Invariant 8: queues the update of each slot left QUEUED without one (an exception between the move
        and the submit), so it is applied as if uninterrupted and nothing waits for it forever. ``holds`` is
        read before the state (its docstring says why the order matters)."""
        orphans = [s for s in slots if s.state is S.QUEUED and not self.host.holds(s) and s.state is S.QUEUED]
        if not orphans:
            return
        with interrupts.critical():
            self._submit(orphans)
        self.events.add("optimizer", f"the host updates of {', '.join(s.label for s in orphans)} were queued late: "
                                     f"an exception had interrupted their queueing")

    def _follow_user_edit(self, slot: ParamSlot) -> None:
        """Invariant 4: a weight written by the user is where its next update starts."""
        if slot.weight_changed():
            slot.follow_weight()
            self.events.add("optimizer", f"{slot.label} was changed outside the optimizer: its master copy follows")

    # ---- step ---------------------------------------------------------------------

    def step(self) -> str | None:
        """Takes gradients still accumulating, applies clipping, queues the remaining updates, and
        (guard_params) orders every later read of a weight after its update. Returns window.late_edits()'s
        refusal, for the caller to raise once its own bookkeeping of the step is done."""
        self.raise_errors()
        self._requeue_orphans(self.slots)
        self._after_backward_queued = False  # a backward pass that raised never ran its final callback
        self._take_pending()
        self._release_grads()
        self.activate_unfrozen()
        if self.step_hook is not None:
            self.step_hook.before_step(self)
        resident = []
        for slot in self.slots:
            if slot.hook is None and slot.state is S.IDLE and slot.placement != "host":
                if slot.param.grad is not None:
                    resident.append(slot)
            elif slot.state in (S.IDLE, S.ACCUMULATING) and slot.param.grad is not None:
                with interrupts.critical():
                    self._take(slot)  # step() before accumulation_steps passes, or a gradient set by hand
            elif slot.state is S.QUEUED and slot.param.grad is not None:
                self.host.wait_slot(slot)
                with interrupts.critical():
                    self._take(slot)
        if resident:
            self._take_resident(resident)
        if self.max_grad_norm is not None:
            self._clip_and_update()
        if self.step_hook is not None:
            self.step_hook.after_updates(self)
        for slot in self.slots:  # invariant 9: the next window starts
            slot.taken = False
        if self.guard_params:
            self.guard_reads()
        return self.window.late_edits()

    def _take_resident(self, slots: list[ParamSlot]) -> None:
        """Device slots (no hook) with gradients: one fused launch now, or ARRIVED for the norm."""
        if self.max_grad_norm is not None:
            for s in slots:
                layout = s.param.grad.layout
                if layout is not torch.strided:
                    raise ValueError(f"{s.label} has a {layout} gradient; trainstream trains dense gradients "
                                     f"only (use sparse=False in the embedding)")
            with interrupts.critical():
                for s in slots:
                    s.move(S.ARRIVED)
            return
        self._launch_device(slots, 1.0)

    def _device_batches(self, slots: list[ParamSlot]) -> list[DeviceBatch]:
        """The cached launch arguments for exactly these slots (rebuilt when the set, a placement or a
        step count changed)."""
        key = tuple(slots)
        cached = self._batches
        if cached is not None and cached[0] == key and all(b.valid() for b in cached[1]):
            return cached[1]
        batches = device_batches(slots)
        self._batches = (key, batches)
        return batches

    def _launch_device(self, slots: list[ParamSlot], grad_scale: float) -> None:
        """Fused updates of device / mapped slots whose gradients are in param.grad (-> IDLE): the
        group's hyper-parameters read and checked once per group, user edits followed, one launch per
        (group, step count). Everything that can fail comes before the launch."""
        batches = self._device_batches(slots)
        hypers: dict[int, object] = {}
        for batch in batches:  # in slot order: a bad value names its group's first trained parameter
            key = id(batch.group)
            if key not in hypers:
                read = self.window.get(batch.group) if self.max_grad_norm is None else None
                hypers[key] = read if read is not None else hyper_of(batch.slots[0], grad_scale, self.seed)
        for batch in batches:
            if self._follow_edits(batch):
                self._batches = None
        if self._batches is None:
            batches = self._device_batches(slots)
        grads = [self._grads(batch) for batch in batches]
        after = self.channel.mark_compute()
        record = not (self.guard_params and self.channel.is_cuda)
        with interrupts.critical():
            done = launch_batches(batches, grads, hypers, self.channel, after, record_streams=record)
            self._device_done = done
            if not record:
                self._held_grads = (done, grads)
            for s in slots:
                s.written = done
                s.step += 1
                s.param.grad = None
                if s.state is not S.IDLE:  # ARRIVED (clipping); IDLE slots have micro 0 already
                    s.micro = 0
                    s.move(S.IDLE)

    def _follow_edits(self, batch: DeviceBatch) -> bool:
        """Invariant 4 for a batch's slots; True when a weight's storage moved (the batch is stale)."""
        moved = False
        for s, p, ptr in zip(batch.slots, batch.params, batch.ptrs):
            if p._version != s.weight_version or p.data_ptr() != s.weight_ptr:
                self._follow_user_edit(s)
            if s.weight_ptr != ptr:
                moved = True
        return moved

    @staticmethod
    def _grads(batch: DeviceBatch) -> list[torch.Tensor]:
        """The batch's gradients in their parameters' memory order: contiguous ones as they are (the
        kernel takes any contiguous shape of the right size and detaches), others copied to the layout."""
        out = []
        for s, p in zip(batch.slots, batch.params):
            g = p.grad
            if g.layout is not torch.strided:
                raise ValueError(f"{s.label} has a {g.layout} gradient; trainstream trains dense gradients only "
                                 f"(use sparse=False in the embedding)")
            out.append(g if batch.contiguous and g.is_contiguous() and s.span is None else s.grad_view(g))
        return out

    def _release_grads(self, ordered: bool = False) -> None:
        """Drops the last fused launch's gradients once their memory may be reused: its event is
        complete, or (`ordered`) the compute stream, where they were allocated, waits for it."""
        held = self._held_grads
        if held is None:
            return
        if not ordered and not held[0].query():
            self.channel.compute_wait(held[0])
        self._held_grads = None

    def _clip_and_update(self) -> None:
        arrived = [s for s in self.slots if s.state is S.ARRIVED]
        if not arrived and self.step_hook is None:  # with data parallel, every rank takes part in the norm
            self._clip_scale = None
            return
        if self._clip_scale is None:
            # A retried step() (after an interrupt below) reuses the norm of the whole gradient.
            for s in arrived:
                if s.placement == "host":
                    self.channel.host_wait(s.grad_token)
            host = [s.grad_host for s in arrived if s.placement == "host"]
            total = ts_adamw.sum_of_squares(host) if host else 0.0
            device = [s.param.grad.detach() for s in arrived if s.placement != "host"]
            if device:
                total += float(torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in device]).sum())
            if self.step_hook is not None:
                total = self.step_hook.global_sum_of_squares(total)
            norm = math.sqrt(total)
            self.last_grad_norm = norm
            # Same coefficient as torch.nn.utils.clip_grad_norm_.
            self._clip_scale = min(1.0, self.max_grad_norm / (norm + 1e-6))
        hypers = group_hypers(arrived, self._clip_scale, self.seed)
        host = [s for s in arrived if s.placement == "host"]
        for s in host:
            self._follow_user_edit(s)  # edited between backward and step(): the update starts from the edit
        with interrupts.critical():
            for s in host:
                s.hyper = hypers[id(s.group)]
                s.move(S.QUEUED)
            if host:
                self._submit(host)
        device = [s for s in arrived if s.placement != "host"]
        if device:
            self._launch_device(device, self._clip_scale)  # follows the device slots' edits itself
        self._clip_scale = None

    def discard(self) -> None:
        """zero_grad(): gradients held for a step that never came are dropped. Gradients still in a bucket
        (a backward pass that raised) are taken first, as they would have been one at a time, and updates
        whose queueing an exception interrupted are queued, as the ones queued before it were."""
        self._after_backward_queued = False
        self._take_pending()
        self._requeue_orphans(self.slots)
        for s in self.slots:
            s.taken = False  # invariant 9: a new window starts
            with interrupts.critical():
                if s.state is S.ARRIVED:
                    s.grad_token = None
                    if s.placement != "host":
                        s.param.grad = None
                    s.move(S.IDLE)
                elif s.state is S.ACCUMULATING:
                    s.micro = 0
                    s.move(S.IDLE)
        self._clip_scale = None
        self.window.clear()  # edits before the next backward are the next window's values
        if self.step_hook is not None:
            self.step_hook.discard()  # data parallel: the window's gradient count starts again

    # ---- ordering reads after updates -------------------------------------------------

    def order_after(self, slot: ParamSlot) -> None:
        """The compute stream's next work sees `slot`'s newest weight (device-side where possible)."""
        written = slot.written
        if written is None:
            return
        if isinstance(written, int):
            # The upload's event is read only after the wait: until the worker has applied update `written`,
            # upload_event is the previous upload's, and waiting on it would let this forward read the weight
            # while the new upload may still be landing (seen as a load-dependent difference on a GPU).
            self.host.wait_applied(written)
            self.channel.order_compute_after(self.marks, written, self.host.wait_applied, slot.upload_event)
        else:
            self.channel.compute_wait(written)
        slot.written = None

    def guard_reads(self) -> None:
        """Every weight read after this point sees its update: the host waits until the last host update
        is issued, then the compute stream waits (on the device) for the newest upload and device update."""
        if self.host.submitted:
            self.channel.order_compute_after(self.marks, self.host.submitted, self.host.wait_applied)
        if self._device_done is not None:
            self.channel.compute_wait(self._device_done)
            self._device_done = None
            self._release_grads(ordered=True)
        for slot in self.slots:
            slot.written = None
        if not self.channel.is_cuda:
            self.raise_errors()

    def raise_errors(self) -> None:
        """Raises, once, the host updates that failed since the last call."""
        errors = self.host.take_errors()
        if not errors:
            return
        _slot, error = errors[0]
        names = ", ".join(s.label for s, _ in errors)
        raise UpdateFailed(f"the host AdamW update of {names} failed: {error!r}. Those parameters were left as they "
                           f"were (steps {', '.join(str(s.step) for s, _ in errors)}); the next step trains them "
                           f"again") from error

    def synchronize(self) -> None:
        """Every queued update applied and every weight written (host and device)."""
        self._requeue_orphans(self.slots)
        self.host.drain()
        self.channel.synchronize()
        self._release_grads(ordered=True)
        for slot in self.slots:
            slot.written = None
        self._device_done = None
        self.raise_errors()

    # ---- placements and teardown --------------------------------------------------------

    def place(self, slots: list[ParamSlot], placement: str) -> int:
        """Moves slots to a placement (after synchronize()); returns the values moved."""
        moved = 0
        for slot in slots:
            # Streamed and disk slots stay on the host (slots.py, invariants 7 and 7b).
            if slot.placement != placement and not slot.streamed and slot.disk is None:
                self._batches = None
                slot.move_to(placement, self.arena)
                with interrupts.critical():
                    self._hook_for(slot)
                moved += slot.numel
        return moved

    def release_disk(self) -> None:
        """Frees the disk tier's file (after close(): unwrap() first exports the state it holds)."""
        if self.disk is not None:
            self.disk.close()

    def close(self) -> None:
        """Waits for every update, then removes the hooks and stops the worker, whatever fails. The disk
        tier stays readable until ``release_disk()``."""
        try:
            self.synchronize()
        finally:
            for slot in self.slots:
                if slot.hook is not None:
                    slot.hook.remove()
                    slot.hook = None
            try:
                self.host.close()
            finally:
                self._grad_hook.disable()
                self._after_backward_hook.disable()
                if self.step_hook is not None:
                    self.step_hook.close()  # data parallel: its gradient hooks come off
