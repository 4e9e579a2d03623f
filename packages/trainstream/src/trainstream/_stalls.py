"""Stall attribution: per optimizer step, how long the training loop waited on the host<->GPU link,
on the host optimizer, on the disk holding optimizer state (nvme_path), and on nothing (the rest of the
step: compute, data, the user's code).

``StallClock`` keeps the recent steps. It is a ``WaitObserver`` (engine/channel.py): the session has
the engine, the weight streamer and the activation pager report their waits to it (``observe``), and
closes a step after each optimizer step. Waits are recorded where they happen: ``host_wait(cause)``
around a wait that blocks the Python thread; ``device_wait(cause)`` around a wait enqueued on the
compute stream (timed with a pair of CUDA events, read at a later step end, so nothing synchronizes).
``stalls_from_timings`` turns one step's timings into the reported numbers.

The disk is waited on by the host worker, not by the training loop: a host-optimizer wait is charged to
the disk for as long as the worker itself waited on disk transfers during the step (at most the whole
wait), the rest stays the host optimizer's. That assumes the worker's disk waits fell inside the loop's
waits, so ``disk_s`` is the most the disk can have cost the step.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

import torch

__all__ = ["CAUSES", "StallClock", "stalls_from_timings"]

CAUSES = ("link", "host_optimizer")


def stalls_from_timings(step_s: float, waits: dict[str, float], disk_wait_s: float = 0.0) -> dict[str, float]:
    """One step's attribution (seconds): ``link_s`` and ``host_optimizer_s`` as waited (each at most the
    step, together at most the step: overlapping waits are scaled down to fit), ``disk_s`` the part of the
    host-optimizer wait the worker spent waiting on the disk (``disk_wait_s``; module docstring), and
    ``none_s`` the rest."""
    if not step_s >= 0:
        raise ValueError(f"step_s={step_s!r} must be a number of seconds >= 0")
    unknown = set(waits) - set(CAUSES)
    if unknown:
        raise ValueError(f"unknown wait cause(s) {sorted(unknown)}; use {', '.join(CAUSES)}")
    parts = {c: max(0.0, float(waits.get(c, 0.0))) for c in CAUSES}
    total = sum(parts.values())
    scale = step_s / total if total > step_s else 1.0
    out = {f"{c}_s": parts[c] * scale for c in CAUSES}
    out["none_s"] = max(0.0, step_s - sum(out.values()))
    out["disk_s"] = min(out["host_optimizer_s"], max(0.0, float(disk_wait_s)))
    out["host_optimizer_s"] -= out["disk_s"]
    out["step_s"] = step_s
    return out


def _host_rss() -> int | None:
    """This process's resident memory (psutil, which the Hugging Face extra brings); None without it."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss


