"""plan_residency: budgets respected, monotone in VRAM, streamed blocks spread, refusals with numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_planner import Block, plan_residency

sizes = st.lists(st.integers(0, 1000), min_size=1, max_size=48)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes, small=st.integers(0, 20_000), extra=st.integers(0, 20_000))
def test_more_vram_never_streams_more(sizes, small, extra):
    blocks = [Block(s) for s in sizes]
    tight = plan_residency(blocks, small, 10**9)
    roomy = plan_residency(blocks, small + extra, 10**9)
    assert set(roomy.streamed) <= set(tight.streamed)
    for plan, budget in ((tight, small), (roomy, small + extra)):
        assert plan.resident_bytes <= budget
        assert sorted(plan.resident + plan.streamed) == list(range(len(blocks)))
        assert plan.resident_bytes + plan.streamed_bytes == sum(sizes)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 96), per_block=st.integers(1, 10**6), data=st.data())
def test_equal_blocks_stream_spread_through_the_stack(n, per_block, data):
    resident_count = data.draw(st.integers((n + 1) // 2, n))
    plan = plan_residency([Block(per_block)] * n, resident_count * per_block, 10**12)
    assert len(plan.resident) == resident_count
    # Streaming at most half the stack, no two streamed blocks are neighbours: each streamed
    # block's copy has a resident block's compute beside it to hide behind.
    assert all(b - a > 1 for a, b in zip(plan.streamed, plan.streamed[1:]))


def test_everything_fits():
    plan = plan_residency([Block(10, trained=True)] * 4, 40, 0)
    assert plan.streamed == () and plan.link_bytes_per_step == 0
    assert plan.reason == "every block fits in VRAM"
    assert plan.link_seconds(50.0) == 0.0


def test_link_bytes_count_trained_gradients():
    plan = plan_residency([Block(100), Block(100, trained=True), Block(100)], 100, 10**6)
    frozen_streamed = [i for i in plan.streamed if i != 1]
    expected = 200 * len(frozen_streamed) + (300 if 1 in plan.streamed else 0)
    assert plan.link_bytes_per_step == expected
    assert plan.link_seconds(1.0) == pytest.approx(expected / 1e9)


def test_host_ram_too_small_is_refused_with_numbers():
    with pytest.raises(MemoryError, match=r"must stream from host RAM but only"):
        plan_residency([Block(2**30)] * 4, 2**30, 2**30)


@pytest.mark.parametrize(
    ("blocks", "vram", "host", "message"),
    [
        ([], 1, 1, "at least one block"),
        ([Block(1)], -1, 1, "budgets must be >= 0"),
        ([Block(-5)], 1, 1, "weight_bytes >= 0"),
        ([3], 1, 1, "must be a Block"),
    ],
)
def test_bad_input(blocks, vram, host, message):
    with pytest.raises(ValueError, match=message):
        plan_residency(blocks, vram, host)
