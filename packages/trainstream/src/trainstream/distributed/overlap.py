"""Gradient reductions started during backward (DataParallel's overlap).

While *armed*, a post-accumulate-grad hook on every trained parameter counts its gradients; at the
``accumulation_steps``-th one the gradient is final. The *plan* is the buckets of the trained
parameters' pieces exactly as step() would build them (``make_buckets`` in parameter order, so the same
contents, sums and division as without overlap), launched in a fixed order: by their first
parameter, last first (gradients arrive roughly last layer first). Bucket k is copied into its flat
buffer and its ``reduce`` to the owner started as soon as it and every bucket before it in that
order are final, so every rank issues a prefix of the same sequence during backward.

At step() ``finish`` launches the rest of the plan with whatever gradients there are (zeros where
a rank has none), so every rank has issued the whole plan, in the same order, before the flags
all-reduce: a rank whose backward skipped a parameter, a step() before the window completes, or
different numbers of backward passes can never leave collectives unmatched. ``problems`` then
counts what makes the results unusable on this rank (a copied gradient changed or replaced since,
the trained set changed); the caller sums it over the ranks with the flags, and the results are used
only when nothing changed anywhere and every planned parameter has a gradient on some rank;
otherwise they are waited for, dropped, and step() reduces as without overlap.

Every rank arms and disarms at the same step (decided from all-reduced values only). Collectives of
the same process group issued by the user between backward and step() match only while every rank's
backward produced the same gradients (the same contract as DDP without ``find_unused_parameters``).
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..engine.hooks import EngineHook
from ..engine.slots import grad_in_memory_order
from .sharding import Bucket

__all__ = ["EagerReductions", "launch_order"]


def launch_order(buckets: list[Bucket]) -> list[int]:
    """Bucket indices by their first item, highest first: the order gradients complete them."""
    return sorted(range(len(buckets)), key=lambda b: -buckets[b].items[0])


def _closed(engine) -> bool:
    # The engine disables its gradient hook in close(); until close() also calls DataParallel.close(),
    # this keeps a closed (unwrapped) engine's parameters from starting reductions.
    return engine is None or getattr(getattr(engine, "_grad_hook", None), "_fn", True) is None


class EagerReductions:
    """One plan of buckets, the hooks that launch them during backward, and the works in flight."""

    def __init__(self, dp, plan_slots: list, accumulation_steps: int, engine):
        self.dp = dp
        self.slots = plan_slots
        self.accumulation = max(1, int(accumulation_steps))
        self._engine = weakref.ref(engine) if engine is not None else (lambda: None)
        self.pieces = dp.pieces_of(plan_slots)
        self.buckets = dp._buckets(self.pieces)
        self.order = launch_order(self.buckets)
        self.position = {id(s.param): i for i, s in enumerate(plan_slots)}
        slot_at = {s.index: i for i, s in enumerate(plan_slots)}
        self.piece_slot = [slot_at[p.item] for p in self.pieces]  # each piece's position in plan_slots
        self.buckets_of: list[list[int]] = [[] for _ in plan_slots]  # the buckets holding a slot's pieces
        for b, bucket in enumerate(self.buckets):
            for i in bucket.items:
                self.buckets_of[self.piece_slot[i]].append(b)
        self._lock = threading.Lock()  # hooks of several device threads
        self._hook = EngineHook(self._on_grad, weak=True)
        self.handles = [s.param.register_post_accumulate_grad_hook(self._hook) for s in plan_slots]
        self.in_backward = 0  # buckets of this window started by the hooks
        self.at_step = 0  # buckets of this window started by finish()
        self.reset()

    def reset(self) -> None:
        """A new accumulation window: nothing counted, launched or in flight."""
        self.arrivals = [0] * len(self.slots)
        self.missing = [len(b.items) for b in self.buckets]
        self.launched = 0  # how many buckets of self.order are started
        self.pending: list[tuple[Bucket, torch.Tensor, object]] = []
        self.copied: list = [None] * len(self.pieces)  # (grad or None, its version) as each piece was copied
        self.in_backward = self.at_step = 0

    def restart_window(self) -> None:
        """zero_grad() before the window completed: the gradients counted so far are gone. What was
        started stays started (the sequence continues where it is; step() sees the replaced gradients)."""
        with self._lock:
            self.arrivals = [0] * len(self.slots)
            self.missing = [len(b.items) for b in self.buckets]

    def close(self) -> None:
        """The hooks removed (they also do nothing from now on)."""
        self._hook.disable()
        for h in self.handles:
            h.remove()
        self.handles = []

    # ---- launching ---------------------------------------------------------------------

    def _on_grad(self, param) -> None:
        if _closed(self._engine()):
            return
        with self._lock:
            i = self.position[id(param)]
            self.arrivals[i] += 1
            if self.arrivals[i] != self.accumulation:
                return  # not final yet, or a pass beyond the window (problems() sees the change)
            for b in self.buckets_of[i]:
                self.missing[b] -= 1
            while self.launched < len(self.order) and self.missing[self.order[self.launched]] == 0:
                self._launch_next()
                self.in_backward += 1

    def _launch_next(self) -> None:
        b = self.order[self.launched]
        bucket = self.buckets[b]
        buf = self.dp._buffer(bucket, self.pieces)
        offset = 0
        with torch.no_grad():
            for i in bucket.items:
                piece = self.pieces[i]
                slot = self.slots[self.piece_slot[i]]
                part = buf[offset:offset + piece.numel]
                grad = slot.param.grad
                if grad is None:
                    part.zero_()  # no gradient on this rank: its share of the global batch contributes 0
                    self.copied[i] = (None, 0)
                else:
                    part.copy_(grad_in_memory_order(grad.detach(), slot.param)[piece.lo:piece.hi])
                    self.copied[i] = (grad, grad._version)
                offset += piece.numel
        self.pending.append((bucket, buf, self.dp.comm.reduce_async(buf, bucket.owner)))
        self.launched += 1

    def finish(self) -> None:
        """Starts every bucket of the plan not started yet (collective: every rank calls it alike)."""
        with self._lock:
            while self.launched < len(self.order):
                self._launch_next()
                self.at_step += 1

    # ---- at step() -------------------------------------------------------------------------

    def problems(self, trained: list) -> int:
        """What makes this rank's reductions unusable: 1 when the trained parameters are not the
        plan's, plus one per copied gradient changed or replaced since it was copied."""
        count = int(len(trained) != len(self.slots) or any(a is not b for a, b in zip(trained, self.slots)))
        changed = set()  # slot positions (a split parameter's pieces count once)
        for position, copied in zip(self.piece_slot, self.copied):
            grad = self.slots[position].param.grad
            if copied is None or copied[0] is not grad or (grad is not None and grad._version != copied[1]):
                changed.add(position)
        return count + len(changed)

    def wait(self) -> list[tuple[Bucket, torch.Tensor]]:
        """Every reduction of the plan completed, in launch order (bounded waits)."""
        done = []
        for bucket, buf, work in self.pending:
            self.dp.comm.wait(work, f"the reduction of gradients to rank {bucket.owner}")
            done.append((bucket, buf))
        self.pending = []
        return done
