"""The AdamW update of one parameter, wherever its state lives.

Host updates run on a worker thread, in the order gradients arrive, each using
all of ts-adamw's host threads; device and mapped updates are CUDA kernels
queued on the optimizer stream. Either way the new weight's arrival is a
`Pending` that the next forward waits for.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from dataclasses import dataclass

import torch
import ts_adamw

from ._slots import ParamSlot, Pending

__all__ = ["HostUpdater", "Hyper", "hyper_of", "launch_device_update"]


@dataclass(frozen=True)
class Hyper:
    """Hyper-parameters of one update, read from the param group when the gradient arrives."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    maximize: bool
    step: int
    grad_scale: float
    seed: int


def hyper_of(slot: ParamSlot, grad_scale: float, seed: int) -> Hyper:
    g = slot.group
    beta1, beta2 = g["betas"]
    return Hyper(
        lr=float(g["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(g["eps"]),
        weight_decay=float(g["weight_decay"]),
        maximize=bool(g.get("maximize", False)),
        step=slot.step,
        grad_scale=float(grad_scale),
        # Distinct stochastic-rounding streams per parameter, reproducible across runs.
        seed=(seed * 1_000_003 + slot.index) & 0xFFFFFFFF,
    )


def _kwargs(h: Hyper) -> dict:
    return {
        "lr": h.lr,
        "beta1": h.beta1,
        "beta2": h.beta2,
        "eps": h.eps,
        "weight_decay": h.weight_decay,
        "step": h.step,
        "maximize": h.maximize,
        "grad_scale": h.grad_scale,
        "seed": h.seed,
    }


def launch_device_update(slot: ParamSlot, grad: torch.Tensor, h: Hyper, channel, after) -> Pending:
    """Queues the CUDA AdamW kernel for a device or mapped slot on the optimizer
    stream, after `after` (the compute work that produced the gradient)."""
    stream = channel.optimizer
    stream.wait_event(after)
    pending = Pending()
    with torch.cuda.device(channel.device), torch.cuda.stream(stream):
        ts_adamw.cuda_adamw_step(
            [slot.master],
            [grad.detach().reshape(-1)],
            [slot.exp_avg],
            [slot.exp_avg_sq],
            params_out=[slot.param.data.view(-1)],
            stream=stream.cuda_stream,
            **_kwargs(h),
        )
        grad.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    pending.resolve(done)
    return pending


_live_updaters: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _finish_updates_at_exit() -> None:
    # A daemon thread still inside a native call when the interpreter finalizes is
    # killed with pthread_exit, whose forced unwind through C++ frames aborts the
    # process. optimizer.step() returns before its updates finish, so a script may
    # well exit right after one: let every worker finish first.
    for updater in list(_live_updaters):
        updater.close()


class HostUpdater:
    """A worker thread that applies host updates in arrival order and uploads the results."""

    def __init__(self, channel, events):
        self._channel = channel
        self._events = events
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self.error: BaseException | None = None
        self.updates = 0
        self._thread = threading.Thread(target=self._run, name="trainstream-host-adamw", daemon=True)
        self._thread.start()
        _live_updaters.add(self)

    def submit(self, slot: ParamSlot, grad_token, h: Hyper) -> Pending:
        pending = Pending()
        with self._idle:
            self._outstanding += 1
        self._queue.put((slot, grad_token, h, pending))
        return pending

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            slot, grad_token, h, pending = item
            try:
                self._channel.host_wait(grad_token)
                ts_adamw.adamw_step(
                    slot.master,
                    slot.grad_host,
                    slot.exp_avg,
                    slot.exp_avg_sq,
                    param_out=None if slot.out_host is slot.master else slot.out_host,
                    **_kwargs(h),
                )
                token = self._channel.to_model(slot.out_host, slot.param.data.view(-1))
                pending.resolve(token)
                self.updates += 1
            except BaseException as error:  # surfaced by the next wait or step()
                self.error = self.error or error
                self._events.add("error", f"host update of parameter {slot.index} failed: {error!r}")
                pending.resolve(error=error)
            finally:
                with self._idle:
                    self._outstanding -= 1
                    if self._outstanding == 0:
                        self._idle.notify_all()

    def drain(self) -> None:
        """Waits until every submitted update has been applied and its upload queued."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)

    def close(self) -> None:
        """Applies what is queued, then stops the worker (idempotent)."""
        if not self._thread.is_alive():
            return
        self.drain()
        self._queue.put(None)
        self._thread.join()
