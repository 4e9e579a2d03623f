"""attention='auto''s choice among measured timings: near ties and the agreement of data-parallel ranks
(the measuring itself is in test_attention.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from test_attention import _PROPERTY, FLASH, MATH, Attention, _grads, fake_timer
from trainstream.attention import AttentionChooser, _measure


@_PROPERTY
@given(first_ms=st.floats(0.5, 2.0), ratio=st.one_of(st.floats(0.8, 0.9), st.floats(0.96, 0.999)))
def test_a_near_tie_goes_to_the_backend_pytorch_tries_first(first_ms, ratio):
    """Timings within 5% of the fastest are noise: the choice must not flip between runs."""
    order = [_measure.name_of(b) for b in _measure.priority_order() if b in (FLASH, MATH)]
    table = {order[0]: first_ms, order[1]: first_ms * ratio}
    chooser = AttentionChooser("auto", timer=fake_timer(table))
    model = Attention()
    chooser.install(model)
    _grads(model, torch.randn(1, 8, 32))
    report = chooser.report()
    (label,) = report["timings_ms"]
    # the second backend is either clearly faster (the measurement decides) or within 4% (a tie)
    expected = order[1] if ratio <= 0.9 else order[0]
    assert report["chosen"][label] == expected == report["backend"]  # the report and the pin that ran


def test_ranks_adopting_each_others_timings_pin_the_same_kernel():
    """Data parallel: rank 0 measures flash faster, rank 1 math; after adopt() with both ranks' timings
    (their mean: flash 2.0, math 1.5 ms) both pin math, and a forward runs it on both."""
    choosers, models = [], []
    for table in ({"flash": 1.0, "math": 2.0}, {"flash": 3.0, "math": 1.0}):
        chooser = AttentionChooser("auto", timer=fake_timer(table))
        model = Attention()
        chooser.install(model)
        _grads(model, torch.randn(1, 8, 32))
        choosers.append(chooser)
        models.append(model)
    assert [c.report()["backend"] for c in choosers] == ["flash", "math"]  # each alone
    everyone = [c.timings_to_share() for c in choosers]
    assert [c.adopt(everyone) for c in choosers] == [1, 0]
    for chooser, model in zip(choosers, models):
        (label,) = chooser.report()["timings_ms"]
        assert chooser.report()["timings_ms"][label] == {"flash": 2.0, "math": 1.5}
        _grads(model, torch.randn(1, 8, 32))  # the same signature: the adopted pin runs
        assert chooser.report()["chosen"][label] == chooser.report()["backend"] == "math"
    assert AttentionChooser("default").adopt(everyone) == 0
