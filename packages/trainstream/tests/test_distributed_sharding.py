"""Property tests of data parallel's pure parts: who owns which values, how buckets group them,
and how a mismatch between ranks is described."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream.distributed import assign_owners, make_buckets
from trainstream.distributed.checks import first_mismatch
from trainstream.distributed.sharding import host_shares, split_evenly

sizes_st = st.lists(st.integers(0, 10**9), max_size=60)
worlds = st.integers(1, 9)


@settings(max_examples=120, deadline=None)
@given(sizes_st, worlds)
def test_every_item_is_owned_once_and_loads_are_balanced(sizes, world):
    owners = assign_owners(sizes, world)
    assert len(owners) == len(sizes)
    assert all(0 <= o < world for o in owners)
    loads = [0] * world
    for size, owner in zip(sizes, owners):
        loads[owner] += size
    assert sum(loads) == sum(sizes)  # each item counted exactly once
    # Greedy list scheduling: the last item placed on the fullest rank went to the least loaded one.
    assert max(loads) <= sum(sizes) / world + (max(sizes) if sizes else 0)
    if len(sizes) >= world and all(s > 0 for s in sizes):
        assert all(load > 0 for load in loads)  # no rank idle while another holds two items


@settings(max_examples=80, deadline=None)
@given(sizes_st, worlds)
def test_owners_are_deterministic_and_ignore_nothing_but_sizes(sizes, world):
    assert assign_owners(sizes, world) == assign_owners(list(sizes), world)
    assert assign_owners(tuple(sizes), world) == assign_owners(sizes, world)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.integers(2, 5))
def test_equal_sizes_split_evenly(sizes, world):
    same = [sizes[0]] * len(sizes)
    counts = [0] * world
    for owner in assign_owners(same, world):
        counts[owner] += 1
    assert max(counts) - min(counts) <= 1


@settings(max_examples=80, deadline=None)
@given(sizes_st, worlds, st.lists(st.integers(0, 10**6), min_size=9, max_size=9))
def test_initial_loads_are_topped_up(sizes, world, start):
    loads = start[:world]
    owners = assign_owners(sizes, world, loads)
    total = list(loads)
    for size, owner in zip(sizes, owners):
        total[owner] += size
    assert max(total) <= max(max(loads), (sum(loads) + sum(sizes)) / world + (max(sizes) if sizes else 0))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=40), worlds)
def test_the_values_are_split_evenly_and_each_is_owned_once(numels, world):
    pieces = split_evenly(numels, world)
    total = sum(numels)
    loads = [0] * world
    for item, (n, mine) in enumerate(zip(numels, pieces)):
        assert all(p.item == item and p.lo < p.hi for p in mine)
        if n:  # contiguous, in order, covering the item once
            assert mine[0].lo == 0 and mine[-1].hi == n and all(a.hi == b.lo for a, b in itertools.pairwise(mine))
        else:
            assert mine == []
        assert len({p.owner for p in mine}) == len(mine)  # a rank keeps one piece of an item at most
        for p in mine:
            loads[p.owner] += p.numel
    assert sum(loads) == total
    assert max(loads) - min(loads) <= 1 and max(loads) == -(-total // world)  # 1/world, to one value
    owners = [p.owner for mine in pieces for p in mine]
    assert owners == sorted(owners)  # rank r's values follow rank r-1's: one range of the items' order


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=12), st.integers(1, 5), st.data())
def test_host_shares_are_the_ranks_pieces_as_views(numels, world, data):
    params = [torch.randn(n) for n in numels]
    rank = data.draw(st.integers(0, world - 1))
    own, largest = host_shares(params, world, rank)
    mine = [p for pieces in split_evenly(numels, world) for p in pieces if p.owner == rank]
    assert [t.numel() for t in own] == [p.numel for p in mine]
    for t, p in zip(own, mine):
        assert torch.equal(t, params[p.item][p.lo:p.hi])
        if t.numel() == numels[p.item]:
            assert t is params[p.item]  # owned whole: the tensor itself
    assert sum(t.numel() for t in largest) == -(-sum(numels) // world)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="world=0"):
        assign_owners([1], 0)
    with pytest.raises(ValueError, match="loads has 1 entries"):
        assign_owners([1], 2, [0])
    with pytest.raises(ValueError, match="negative"):
        assign_owners([1, -1], 2)
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets([0], [1], ["f"], 0)
    with pytest.raises(ValueError, match="world=0"):
        split_evenly([1], 0)
    with pytest.raises(ValueError, match="negative"):
        split_evenly([1, -1], 2)


items_st = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5000), st.sampled_from(["f32", "bf16"])),
                    max_size=60)


@settings(max_examples=120, deadline=None)
@given(items_st, st.integers(1, 20000))
def test_buckets_cover_each_item_once_with_one_owner_and_dtype(items, limit):
    owners = [o for o, _, _ in items]
    nbytes = [n for _, n, _ in items]
    dtypes = [d for _, _, d in items]
    buckets = make_buckets(owners, nbytes, dtypes, limit)
    seen = sorted(i for b in buckets for i in b.items)
    assert seen == list(range(len(items)))
    for b in buckets:
        assert {owners[i] for i in b.items} == {b.owner}
        assert {dtypes[i] for i in b.items} == {b.dtype}
        assert b.nbytes == sum(nbytes[i] for i in b.items)
        assert b.nbytes <= limit or len(b.items) == 1
        assert list(b.items) == sorted(b.items)
    firsts = [b.items[0] for b in buckets]
    assert firsts == sorted(firsts)  # the same order on every rank: by first item
    assert make_buckets(owners, nbytes, dtypes, limit) == buckets


def test_first_mismatch_names_the_first_difference():
    a = ["settings x=1", "parameter 0 (w): float32 [2]", "parameter 1 (b): float32 [3]"]
    b = ["settings x=1", "parameter 0 (w): float32 [2]", "parameter 1 (b): float32 [4]"]
    assert first_mismatch([a, a, a]) is None
    problem = first_mismatch([a, a, b])
    assert "parameter 1 differs" in problem and "rank 2" in problem and "[4]" in problem
    assert "settings differ" in first_mismatch([a, ["settings x=2", *a[1:]]])
    assert "(nothing)" in first_mismatch([a, a[:2]])