class StallClock:
    """Per-step waits of one wrapped model (thread-safe; waits on other threads than the training
    loop's are not stalls of the step and are ignored). ``recent()``: the last ``keep`` steps."""

    def __init__(self, device: torch.device, keep: int = 32, busy=lambda: 0.0, forwards=lambda: 0,
                 disk_wait=lambda: 0.0):
        self.device = device
        self._cuda = device.type == "cuda"
        self._thread = threading.get_ident()
        self._lock = threading.Lock()
        self._busy = busy  # cumulative host AdamW seconds (the worker's counter)
        self._busy_at = busy()
        self._disk_wait = disk_wait  # cumulative seconds the host worker waited on the disk tier's transfers
        self._disk_wait_at = disk_wait()
        self._forwards = forwards  # cumulative training forwards (the engine's counter)
        self._forwards_at = forwards()
        self._tokens: tuple[int, int] | None = None  # (batch, sequence) of this step's last training forward
        self._waits = dict.fromkeys(CAUSES, 0.0)
        self._pending: list[tuple[int, str, object, object]] = []  # (step, cause, start event, end event)
        self._steps: collections.deque = collections.deque(maxlen=keep)
        self._started = time.perf_counter()
        self.step = 0

    @property
    def cuda(self) -> bool:
        return self._cuda

    def add(self, cause: str, seconds: float) -> None:
        if cause not in self._waits:
            raise ValueError(f"unknown wait cause {cause!r}; use {', '.join(CAUSES)}")
        with self._lock:
            self._waits[cause] += seconds

    @contextlib.contextmanager
    def host_wait(self, cause: str):
        """Times a wait that blocks the training loop's thread."""
        if threading.get_ident() != self._thread:
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(cause, time.perf_counter() - started)

    @contextlib.contextmanager
    def device_wait(self, cause: str):
        """Times a wait enqueued on the compute stream (on the CPU the wait blocks: timed on the host)."""
        if not self._cuda:
            with self.host_wait(cause):
                yield
            return
        if torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():  # no events in a graph
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._pending.append((self.step, cause, start, end))

    def block_input(self, _module, args, kwargs) -> None:
        """A forward pre-hook (``with_kwargs``) for the first block: the (batch, sequence) of the hidden states a
        training forward (gradients on) carries, recorded with the step (the plan prices batch x sequence)."""
        if not torch.is_grad_enabled():
            return
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 and hidden.shape[-1]:
            batch = int(hidden.shape[0]) if hidden.dim() >= 3 else 1
            self._tokens = (batch, hidden.numel() // (hidden.shape[-1] * max(batch, 1)))

    def _resolve(self) -> None:
        """Device waits whose events completed go to the step they belong to."""
        keep = []
        by_step = {s["step"]: s for s in self._steps}
        for step, cause, start, end in self._pending:
            if not end.query():
                keep.append((step, cause, start, end))
                continue
            target = by_step.get(step)
            if target is not None:
                target["waits"][cause] += start.elapsed_time(end) / 1e3
        self._pending = keep

    def step_finished(self) -> None:
        """Closes the current step (called after each optimizer step)."""
        now = time.perf_counter()
        busy, forwards, disk_wait = self._busy(), self._forwards(), self._disk_wait()
        gpu = ({"allocated": torch.cuda.memory_allocated(self.device),
                "peak_allocated": torch.cuda.max_memory_allocated(self.device)} if self._cuda else None)
        with self._lock:
            record = {"step": self.step + 1, "step_s": now - self._started, "waits": dict(self._waits),
                      "host_adamw_busy_s": busy - self._busy_at, "gpu": gpu, "host_rss": _host_rss(),
                      "tokens": None if self._tokens is None else list(self._tokens),
                      "forwards": forwards - self._forwards_at, "disk_wait_s": disk_wait - self._disk_wait_at}
            self._waits = dict.fromkeys(CAUSES, 0.0)
            self._started, self._busy_at, self._forwards_at, self._tokens = now, busy, forwards, None
            self._disk_wait_at = disk_wait
            self._steps.append(record)
            self.step += 1
            self._resolve()

    def recent(self) -> list[dict]:
        """The recent steps, oldest first: ``step``, ``step_s``, ``link_s``, ``host_optimizer_s``, ``disk_s``,
        ``none_s`` (seconds), ``disk_wait_s`` (the host worker's waits on the disk tier, overlapping or not), ``host_adamw_busy_s`` (host AdamW compute, overlapping or not),
        ``gpu`` (allocated / peak bytes at the step's end, None on the CPU), ``host_rss`` (bytes; None without
        psutil), ``tokens``
        ([batch, sequence] of the step's last training forward as the first block saw it; None where no hook
        saw one) and ``forwards`` (training forwards in the step: more than one under accumulation)."""
        with self._lock:
            self._resolve()
            steps = [dict(s, waits=dict(s["waits"])) for s in self._steps]
        out = []
        for s in steps:
            waits = s.pop("waits")
            out.append({**s, **stalls_from_timings(s["step_s"], waits, s["disk_wait_s"])})
        return out
