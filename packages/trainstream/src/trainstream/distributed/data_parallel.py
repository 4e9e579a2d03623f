"""DataParallel: the update engine's step hook for a process group of several ranks.

Gradients accumulate locally in ``param.grad`` over the window's backward passes (no communication).
During the backward that completes the window (the last of ``accumulation_steps``), each bucket's
reduction to its owner starts as soon as its gradients are final (``overlap.EagerReductions``;
armed from the second step on, once a step showed every trained parameter with a gradient on
every rank). At ``step()`` the engine calls, in this order on every rank:

1. ``before_step``: the buckets not started yet are started; which trained parameters have a
   gradient on any rank (one all-reduce of flags, with the count of changes that make the started
   reductions unusable); then either the started reductions are used, or (a parameter with no
   gradient anywhere, a gradient edited after it was copied) they are dropped and each bucket is
   reduced now, as without overlap. Either way each bucket is summed into its owner and averaged;
   the owner finds the global gradient in ``param.grad``, every other rank finds none.
2. the engine's own updates of the slots this rank owns; with ``max_grad_norm`` the norm comes
   from ``global_sum_of_squares`` (every rank's owned sum of squares, all-reduced).
3. ``after_updates``: every owned update applied, then each bucket's new weights are broadcast
   from its owner.

So the ranks train exactly as one process on the global batch (the same buckets, sums and division
with or without overlap), and only the owner of a parameter keeps its fp32 master and moments (the
others' slots stay DORMANT).
"""

from __future__ import annotations

import torch

from ..engine.slots import flat, grad_in_memory_order, shaped
from .collectives import Comm, DistributedError
from .overlap import EagerReductions
from .sharding import Bucket, make_buckets

__all__ = ["DataParallel"]


