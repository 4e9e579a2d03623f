"""assign_blocks: within every rank's room, deterministic, leaves out only what fits nowhere."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_peer import assign_blocks, split_free_vram

sizes = st.lists(st.integers(0, 10_000), max_size=40)
rooms = st.lists(st.integers(0, 60_000), max_size=6)


def _used(owners, block_bytes, world):
    used = [0] * world
    for owner, n in zip(owners, block_bytes):
        if owner is not None:
            used[owner] += n
    return used


@settings(max_examples=300, deadline=None)
@given(block_bytes=sizes, free=rooms)
def test_every_rank_stays_within_its_free_vram(block_bytes, free):
    owners = assign_blocks(block_bytes, free)
    assert len(owners) == len(block_bytes)
    assert all(o is None or 0 <= o < len(free) for o in owners)
    assert all(u <= f for u, f in zip(_used(owners, block_bytes, len(free)), free))


@settings(max_examples=300, deadline=None)
@given(block_bytes=sizes, free=rooms)
def test_a_block_left_on_the_host_fits_in_no_rank_at_the_end(block_bytes, free):
    owners = assign_blocks(block_bytes, free)
    left = [f - u for f, u in zip(free, _used(owners, block_bytes, len(free)))]
    for owner, n in zip(owners, block_bytes):
        if owner is None:
            assert all(n > room for room in left)


@settings(max_examples=200, deadline=None)
@given(block_bytes=sizes, free=rooms)
def test_deterministic_and_independent_of_the_input_containers(block_bytes, free):
    assert assign_blocks(block_bytes, free) == assign_blocks(tuple(block_bytes), list(free))


@settings(max_examples=200, deadline=None)
@given(block_bytes=sizes, world=st.integers(1, 6))
def test_everything_is_placed_when_one_rank_could_hold_it_all(block_bytes, world):
    owners = assign_blocks(block_bytes, [sum(block_bytes)] * world)
    assert None not in owners


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 40), size=st.integers(1, 1000), world=st.integers(1, 6))
def test_equal_blocks_and_ranks_are_spread_evenly(n, size, world):
    owners = assign_blocks([size] * n, [n * size] * world)
    counts = [owners.count(r) for r in range(world)]
    assert max(counts) - min(counts) <= 1


def test_small_example():
    # 70 to rank 0 (most room, lower rank wins ties), 50 to rank 1, 40 to rank 1, 200 nowhere.
    assert assign_blocks([50, 200, 70, 40], [100, 100]) == [1, None, 0, 1]
    assert assign_blocks([5, 6], []) == [None, None]


@pytest.mark.parametrize("args, match", [
    (([-1], [10]), r"block_bytes\[0\]=-1"),
    (([1.5], [10]), r"block_bytes\[0\]=1.5"),
    (([True], [10]), r"block_bytes\[0\]=True"),
    (([1], [10, -2]), r"free_vram_per_rank\[1\]=-2"),
])
def test_bad_input_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        assign_blocks(*args)


@settings(max_examples=200, deadline=None)
@given(ranks=st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 10**12)), min_size=1, max_size=8),
       fraction=st.floats(0, 1))
def test_ranks_sharing_a_gpu_split_its_free_memory(ranks, fraction):
    gpus, free = [g for g, _ in ranks], [f for _, f in ranks]
    budgets = split_free_vram(gpus, free, fraction)
    for g in set(gpus):
        mine = [b for gg, b in zip(gpus, budgets) if gg == g]
        assert len(set(mine)) == 1  # an even split
        assert sum(mine) <= min(f for gg, f in zip(gpus, free) if gg == g) * fraction  # counted once


def test_split_free_vram_example_and_bad_input():
    assert split_free_vram(["a", "a", "b"], [100, 90, 50], 0.5) == [22, 22, 25]
    with pytest.raises(ValueError, match="one per rank"):
        split_free_vram(["a"], [1, 2])
    with pytest.raises(ValueError, match=r"fraction=1\.5"):
        split_free_vram(["a"], [1], 1.5)
