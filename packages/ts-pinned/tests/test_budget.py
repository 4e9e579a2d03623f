"""page_lock_budget: the probe the planner uses."""

from __future__ import annotations

import math
import resource

import pytest
import ts_pinned


def test_fields_are_consistent():
    b = ts_pinned.page_lock_budget()
    assert isinstance(b, ts_pinned.PageLockBudget)
    assert 0 < b.mem_available <= b.mem_total
    assert 0 < b.budget <= b.mem_available
    assert b.budget <= int(b.mem_available * 0.8) + 1
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert b.memlock_limit == (None if soft == resource.RLIM_INFINITY else soft)
    if b.memlock_limit is not None and b.memlock_limit >= 1 << 30:
        assert b.budget <= b.memlock_limit


@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
def test_fraction_scales_the_budget(fraction):
    b = ts_pinned.page_lock_budget(fraction)
    assert b.budget <= b.mem_available
    if b.memlock_limit is None or b.memlock_limit < 1 << 30:
        assert b.budget == int(b.mem_available * fraction)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.01, 2, math.nan, math.inf])
def test_fraction_validation(fraction):
    with pytest.raises(ValueError, match="fraction"):
        ts_pinned.page_lock_budget(fraction)


def test_budget_is_frozen():
    b = ts_pinned.page_lock_budget()
    with pytest.raises(AttributeError):
        b.budget = 1


def test_host_limits_message():
    from ts_pinned import _core

    text = _core.host_limits()
    assert "memlock limit" in text and "available" in text
