"""The update engine: gradient hooks, placements, clipping, accumulation, step()."""

from __future__ import annotations

import math

import torch
import ts_adamw
import ts_pinned

from ._channel import channel_for
from ._events import EventLog
from ._slots import ParamSlot, Pending
from ._updates import HostUpdater, hyper_of, launch_device_update

__all__ = ["UpdateEngine"]


class UpdateEngine:
    """Owns the slots of every trained parameter and moves each update through its placement.

    Without clipping, a parameter's update starts the moment autograd has
    accumulated its gradient (the last of `accumulation_steps` backward passes),
    while backward continues. With `max_grad_norm`, gradients are collected
    first and every update waits for the global norm at step().
    """

    def __init__(self, slots: list[ParamSlot], device: torch.device, moment_dtype: torch.dtype,
                 arena: ts_pinned.PinnedArena, events: EventLog, *, max_grad_norm: float | None,
                 accumulation_steps: int, seed: int):
        self.slots = slots
        self.by_param = {id(s.param): s for s in slots}
        self.device = device
        self.moment_dtype = moment_dtype
        self.arena = arena
        self.events = events
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.seed = seed
        self.channel = channel_for(device)
        self.host = HostUpdater(self.channel, events)
        self.last_grad_norm: float | None = None
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad) for s in slots]

    # ---- gradients arrive -------------------------------------------------

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        slot = self.by_param[id(param)]
        slot.micro += 1
        if slot.micro < self.accumulation_steps:
            return  # keep accumulating in param.grad, as autograd does
        self._offload(slot)

    def _offload(self, slot: ParamSlot) -> None:
        grad = slot.param.grad
        if grad is None:
            return
        slot.micro = 0
        after = self.channel.mark_compute()
        if slot.placement == "host":
            token = self.channel.to_host(grad.detach().reshape(-1), slot.grad_host, after)
            slot.param.grad = None  # its memory now belongs to the D2H stream
            if self.max_grad_norm is None:
                slot.step += 1
                slot.pending = self.host.submit(slot, token, hyper_of(slot, 1.0, self.seed))
            else:
                slot.grad_token, slot.arrived = token, True
        elif self.max_grad_norm is None:
            slot.step += 1
            slot.pending = launch_device_update(slot, grad, hyper_of(slot, 1.0, self.seed), self.channel, after)
            slot.param.grad = None
        else:
            slot.arrived = True  # device gradients wait in param.grad for the norm

    # ---- step ---------------------------------------------------------------

    def step(self) -> None:
        """Flushes gradients still accumulating, applies clipping, queues the rest of the updates."""
        self.raise_worker_error()
        for slot in self.slots:
            if slot.micro > 0 and slot.param.grad is not None:
                self._offload(slot)  # step() came before accumulation_steps passes
        if self.max_grad_norm is not None:
            self._clip_and_update()

    def _clip_and_update(self) -> None:
        arrived = [s for s in self.slots if s.arrived]
        if not arrived:
            return
        for s in arrived:
            if s.placement == "host":
                self.channel.host_wait(s.grad_token)
        host = [s.grad_host for s in arrived if s.placement == "host"]
        total = ts_adamw.sum_of_squares(host) if host else 0.0
        device = [s.param.grad.detach().reshape(-1) for s in arrived if s.placement != "host"]
        if device:
            total += float(torch.stack([torch.linalg.vector_norm(g.float()) ** 2 for g in device]).sum())
        norm = math.sqrt(total)
        self.last_grad_norm = norm
        # Same coefficient as torch.nn.utils.clip_grad_norm_.
        scale = min(1.0, self.max_grad_norm / (norm + 1e-6))
        after = self.channel.mark_compute()
        for s in arrived:
            s.arrived = False
            s.step += 1
            h = hyper_of(s, scale, self.seed)
            if s.placement == "host":
                s.pending = self.host.submit(s, None, h)
            else:
                s.pending = launch_device_update(s, s.param.grad, h, self.channel, after)
                s.param.grad = None

    def discard_arrived(self) -> None:
        """zero_grad(): gradients collected for clipping but never stepped are dropped."""
        for s in self.slots:
            if s.arrived:
                s.arrived = False
                if s.placement != "host":
                    s.param.grad = None
            s.micro = 0

    # ---- waiting --------------------------------------------------------------

    def raise_worker_error(self) -> None:
        if self.host.error is not None:
            error, self.host.error = self.host.error, None
            raise RuntimeError(f"a host AdamW update failed: {error!r}") from error

    def wait_weight(self, slot: ParamSlot) -> None:
        """Orders the compute stream after the update of `slot`'s weight (host wait until it is queued)."""
        pending: Pending | None = slot.pending
        if pending is None:
            return
        pending.issued.wait()
        if pending.error is not None:
            slot.pending = None
            raise RuntimeError(f"the update of parameter {slot.index} failed: {pending.error!r}") from pending.error
        self.channel.compute_wait(pending.token)
        slot.pending = None

    def synchronize(self) -> None:
        """Every queued update applied and every weight written (host and device)."""
        self.host.drain()
        for slot in self.slots:
            pending = slot.pending
            if pending is not None:
                pending.issued.wait()
                if self.channel.is_cuda and pending.token is not None:
                    pending.token.synchronize()
                slot.pending = None
        self.channel.synchronize()
        self.raise_worker_error()

    # ---- placements -----------------------------------------------------------

    def place(self, slots: list[ParamSlot], placement: str) -> int:
        """Moves slots to a placement (after synchronize()); returns the bytes moved."""
        moved = 0
        for slot in slots:
            if slot.placement != placement:
                slot.move_to(placement, self.arena)
                moved += slot.numel
        return moved

    def close(self) -> None:
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.host.close()
