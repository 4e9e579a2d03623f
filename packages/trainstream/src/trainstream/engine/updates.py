"""The AdamW update of one parameter, wherever its state lives.

Host updates run on one worker thread, in the order they were queued, each using all of
ts-adamw's host threads; device and mapped updates are CUDA kernels queued on the optimizer
stream. Every host update has a sequence number; once its new weight's upload is issued (or the
update failed, leaving everything as it was) the worker marks that sequence handled
in ``applied`` (a condition the main thread can wait on) and keeps the upload's event.
"""

from __future__ import annotations

import atexit
import collections
import math
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import ts_adamw

from .channel import UploadMarks
from .slots import ParamSlot, SlotState

__all__ = ["DeviceBatch", "HostUpdater", "Hyper", "device_batches", "group_hypers", "hyper_of", "launch_batches",
           "launch_device_update", "launch_device_updates"]


@dataclass(frozen=True)
class Hyper:
    """Hyper-parameters of one update, read from the param group when the gradient arrives."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    grad_scale: float
    seed: int  # the run's rounding stream; each update names its parameter by its index (the key)

    def kwargs(self, step: int) -> dict:
        """The keyword arguments of ts-adamw's list calls (host adamw_steps and CUDA), keyed per tensor."""
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay, "step": step, "maximize": self.maximize,
                "grad_scale": self.grad_scale, "seed": self.seed}


def rounding(slots) -> dict:
    """The ``keys`` and ``offsets`` of ts-adamw's list calls for `slots`: each parameter's rounding stream is its
    index, and a piece of a split parameter (slots.py, invariant 8b) starts at its span's first value in it, so
    its bf16 moments round as the whole parameter's would in one process."""
    return {"keys": [s.index & 0xFFFFFFFF for s in slots],
            "offsets": [0 if s.span is None else s.span[0] for s in slots]}


def _number(where: str, key: str, value, low: float, high: float = math.inf, *, closed_high: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
            low <= value and (value <= high if closed_high else value < high)):
        bound = f"[{low}, {high}]" if closed_high else f"[{low}, {high})"
        raise ValueError(f"{where}: {key}={value!r} is not valid; use a finite number in {bound}")
    return float(value)


def hyper_of(slot: ParamSlot, grad_scale: float, seed: int) -> Hyper:
    """The group's hyper-parameters, checked (a scheduler or a user may have edited them)."""
    g = slot.group
    where = f"the param group of {slot.label}"
    betas = g["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: betas={betas!r} is not a pair")
    maximize = g.get("maximize", False)
    if not isinstance(maximize, bool):
        raise ValueError(f"{where}: maximize={maximize!r} is not valid; use True or False")
    return Hyper(
        lr=_number(where, "lr", g["lr"], 0.0),
        beta1=_number(where, "betas[0]", betas[0], 0.0, 1.0, closed_high=False),
        beta2=_number(where, "betas[1]", betas[1], 0.0, 1.0, closed_high=False),
        eps=_number(where, "eps", g["eps"], 0.0),
        weight_decay=_number(where, "weight_decay", g["weight_decay"], 0.0),
        maximize=maximize,
        grad_scale=float(grad_scale),
        # Reproducible across runs; the parameter's own stream is its key (its index) under this seed.
        seed=(seed * 1_000_003) & 0xFFFFFFFF,
    )


def group_hypers(slots: list[ParamSlot], grad_scale: float, seed: int) -> dict[int, Hyper]:
    """hyper_of once per param group of `slots` (keyed by id(group)), in slot order, so a bad value is
    refused naming the group's first trained parameter."""
    hypers: dict[int, Hyper] = {}
    for slot in slots:
        key = id(slot.group)
        if key not in hypers:
            hypers[key] = hyper_of(slot, grad_scale, seed)
    return hypers


