"""DataParallel: the update engine's step hook for a process group of several ranks.

At ``step()`` (after the step's last backward: gradients accumulate locally in ``param.grad`` until
then, so accumulation costs no communication), the engine calls, in this order on every rank:

1. ``before_step``: which trained parameters have a gradient on any rank (one all-reduce of flags),
   then each bucket of them is summed into its owner and averaged; the owner finds the global
   gradient in ``param.grad``, every other rank finds none.
2. the engine's own updates of the slots this rank owns; with ``max_grad_norm`` the norm comes
   from ``global_sum_of_squares`` (every rank's owned sum of squares, all-reduced).
3. ``after_updates``: every owned update applied, then each bucket's new weights are broadcast
   from its owner.

So the ranks train exactly as one process on the global batch, and only the owner of a parameter
keeps its fp32 master and moments (the others' slots stay DORMANT).
"""

from __future__ import annotations

import torch

from ..engine.slots import flat, grad_in_memory_order, shaped
from .collectives import Comm
from .sharding import Bucket, make_buckets

__all__ = ["DataParallel"]


class DataParallel:
    """Ownership, buckets and the step's collectives for one wrapped model (see the module docstring)."""

    def __init__(self, comm: Comm, slots: list, owners: list[int], bucket_bytes: int):
        self.comm = comm
        self.slots = slots
        self.owners = owners  # by slot position (== slot.index)
        self.bucket_bytes = int(bucket_bytes)
        for slot, owner in zip(slots, owners):
            slot.owned = owner == comm.rank
        self._updated: list = []
        self.steps = 0

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world

    def _buckets(self, slots: list, source: int | None = None) -> list[Bucket]:
        owners = [self.owners[s.index] if source is None else source for s in slots]
        return make_buckets(owners,
                            [s.numel * s.param.element_size() for s in slots],
                            [s.param.dtype for s in slots], self.bucket_bytes)

    def _buffer(self, bucket: Bucket, slots: list) -> torch.Tensor:
        return torch.empty(sum(slots[i].numel for i in bucket.items), dtype=bucket.dtype, device=self.comm.device)

    # ---- the step ------------------------------------------------------------------------

    def before_step(self, engine) -> None:
        """Every trained gradient averaged over the ranks, in its owner's ``param.grad`` only."""
        trained = [s for s in self.slots if s.param.requires_grad]
        flags = torch.tensor([s.param.grad is not None for s in trained], dtype=torch.int32, device=self.comm.device)
        if trained:
            self.comm.all_reduce(flags, "the exchange of which parameters have gradients")
        with_grad = [s for s, f in zip(trained, flags.tolist()) if f > 0]
        self._updated = with_grad
        pending = []
        for bucket in self._buckets(with_grad):
            buf = self._buffer(bucket, with_grad)
            offset = 0
            for i in bucket.items:
                slot = with_grad[i]
                part = buf[offset:offset + slot.numel]
                grad = slot.param.grad
                if grad is None:
                    part.zero_()  # no gradient on this rank: its share of the global batch contributes 0
                else:
                    part.copy_(grad_in_memory_order(grad.detach(), slot.param))
                    slot.param.grad = None  # the bucket holds it now
                offset += slot.numel
            pending.append((bucket, buf, self.comm.reduce_async(buf, bucket.owner)))
        for bucket, buf, work in pending:
            self.comm.wait(work, f"the reduction of gradients to rank {bucket.owner}")
            if bucket.owner != self.rank:
                continue
            buf.div_(self.world)
            offset = 0
            for i in bucket.items:
                slot = with_grad[i]
                part = buf[offset:offset + slot.numel]
                if part.device != slot.param.device:
                    part = part.to(slot.param.device)
                slot.param.grad = shaped(part, slot.param.detach())
                offset += slot.numel

    def global_sum_of_squares(self, local: float) -> float:
        """The squared global gradient norm from this rank's owned part (every rank calls it)."""
        return self.comm.sum_over_ranks(local, "the global gradient norm")

    def after_updates(self, engine) -> None:
        """Waits for this rank's updates, then every updated weight goes from its owner to all ranks.
        A failed host update is raised after the broadcast, so the other ranks are not left waiting."""
        failure = None
        try:
            engine.synchronize()
        except Exception as error:  # UpdateFailed: the weight stays as it was, on every rank alike
            failure = error
        self.share_weights(self._updated)
        self._updated = []
        self.steps += 1
        if failure is not None:
            raise failure

    def share_weights(self, slots: list, source: int | None = None) -> None:
        """Copies each slot's weight from its owner (or from rank `source`) to every rank; every rank
        passes the same `slots`."""
        pending = []
        for bucket in self._buckets(slots, source):
            buf = self._buffer(bucket, slots)
            if bucket.owner == self.rank:
                offset = 0
                for i in bucket.items:
                    s = slots[i]
                    buf[offset:offset + s.numel].copy_(flat(s.param.detach()))
                    offset += s.numel
            pending.append((bucket, buf, self.comm.broadcast_async(buf, bucket.owner)))
        with torch.no_grad():
            for bucket, buf, work in pending:
                self.comm.wait(work, f"the broadcast of rank {bucket.owner}'s updated weights")
                if bucket.owner == self.rank:
                    continue
                offset = 0
                for i in bucket.items:
                    s = slots[i]
                    flat(s.param.data).copy_(buf[offset:offset + s.numel])
                    offset += s.numel

    # ---- checkpoints ------------------------------------------------------------------------

    def gather_state(self, local: dict) -> dict:
        """The full optimizer state (every rank's owned entries, by parameter index) on every rank."""
        merged: dict = {}
        for part in self.comm.all_gather_objects(local, "gathering the optimizer state for state_dict()"):
            merged.update(part)
        return dict(sorted(merged.items()))

    def report(self) -> dict:
        """What memory_report(model)["distributed"] shows: world, rank, ownership and traffic (bytes)."""
        trained = [s for s in self.slots if s.param.requires_grad]
        owned = [s for s in trained if s.owned]
        return {"world": self.world, "rank": self.rank, "backend": self.comm.backend, "transport": self.comm.transport,
                "owned_params": len(owned), "owned_values": sum(s.numel for s in owned),
                "trained_params": len(trained), "trained_values": sum(s.numel for s in trained),
                "bucket_bytes": self.bucket_bytes, "steps": self.steps, "collectives": self.comm.calls,
                "collective_bytes": self.comm.bytes, "timeout_s": self.comm.timeout}
