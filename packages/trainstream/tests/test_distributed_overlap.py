"""Property tests of the reductions started during backward, in one process with a recording fake
of the collectives: whatever gradients a rank's backward produces, it issues a prefix of the one
launch order during backward and the rest at step(), so every rank issues the same sequence, with the
buckets step() would reduce (the spawned-rank tests are in test_distributed.py)."""

from __future__ import annotations

import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream.distributed import DataParallel
from trainstream.distributed.overlap import EagerReductions, launch_order
from trainstream.distributed.sharding import Piece


class _Comm:
    rank, world, device = 0, 2, torch.device("cpu")

    def __init__(self):
        self.issued = []

    def reduce_async(self, buf, owner):
        self.issued.append((owner, buf.clone()))
        return None


def _plan(sizes, owners, bucket_bytes):
    """Parameters of `sizes`; `owners[i]`: the owner of parameter i's values, or of its two halves (a pair)."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    slots = [types.SimpleNamespace(param=p, numel=p.numel(), index=i, owned=False) for i, p in enumerate(params)]
    pieces = []
    for i, (n, owner) in enumerate(zip(sizes, owners)):
        if isinstance(owner, tuple) and n > 1:  # split between two ranks at its middle
            pieces.append([Piece(i, owner[0], 0, n // 2), Piece(i, owner[1], n // 2, n)])
        else:
            pieces.append([Piece(i, owner[0] if isinstance(owner, tuple) else owner, 0, n)])
    dp = DataParallel.__new__(DataParallel)  # only what the plan reads: pieces, buckets, buffers, comm
    dp.comm, dp.slots, dp.pieces, dp.bucket_bytes = _Comm(), slots, pieces, bucket_bytes
    return dp, slots, EagerReductions(dp, slots, accumulation_steps=2, engine=None)


owner_st = st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2)).filter(lambda t: t[0] != t[1]))
model_st = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 40), min_size=n, max_size=n), st.lists(owner_st, min_size=n, max_size=n),
    st.integers(4, 400), st.lists(st.booleans(), min_size=n, max_size=n)))


@settings(max_examples=150, deadline=None)
@given(model_st)
def test_every_rank_issues_the_whole_launch_order_whatever_its_backward_produced(model):
    sizes, owners, bucket_bytes, used = model
    dp, slots, eager = _plan(sizes, owners, bucket_bytes)
    eager._engine = lambda: types.SimpleNamespace()  # an engine that is not closed
    assert eager.buckets == dp._buckets(dp.pieces_of(slots))  # the buckets step() builds without overlap
    assert sorted(eager.order) == list(range(len(eager.buckets)))
    weights = [torch.arange(1.0, n + 1) for n in sizes]
    for micro in range(2):  # the window: the second backward makes the gradients final
        terms = [(s.param * w).sum() for s, w, u in zip(slots, weights, used) if u]
        if terms:
            sum(terms).backward()
        if micro == 0:
            assert dp.comm.issued == []  # nothing before the window's last backward
    pieces = eager.pieces
    complete = [all(used[pieces[i].item] for i in eager.buckets[b].items) for b in eager.order]
    prefix = complete.index(False) if False in complete else len(complete)
    assert eager.in_backward == prefix  # started in order, as soon as every bucket before is final
    eager.finish()
    assert eager.in_backward + eager.at_step == len(eager.order)
    assert [owner for owner, _ in dp.comm.issued] == [eager.buckets[b].owner for b in eager.order]
    for (_, buf), b in zip(dp.comm.issued, eager.order):
        expected = [2 * weights[p.item][p.lo:p.hi] if used[p.item] else torch.zeros(p.numel)
                    for p in (pieces[i] for i in eager.buckets[b].items)]
        assert torch.equal(buf, torch.cat(expected))  # the gradient, zeros where there is none
    assert eager.problems([*slots]) == 0
    if any(used):
        i = used.index(True)
        slots[i].param.grad.mul_(2)  # changed after it was copied
        assert eager.problems([*slots]) == 1
    assert eager.problems(slots[:-1]) >= 1  # the trained parameters are not the plan's
    eager.close()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=30).map(lambda xs: sorted(set(xs))))
def test_the_launch_order_is_the_order_reverse_arrival_completes_the_buckets(firsts):
    buckets = [types.SimpleNamespace(items=(f,)) for f in firsts]
    order = launch_order(buckets)
    assert [buckets[b].items[0] for b in order] == sorted(firsts, reverse=True)