class DeviceBatch:
    """The argument lists of one fused launch that do not change between steps: the slots of one param
    group at one step count, their masters, moments, weight views (``outs``) and rounding keys and offsets.
    Valid while the slot set, the buffers (placement) and the weights' storage stay; ``ptrs`` is the
    weights' storage when built, so a replaced ``.data`` is noticed."""

    __slots__ = (
        "changes",
        "contiguous",
        "exp_avg_sqs",
        "exp_avgs",
        "fused",
        "group",
        "masters",
        "outs",
        "params",
        "ptrs",
        "rounding",
        "slots",
        "step",
    )

    def __init__(self, slots: list[ParamSlot]):
        self.slots = slots
        self.group = slots[0].group
        self.step = slots[0].step  # every slot's; they advance together, one launch per step
        self.params = [s.param for s in slots]
        self.masters = [s.master for s in slots]
        self.exp_avgs = [s.exp_avg for s in slots]
        self.exp_avg_sqs = [s.exp_avg_sq for s in slots]
        self.outs = [s.weight_view() for s in slots]
        self.rounding = rounding(slots)
        self.ptrs = [p.data_ptr() for p in self.params]
        self.contiguous = all(p.is_contiguous() for p in self.params)
        self.changes = ParamSlot.buffer_changes
        self.fused = None  # the prepared kernel arguments (ts_adamw.CudaAdamWBatch), made at the first launch

    def launch(self, grads: list[torch.Tensor], kwargs: dict, stream) -> None:
        """One fused AdamW over the batch on `stream`: only the gradients' addresses cross per step."""
        if self.fused is None:
            self.fused = ts_adamw.CudaAdamWBatch(self.masters, self.exp_avgs, self.exp_avg_sqs, params_out=self.outs,
                                                 grad_dtypes=[p.dtype for p in self.params], **self.rounding)
        self.fused.step(grads, stream=stream.cuda_stream, **kwargs)
        self.step += 1

    def valid(self) -> bool:
        """False once any slot got new buffers or a loaded step, or the steps moved apart."""
        return self.changes == ParamSlot.buffer_changes and self.slots[0].step == self.step


def device_batches(slots: list[ParamSlot]) -> list[DeviceBatch]:
    """`slots` split by (param group, step count), in slot order: one fused launch each."""
    parts: dict[tuple, list] = {}
    for slot in slots:
        parts.setdefault((id(slot.group), slot.step), []).append(slot)
    return [DeviceBatch(part) for part in parts.values()]


def launch_batches(batches: list[DeviceBatch], grads: list[list[torch.Tensor]], hypers: dict[int, Hyper], channel,
                   after, *, record_streams: bool) -> torch.cuda.Event:
    """One fused launch per batch on the optimizer stream after `after` (each tensor keeps its own
    rounding stream, its key). `grads[i]`: flat memory-order gradients of batch i. Each batch's
    ``step`` advances (the caller counts the slots'). Without `record_streams` the caller keeps the
    gradients alive until the returned event is complete, or the compute stream waits on it."""
    stream = channel.optimizer
    stream.wait_event(after)
    with torch.cuda.device(channel.device), torch.cuda.stream(stream):
        for batch, batch_grads in zip(batches, grads):
            batch.launch(batch_grads, hypers[id(batch.group)].kwargs(batch.step + 1), stream)
            if record_streams:
                for grad in batch_grads:
                    grad.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def launch_device_update(slot: ParamSlot, grad: torch.Tensor, h: Hyper, channel, after) -> torch.cuda.Event:
    """Queues the CUDA AdamW kernel of a device or mapped slot on the optimizer stream, after
    `after` (the compute work that produced the gradient, a flat memory-order view); returns its
    completion event. The caller counts the step."""
    return launch_device_updates([(slot, grad, h)], channel, after)