class DataParallel:
    """Ownership, buckets and the step's collectives for one wrapped model (see the module docstring).
    ``overlap`` (the same on every rank): False reduces every gradient at step() only."""

    def __init__(self, comm: Comm, slots: list, owners: list[int], bucket_bytes: int, *, overlap: bool = True,
                 events=None):
        self.comm = comm
        self.slots = slots
        self.owners = owners  # by slot position (== slot.index)
        self.bucket_bytes = int(bucket_bytes)
        for slot, owner in zip(slots, owners):
            slot.owned = owner == comm.rank
        self._updated: list = []
        self.steps = 0
        self.overlap = bool(overlap)
        self.events = events
        self._eager: EagerReductions | None = None  # armed: the plan whose reductions start in backward
        self._rearm_at = 0  # the first step that may arm again (after reductions were dropped)
        self._dropped_streak = 0
        # Counters since wrap(), and the last step's (report()).
        self.overlap_counts = {"buckets_in_backward": 0, "buckets_at_step": 0, "dropped_steps": 0}
        self.last_step = {"overlapped": False, "buckets_in_backward": 0, "buckets_at_step": 0, "dropped": False}

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

    def _event(self, message: str) -> None:
        if self.events is not None:
            self.events.add("distributed", message)

    # ---- the step ------------------------------------------------------------------------

    def before_step(self, engine) -> None:
        """Every trained gradient averaged over the ranks, in its owner's ``param.grad`` only."""
        trained = [s for s in self.slots if s.param.requires_grad]
        eager = self._eager
        problems = 0
        if eager is not None:
            eager.finish()
            problems = eager.problems(trained)
        # The count of training forwards rides along, with its square: their sums are world x n and
        # world x n^2 on every rank exactly when every rank ran n (equality in Cauchy-Schwarz). A rank that
        # skipped a step() has run a window's forwards more when its next step pairs with the others'.
        forwards = engine.training_forwards
        flags = torch.tensor([s.param.grad is not None for s in trained] + [problems, forwards, forwards ** 2],
                             dtype=torch.int64, device=self.comm.device)
        if trained or eager is not None:
            self.comm.all_reduce(flags, "the exchange of which parameters have gradients")
            self._check_same_step(forwards, int(flags[-2]), int(flags[-1]))
        counts = flags.tolist()[:-2]
        problems = counts.pop()
        with_grad = [s for s, f in zip(trained, counts) if f > 0]
        self._updated = with_grad
        everywhere = all(f == self.world for f in counts)  # every trained parameter, every rank
        done = None
        if eager is not None:
            finished = eager.wait()
            usable = problems == 0 and len(with_grad) == len(eager.slots)
            self._count(eager, usable)
            if usable:
                done = finished
                for slot in with_grad:
                    slot.param.grad = None  # the buckets hold them now
            else:
                why = (f"{problems} gradient(s) changed or replaced after they were copied, or the trained "
                       f"parameters changed" if problems else "a parameter had no gradient on any rank")
                self._disarm(why, stale=problems > 0)
        else:
            self.last_step = {"overlapped": False, "buckets_in_backward": 0, "buckets_at_step": 0, "dropped": False}
        if done is None:
            done = self._reduce_now(with_grad)
        self._distribute(done, with_grad)
        if self._eager is not None and not self.overlap:
            self._eager.close()  # switched off (on every rank alike)
            self._eager = None
        if self._eager is not None:
            self._eager.reset()
        elif self.overlap and everywhere and trained and self.steps >= self._rearm_at:
            self._eager = EagerReductions(self, trained, getattr(engine, "accumulation_steps", 1), engine)

    def _count(self, eager: EagerReductions, usable: bool) -> None:
        self.overlap_counts["buckets_in_backward"] += eager.in_backward
        self.overlap_counts["buckets_at_step"] += eager.at_step
        self.overlap_counts["dropped_steps"] += not usable
        self.last_step = {"overlapped": usable, "buckets_in_backward": eager.in_backward,
                          "buckets_at_step": eager.at_step, "dropped": not usable}
        if usable:
            self._dropped_streak = 0

    def _disarm(self, why: str, stale: bool) -> None:
        """No reductions in backward from now on; after gradients changed behind the copies, not for
        2, 4, 8 ... steps (the same on every rank: decided from all-reduced values)."""
        self._eager.close()
        self._eager = None
        wait = 1
        if stale:
            self._dropped_streak += 1
            wait = 2 ** min(self._dropped_streak, 10)
        self._rearm_at = self.steps + wait
        self._event(f"step {self.steps}: the gradient reductions started during backward were dropped and redone at "
                    f"step() ({why}); they start during backward again after a step where every trained "
                    f"parameter has a gradient on every rank" + (f", in {wait} steps at the earliest" if stale else ""))

    def _reduce_now(self, with_grad: list) -> list[tuple[Bucket, torch.Tensor]]:
        """Every bucket of `with_grad` copied and reduced at step(): the path without overlap."""
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
        done = []
        for bucket, buf, work in pending:
            self.comm.wait(work, f"the reduction of gradients to rank {bucket.owner}")
            done.append((bucket, buf))
        return done

    def _distribute(self, done: list[tuple[Bucket, torch.Tensor]], with_grad: list) -> None:
        """The owner's reduced buckets averaged and seen as its parameters' gradients."""
        for bucket, buf in done:
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

    def discard(self) -> None:
        """zero_grad() (the engine's discard()): the window's gradient count starts again. Local, no collective."""
        if self._eager is not None:
            self._eager.restart_window()

    def _check_same_step(self, forwards: int, total: int, squares: int) -> None:
        """DistributedError, on every rank alike, when the ranks ran different numbers of training forwards
        before this step(): one skipped a step() (an exception caught around it, a condition true on one rank
        only), so its collectives now pair with another step's."""
        if total == self.world * forwards and squares == self.world * forwards ** 2:
            return
        counts = self.comm.all_gather_objects([self.steps, forwards], "the exchange of the ranks' step counts")
        where = ", ".join(f"rank {r} at step {s + 1} after {f} training forwards" for r, (s, f) in enumerate(counts))
        why = (f"the ranks' steps do not match ({where}): a rank skipped step() (an exception caught around it, or "
               f"a condition true on one rank only), so its collectives would pair with another step's. Every "
               f"rank must run the same forwards and call step() once per window")
        self.comm._fail(why)
        raise DistributedError(why)

    def close(self) -> None:
        """Unwrap: the reductions in flight waited for and dropped, the hooks removed, the group of a
        dedicated Comm destroyed (every rank)."""
        eager, self._eager = self._eager, None
        try:
            if eager is not None and eager.launched and self.comm.failure is None:
                eager.finish()  # between backward and step(): every rank completes the plan, as at step()
                eager.wait()
        finally:
            try:
                if eager is not None:
                    eager.close()
            finally:
                self.comm.close()

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
                "collective_bytes": self.comm.bytes, "timeout_s": self.comm.timeout,
                "overlap": {"enabled": self.overlap, "armed": self._eager is not None, **self.overlap_counts,
                            "last_step": dict(self.last_step)}}
