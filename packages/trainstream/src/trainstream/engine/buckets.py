"""Gradient buckets: host-placed gradients leave the GPU a bucket at a time, not a tensor at a time.

A bucket is a run of consecutive host-placed slots (in the optimizer's parameter order, so a block's
parameters sit together) of at most ``BATCH_MAX_VALUES`` values and ``BATCH_MAX_ITEMS`` slots: what one
host AdamW call takes (updates.py). The gradient hook only notes that a slot's gradient is complete
(``arrive``); once every slot of its bucket has, the engine takes the bucket in one go: one event after
the compute that produced the gradients, one D2H launch for all of them, one hyper-parameter check per
param group, the updates queued together and the worker woken once (issue 13: per-tensor hook work was
35-70 us a tensor, 896 tensors at the LoRA 32B shape).

Slots whose gradient never comes in a backward pass (a parameter unused by that forward) would hold
their bucket back: the engine takes every partly filled bucket at the end of each backward pass (an
autograd final callback) and at ``step()`` and ``zero_grad()``, so between backward passes no gradient
waits here, except after a backward pass that raised (autograd runs no final callback then): those wait
for the next ``step()`` or ``zero_grad()``, or the end of the next backward pass.

State: ``pending`` lists, written by the engine only, inside its critical sections. Invariant: a slot is
in at most one pending list, with its complete gradient in ``param.grad`` and its state IDLE or
ACCUMULATING (``micro`` not yet reset), and each pending list is shorter than its bucket.
"""

from __future__ import annotations

from . import updates
from .slots import ParamSlot

__all__ = ["Bucket", "GradBuckets"]


class Bucket:
    __slots__ = ("pending", "slots")

    def __init__(self, slots: list[ParamSlot]):
        self.slots = slots
        self.pending: list[ParamSlot] = []


class GradBuckets:
    """The buckets of one engine's hooked host slots, rebuilt when the set changes (``invalidate``)."""

    def __init__(self) -> None:
        self._of: dict[int, Bucket] | None = None  # id(slot) -> its bucket; None: rebuild before use
        self.buckets: list[Bucket] = []

    def invalidate(self) -> None:
        self._of = None

    def build(self, slots: list[ParamSlot]) -> None:
        """Buckets of the slots that take their gradients in the hook on the host, in slot order.
        The caller has taken every pending gradient first."""
        buckets, current, values = [], [], 0
        for slot in slots:
            if slot.hook is None or slot.placement != "host" or slot.grad_host is None:
                continue
            if current and (values + slot.numel > updates.BATCH_MAX_VALUES
                            or len(current) >= updates.BATCH_MAX_ITEMS):
                buckets.append(Bucket(current))
                current, values = [], 0
            current.append(slot)
            values += slot.numel
        if current:
            buckets.append(Bucket(current))
        self.buckets = buckets
        self._of = {id(s): b for b in buckets for s in b.slots}

    @property
    def valid(self) -> bool:
        return self._of is not None

    def of(self, slot: ParamSlot) -> Bucket | None:
        """The bucket of `slot` (None: the slot takes its gradient alone). Only while ``valid``."""
        return self._of.get(id(slot))

    def arrive(self, bucket: Bucket, slot: ParamSlot) -> list[ParamSlot] | None:
        """Notes `slot`'s complete gradient; the bucket's slots when it is full (its pending list emptied).
        A slot already pending (a backward pass that raised left it; autograd has added the new gradient to
        the one in ``param.grad``, as for any parameter) is not noted twice."""
        if slot not in bucket.pending:
            bucket.pending.append(slot)
        if len(bucket.pending) < len(bucket.slots):
            return None
        full, bucket.pending = bucket.pending, []
        return full

    def take_pending(self) -> list[ParamSlot]:
        """Every pending slot, oldest bucket first; the pending lists emptied."""
        out = []
        for bucket in self.buckets:
            if bucket.pending:
                out += bucket.pending
                bucket.pending = []
        return out

    def has_pending(self) -> bool:
        return any(b.pending for b in self.buckets)