def launch_device_updates(batch: list[tuple[ParamSlot, torch.Tensor, Hyper]], channel, after) -> torch.cuda.Event:
    """One fused multi-tensor launch per set of equal hyper-parameters (usually one per step), on
    the optimizer stream after `after`; each tensor keeps its own rounding stream (its index), so a
    batch rounds exactly as single updates would. Returns the event after the last launch."""
    stream = channel.optimizer
    stream.wait_event(after)
    groups: dict[tuple, list] = {}
    for slot, grad, h in batch:
        kwargs = h.kwargs(slot.step + 1)
        groups.setdefault(tuple(sorted(kwargs.items())), []).append((slot, grad))
    with torch.cuda.device(channel.device), torch.cuda.stream(stream):
        for key, items in groups.items():
            ts_adamw.cuda_adamw_step([s.master for s, _ in items], [g for _, g in items],
                                     [s.exp_avg for s, _ in items], [s.exp_avg_sq for s, _ in items],
                                     params_out=[s.weight_view() for s, _ in items], stream=stream.cuda_stream,
                                     **rounding([s for s, _ in items]), **dict(key))
            for _, grad in items:
                grad.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return done


_live_updaters: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _finish_updates_at_exit() -> None:
    # A daemon thread still inside a native call when the interpreter finalizes is
    # killed with pthread_exit, whose forced unwind through C++ frames aborts the
    # process. optimizer.step() returns before its updates finish, so a script may
    # well exit right after one: let every worker finish first.
    for updater in list(_live_updaters):
        updater.close()


# Queued host updates share one adamw_steps call while their values add up to at most BATCH_MAX_VALUES
# (about a millisecond of host AdamW) and their count to BATCH_MAX_ITEMS. A call's fixed cost (plan, waking
# the host threads, the worker re-taking the GIL: 50-200 us) was most of a small or mid-size tensor's update
# (issue 13: LoRA's 82 K to 442 K values per tensor, 896 tensors at the 32B shape); a tensor above the limit
# runs alone, so its upload starts as soon as it is done.
BATCH_MAX_VALUES = 1 << 22
BATCH_MAX_ITEMS = 64
IDLE_CHECK_S = 1.0  # an idle worker looks at its queue this often even unwoken (see HostUpdater.stop_soon)


def _joins(batch_values: int, first: ParamSlot, other: ParamSlot) -> bool:
    """Whether `other`'s update may join a host call that starts with `first`'s and holds `batch_values`
    values so far (see BATCH_MAX_VALUES)."""
    return (batch_values + other.numel <= BATCH_MAX_VALUES and other.step == first.step
            and other.disk is first.disk  # one tier's step, or one adamw_steps call over RAM
            and (first.disk is not None or other.exp_avg.dtype == first.exp_avg.dtype)
            and (other.out_host is other.master) == (first.out_host is first.master)
            and other.hyper == first.hyper)


def _what_failed(slot: ParamSlot, applied: bool) -> str:
    if applied:
        return "its new weight could not be written back (master and moments hold the update)"
    if slot.disk is not None and slot.disk.state.failed is not None:
        return (f"its state on disk at {slot.disk.directory!r} is unusable: the step failed part-way, some segments "
                f"hold it and others do not; resume from a checkpoint")
    return "nothing was changed"


def _distinct(tokens: list) -> list:
    """The tokens that are not None, each once, in order."""
    return list({id(t): t for t in tokens if t is not None}.values())


