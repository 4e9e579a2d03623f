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
   the owner finds the global gradient in ``param.grad``, every other rank finds none. (A parameter
   split between ranks: each owner finds its piece's values there, zeros elsewhere; its slot's span takes
   only its piece: engine/slots.py, invariant 8b.)
2. the engine's own updates of the slots this rank owns; with ``max_grad_norm`` the norm comes
   from ``global_sum_of_squares`` (every rank's owned sum of squares, all-reduced).
3. ``after_updates``: every owned update applied, then each bucket's new weights are broadcast
   from its owner.

Ownership is by values (``sharding.split_evenly``): each rank keeps 1/world of the trained values'
state, the pieces of a split parameter included. Buckets hold pieces of one owner and one dtype.

So the ranks train exactly as one process on the global batch (the same buckets, sums and division
with or without overlap), and only the owner of a parameter keeps its fp32 master and moments (the
others' slots stay DORMANT).
"""

from __future__ import annotations

import torch

from ..engine.slots import SlotState, flat, grad_in_memory_order, shaped
from .collectives import Comm, DistributedError
from .overlap import EagerReductions
from .sharding import Bucket, Piece, make_buckets

__all__ = ["DataParallel"]


class DataParallel:
    """Ownership, buckets and the step's collectives for one wrapped model (see the module docstring).
    ``overlap`` (the same on every rank): False reduces every gradient at step() only."""

    def __init__(self, comm: Comm, slots: list, pieces: list[list[Piece]], bucket_bytes: int, *,
                 overlap: bool = True, events=None):
        self.comm = comm
        self.slots = slots
        self.pieces = pieces  # by slot position (== slot.index): who owns which of its values
        self.bucket_bytes = int(bucket_bytes)
        for slot, mine in zip(slots, pieces):
            own = [p for p in mine if p.owner == comm.rank]
            if len(own) > 1:
                raise AssertionError(f"{slot.label}: rank {comm.rank} owns {len(own)} pieces of it; split_evenly gives one")
            slot.owned = bool(own)
            whole = not own or own[0].numel == slot.param.numel()
            slot.span = None if whole else (own[0].lo, own[0].hi)
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

    def pieces_of(self, slots: list, source: int | None = None) -> list[Piece]:
        """The pieces of `slots`, in their order (each slot whole, owned by rank `source`, if given)."""
        if source is not None:
            return [Piece(s.index, source, 0, s.param.numel()) for s in slots]
        return [piece for s in slots for piece in self.pieces[s.index]]

    def _buckets(self, pieces: list[Piece]) -> list[Bucket]:
        params = [self.slots[p.item].param for p in pieces]
        return make_buckets([p.owner for p in pieces], [p.numel * t.element_size() for p, t in zip(pieces, params)],
                            [t.dtype for t in params], self.bucket_bytes)

    def _buffer(self, bucket: Bucket, pieces: list[Piece]) -> torch.Tensor:
        return torch.empty(sum(pieces[i].numel for i in bucket.items), dtype=bucket.dtype, device=self.comm.device)

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
        pieces = self.pieces_of(with_grad)
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
            done = self._reduce_now(with_grad, pieces)
        self._distribute(done, pieces)
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

    def _reduce_now(self, with_grad: list, pieces: list[Piece]) -> list[tuple[Bucket, torch.Tensor]]:
        """Every bucket of `with_grad`'s pieces copied and reduced at step(): the path without overlap."""
        grads = {s.index: None if s.param.grad is None else grad_in_memory_order(s.param.grad.detach(), s.param)
                 for s in with_grad}
        left = {s.index: len(self.pieces[s.index]) for s in with_grad}  # pieces not copied yet
        pending = []
        for bucket in self._buckets(pieces):
            buf = self._buffer(bucket, pieces)
            offset = 0
            for i in bucket.items:
                piece = pieces[i]
                part = buf[offset:offset + piece.numel]
                grad = grads[piece.item]
                if grad is None:
                    part.zero_()  # no gradient on this rank: its share of the global batch contributes 0
                else:
                    part.copy_(grad[piece.lo:piece.hi])
                left[piece.item] -= 1
                if left[piece.item] == 0:  # every piece is in a bucket: the gradient's memory is free for the next
                    grads[piece.item] = self.slots[piece.item].param.grad = None
                offset += piece.numel
            pending.append((bucket, buf, self.comm.reduce_async(buf, bucket.owner)))
        done = []
        for bucket, buf, work in pending:
            self.comm.wait(work, f"the reduction of gradients to rank {bucket.owner}")
            done.append((bucket, buf))
        return done

    def _distribute(self, done: list[tuple[Bucket, torch.Tensor]], pieces: list[Piece]) -> None:
        """The owner's reduced buckets averaged and seen as its parameters' gradients: a parameter owned whole
        gets its gradient, one split between ranks a gradient holding its piece's values (zeros elsewhere)."""
        for bucket, buf in done:
            if bucket.owner != self.rank:
                continue
            buf.div_(self.world)
            offset = 0
            for i in bucket.items:
                piece = pieces[i]
                slot = self.slots[piece.item]
                part = buf[offset:offset + piece.numel]
                like = slot.param.detach()
                if part.device != like.device:
                    part = part.to(like.device)
                if slot.span is not None:
                    whole = torch.zeros(like.numel(), dtype=part.dtype, device=like.device)
                    whole[piece.lo:piece.hi] = part
                    part = whole
                slot.param.grad = shaped(part, like)
                offset += piece.numel

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
        """Copies each slot's values from their owners (or from rank `source`) to every rank; every rank
        passes the same `slots`. A slot split between ranks then holds the others' pieces too: what it sees
        of its weight is noted as its own write, not a user's edit (slots.py, invariant 4)."""
        pieces = self.pieces_of(slots, source)
        pending = []
        for bucket in self._buckets(pieces):
            buf = self._buffer(bucket, pieces)
            if bucket.owner == self.rank:
                offset = 0
                for i in bucket.items:
                    piece = pieces[i]
                    buf[offset:offset + piece.numel].copy_(flat(self.slots[piece.item].param.detach())[piece.lo:piece.hi])
                    offset += piece.numel
            pending.append((bucket, buf, self.comm.broadcast_async(buf, bucket.owner)))
        with torch.no_grad():
            for bucket, buf, work in pending:
                self.comm.wait(work, f"the broadcast of rank {bucket.owner}'s updated weights")
                if bucket.owner == self.rank:
                    continue
                offset = 0
                for i in bucket.items:
                    piece = pieces[i]
                    flat(self.slots[piece.item].param.data)[piece.lo:piece.hi].copy_(buf[offset:offset + piece.numel])
                    offset += piece.numel
        for slot in slots:
            if slot.span is not None and slot.state is not SlotState.DORMANT:
                slot.note_weight()

    # ---- checkpoints ------------------------------------------------------------------------

    def gather_state(self, local: dict) -> dict:
        """The full optimizer state (every rank's owned entries, by parameter index, the pieces of a split
        parameter joined) on every rank."""
        mine = {index: (self.slots[index].span, entry) for index, entry in local.items()}
        parts: dict = {}
        for rank_parts in self.comm.all_gather_objects(mine, "gathering the optimizer state for state_dict()"):
            for index, part in rank_parts.items():
                parts.setdefault(index, []).append(part)
        return {index: self._joined(index, parts[index]) for index in sorted(parts)}

    def _joined(self, index: int, parts: list) -> dict:
        """One parameter's state entry from its owners' (span, entry) parts."""
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        like = self.slots[index].param.detach()
        joined = dict(parts[0][1])
        for field, value in parts[0][1].items():
            if field == "step":
                continue
            whole = torch.empty(like.numel(), dtype=value.dtype)
            for (lo, hi), entry in parts:
                whole[lo:hi] = entry[field]
            joined[field] = shaped(whole, like).contiguous()
        return joined

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
