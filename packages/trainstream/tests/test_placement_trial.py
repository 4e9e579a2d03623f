"""MappedTrial, offload='auto''s measurement of mapped CUDA AdamW against host AdamW: when it switches,
what it decides, and that it never acts again once done."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trainstream.engine.placement_trial import MappedTrial


def test_a_faster_mapped_placement_is_kept_and_a_slower_one_reverted():
    fast = MappedTrial(steps=2)
    actions = [fast.record(p) for p in (9.0, 1.0, 1.0, 7.0, 0.5, 0.5)]
    assert actions == [None, None, "switch", None, None, "keep"]
    slow = MappedTrial(steps=2)
    assert [slow.record(p) for p in (9.0, 1.0, 1.0, 7.0, 0.99, 0.99)][-1] == "revert"  # within the 3 % margin
    assert "mapped against" in fast.summary()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        MappedTrial(steps=0)
    with pytest.raises(ValueError):
        MappedTrial(margin=1.0)


@given(steps=st.integers(1, 4), margin=st.floats(0.0, 0.5),
       periods=st.lists(st.floats(1e-3, 10.0), min_size=12, max_size=20))
def test_one_switch_then_one_decision_from_the_medians_then_nothing(steps, margin, periods):
    trial = MappedTrial(steps=steps, margin=margin)
    actions = [trial.record(p) for p in periods]
    switch_at = 1 + steps - 1  # one skipped period, then `steps` measured on host
    decide_at = switch_at + 1 + steps  # one warm-up period skipped, then `steps` on mapped
    assert actions[switch_at] == "switch"
    host = periods[1:1 + steps]
    mapped = periods[switch_at + 2:decide_at + 1]
    expected = "keep" if statistics.median(mapped) < statistics.median(host) * (1 - margin) else "revert"
    assert actions[decide_at] == expected
    assert all(a is None for i, a in enumerate(actions) if i not in (switch_at, decide_at))