class HostUpdater:
    """The worker thread that applies host updates in sequence order and uploads the results.

    ``submitted`` (main thread, inside a critical section) and ``applied`` (worker) are the last
    sequence numbers queued and handled; everything between is in the queue or running.
    """

    def __init__(self, channel, marks: UploadMarks, events):
        self._channel = channel
        self._marks = marks
        self._events = events
        self._items: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the worker's bookkeeping; never held across a wait
        self.submitted = 0
        self.applied = 0
        self.updates = 0
        self.calls = 0  # ts-adamw host calls made (updates queued together share one)
        self.busy_seconds = 0.0  # wall time inside host AdamW (the worker's own counter)
        self.observer = None  # a channel.WaitObserver timing the caller's waits below as host-optimizer waits
        self._errors: list[tuple[ParamSlot, BaseException]] = []
        # Liveness as a flag the worker clears on its way out: Thread.is_alive() interrupted by a
        # KeyboardInterrupt on 3.11 can mark a running thread stopped for good.
        self._running = True
        self._thread = threading.Thread(target=self._run, name="trainstream-host-adamw", daemon=True)
        self._thread.start()
        _live_updaters.add(self)

    # ---- main thread ------------------------------------------------------------

    def submit(self, slots: list[ParamSlot]) -> list[int]:
        """Queues the slots' updates (each already QUEUED, hyper set) in one go, so the worker finds them all
        and joins them into as few calls as the limits allow; sets each slot's ``written`` to its sequence and
        returns the sequences. The caller holds
        interrupts.critical(): the queue and the count move together."""
        first = self.submitted + 1
        items = [(first + i, slot) for i, slot in enumerate(slots)]
        for sequence, slot in items:
            slot.written = sequence  # holds() from here on
        try:
            self._items.extend(items)  # one C call: the worker never sees half of it
        except BaseException:
            for _, slot in items:
                slot.written = None  # not held: the engine queues them again (slots.py, invariant 8)
            raise
        self.submitted = first + len(items) - 1
        self._wake.set()
        return [sequence for sequence, _ in items]

    def _wait(self, done) -> None:
        # Polls with short sleeps rather than waiting on a Condition: a KeyboardInterrupt that lands
        # while Condition.wait re-acquires its lock leaves it released and raises a RuntimeError
        # instead (seen in the SIGALRM soak). time.sleep is interrupted cleanly.
        delay = 0.0
        while not done():
            if not self._running:
                raise RuntimeError("trainstream's host update worker has stopped; updates queued to it are lost")
            time.sleep(delay)
            delay = min(1e-3, 2 * delay + 5e-6)

    def wait_applied(self, sequence: int) -> None:
        """Blocks until every update up to `sequence` has been handled (applied or failed)."""
        self._observed_wait(lambda: self.applied >= sequence)

    def holds(self, slot: ParamSlot) -> bool:
        """True while `slot`'s update is queued or running: its sequence (``written``) is not handled yet.
        The worker moves a slot to IDLE before it counts the sequence as applied, so a caller that reads this
        first and the slot's state second never sees a held update's slot as QUEUED and not held."""
        written = slot.written
        return isinstance(written, int) and written > self.applied

    def wait_slot(self, slot: ParamSlot) -> None:
        """Blocks until the worker has released `slot` (it is no longer QUEUED). A slot QUEUED with no update
        held for it (slots.py, invariant 8) is an error naming it, not a wait forever."""
        def released() -> bool:
            if not self.holds(slot) and slot.state is SlotState.QUEUED:
                raise RuntimeError(f"{slot.label} waits for a host update that was never queued (its queueing was "
                                   f"interrupted); this is a bug in trainstream, please report it")
            return slot.state is not SlotState.QUEUED

        self._observed_wait(released)

    def drain(self) -> None:
        """Blocks until every submitted update has been handled."""
        self._observed_wait(lambda: self.applied >= self.submitted)

    def _observed_wait(self, done) -> None:
        observer = self.observer
        if observer is None:
            self._wait(done)
            return
        with observer.host_wait("host_optimizer"):
            self._wait(done)

    def take_errors(self) -> list[tuple[ParamSlot, BaseException]]:
        """The failures not reported yet (each is reported once)."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def close(self) -> None:
        """Applies what is queued, then stops the worker (idempotent)."""
        if not self._running:
            return
        self.drain()
        self.stop_soon()
        self._thread.join()

    def stop_soon(self) -> None:
        """Tells the worker to stop after what is queued, without waiting: safe from a finalizer (the
        engine's, when a dropped model is collected), which may run on the worker's own thread, even inside
        its wake event's lock (Event.wait allocates while holding it): there it only queues the stop, which
        the worker's next timed wait finds."""
        self._items.append(None)
        if threading.current_thread() is not self._thread:
            self._wake.set()

    # ---- worker thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(IDLE_CHECK_S)
                self._wake.clear()
                while self._items:
                    item = self._items.popleft()
                    if item is None:
                        return
                    batch = [item]  # updates queued behind it with the same hyper-parameters join it
                    values = item[1].numel
                    while (len(batch) < BATCH_MAX_ITEMS and self._items and self._items[0] is not None
                           and _joins(values, item[1], self._items[0][1])):
                        batch.append(self._items.popleft())
                        values += batch[-1][1].numel
                    self._apply(batch)
                    del item, batch  # an idle worker must not keep the last slots (and their parameters) alive
        finally:
            self._running = False

    def _apply(self, batch: list[tuple[int, ParamSlot]]) -> None:
        """One host call for the batch's updates, then one launch of their uploads. Rounding streams are keyed
        by the parameter's index under the run's seed, as the CUDA updates are, so a parameter rounds the
        same alone, in a batch, or on the GPU."""
        slots = [slot for _, slot in batch]
        applied = False
        error = None
        try:
            # The gradients' copies, and the previous uploads (a streamed weight: the newest fetch of its block),
            # which read out_host, must be done. A bucket's slots share their tokens: each is waited for once
            # (a wait re-takes the GIL from the training loop).
            for token in _distinct([s.grad_token for s in slots] + [s.upload_event for s in slots]):
                self._channel.host_wait(token)
            self._adamw(slots)
            applied = True
        except BaseException as failure:  # reported once, at the next sync point
            error = failure
        if error is not None and len(batch) > 1 and slots[0].disk is None:
            # adamw_steps changes nothing when it raises: one by one, only the update that fails is reported.
            # (A disk tier's failure is its file's, not one update's: the whole batch is reported.)
            for item in batch:
                self._apply([item])
            return
        # The new weights go up in one launch (a streamed weight's next fetch carries it: slots.py, invariant 7).
        uploads = [slot for slot in slots if applied and not slot.streamed]
        upload_error = None
        if uploads:
            try:
                event = self._channel.upload_many([s.out_host for s in uploads], [s.weight_view() for s in uploads],
                                                  self._marks)
                for s in uploads:
                    s.upload_event = event
            except BaseException as failure:  # every weight of the launch counts as not written back
                upload_error = failure
        self._handled(batch, applied, error, upload_error)

    def _adamw(self, slots: list[ParamSlot]) -> None:
        first = slots[0]
        started = time.perf_counter()
        if first.disk is not None:  # the state is on disk (slots.py, invariant 7b): read, update, write back
            first.disk.step(slots, first.hyper.kwargs(first.step + 1))
        else:
            self._adamw_in_ram(slots)
        self.busy_seconds += time.perf_counter() - started
        self.calls += 1

    @staticmethod
    def _adamw_in_ram(slots: list[ParamSlot]) -> None:
        first = slots[0]
        ts_adamw.adamw_steps([s.master for s in slots], [s.grad_host for s in slots], [s.exp_avg for s in slots],
                             [s.exp_avg_sq for s in slots],
                             params_out=None if first.out_host is first.master else [s.out_host for s in slots],
                             **rounding(slots), **first.hyper.kwargs(first.step + 1))

    def _handled(self, batch: list[tuple[int, ParamSlot]], applied: bool, error: BaseException | None,
                 upload_error: BaseException | None) -> None:
        with self._lock:  # handled, applied or not: nobody waits forever on these sequences
            for sequence, slot in batch:
                failed = error if error is not None else (upload_error if not slot.streamed else None)
                slot.grad_token = slot.hyper = None
                if applied:
                    slot.step += 1
                    self.updates += 1
                if failed is not None:
                    what = _what_failed(slot, applied)
                    self._errors.append((slot, failed))
                    self._events.add("error", f"host update of {slot.label} failed ({what}): {failed!r}")
                slot.move(SlotState.IDLE)
                self.applied = sequence  # last: waiters see the slot IDLE and its step counted first
