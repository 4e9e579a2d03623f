"""Per-parameter optimizer state and where it lives.

Placements:
  "host"   fp32 master and moments in page-locked host RAM, updated by ts-adamw on
           host threads; the gradient comes down, the rounded weight goes back up.
  "device" the same state in VRAM, updated by ts-adamw's CUDA kernel (stock
           fused AdamW's numerics with fp32 master weights).
  "mapped" the state in page-locked host RAM, updated by the CUDA kernel through
           mapped (zero-copy) memory: no host threads, the link carries the state.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import ts_pinned

__all__ = ["PLACEMENTS", "ParamSlot", "Pending"]

PLACEMENTS = ("host", "device", "mapped")


class Pending:
    """A weight update in flight: `issued` is set once the copy (or kernel) that
    writes the new weight is queued; `token` then says when it is complete."""

    __slots__ = ("error", "issued", "token")

    def __init__(self) -> None:
        self.issued = threading.Event()
        self.token = None
        self.error: BaseException | None = None

    def resolve(self, token=None, error: BaseException | None = None) -> None:
        self.token = token
        self.error = error
        self.issued.set()


@dataclasses.dataclass(eq=False)
class ParamSlot:
    """Everything the engine keeps for one trained parameter."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's param_groups order
    group: dict
    placement: str = "host"
    step: int = 0
    micro: int = 0  # backward passes accumulated since the last update
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad_host: torch.Tensor | None = None  # host placement: where the gradient lands
    out_host: torch.Tensor | None = None  # host placement: rounded weight for the upload
    pending: Pending | None = None
    grad_token: object = None  # clipping: D2H copy event of the arrived gradient
    arrived: bool = False  # a gradient is waiting for step() (clipping)

    @property
    def numel(self) -> int:
        return self.param.numel()

    def state_bytes(self) -> int:
        """Bytes of master + moments (+ host gradient / upload buffers)."""
        tensors = (self.master, self.exp_avg, self.exp_avg_sq, self.grad_host, self.out_host)
        seen, total = set(), 0
        for t in tensors:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def allocate(self, placement: str, moment_dtype: torch.dtype, arena: ts_pinned.PinnedArena) -> None:
        """Creates the state buffers for `placement` from the current weight; moments start at zero."""
        p = self.param.detach()
        n = p.numel()
        if placement == "device":
            self.master = p.reshape(-1).to(torch.float32, copy=True)
            self.exp_avg = torch.zeros(n, dtype=moment_dtype, device=p.device)
            self.exp_avg_sq = torch.zeros(n, dtype=moment_dtype, device=p.device)
            self.grad_host = self.out_host = None
        else:
            self.master = arena.empty(n, torch.float32, tag="master")
            self.master.copy_(p.reshape(-1))
            self.exp_avg = arena.empty(n, moment_dtype, tag="moments").zero_()
            self.exp_avg_sq = arena.empty(n, moment_dtype, tag="moments").zero_()
            if placement == "host":
                self.grad_host = arena.empty(n, p.dtype, tag="grads")
                # fp32 weights upload straight from the master copy.
                self.out_host = self.master if p.dtype == torch.float32 else arena.empty(n, p.dtype, tag="weights")
            else:
                self.grad_host = self.out_host = None
        self.placement = placement

    def move_to(self, placement: str, arena: ts_pinned.PinnedArena) -> None:
        """Moves master and moments to another placement, keeping their values."""
        if placement == self.placement:
            return
        master, exp_avg, exp_avg_sq = self.master, self.exp_avg, self.exp_avg_sq
        self.allocate(placement, exp_avg.dtype, arena)
        self.master.copy_(master)
        self.exp_avg.copy_(exp_avg)
        self.exp_avg_sq.copy_(exp_avg_sq)
