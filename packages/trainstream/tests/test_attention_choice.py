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


def test_attention_bench_table_takes_the_median_over_interleaved_runs():
    """tools/bench/attention_choice.py --repeat: each run's step in its cell, the ratio from the medians of runs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "tools" / "bench" / "attention_choice.py"
    spec = importlib.util.spec_from_file_location("attention_choice_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(mode, median, backend=None):
        return {"scenario": "lora14b", "shape": "1x512", "mode": mode, "outcome": "ok", "median_s": median,
                "peak_gb": None, "attention": {"backend": backend} if backend else None}

    results = [run("default", 0.30), run("auto", 0.20, "cudnn"), run("default", 0.26), run("auto", 0.40, "flash"),
               run("default", 0.28), run("auto", 0.21, "cudnn")]
    row = bench.table(results, ["default", "auto"]).splitlines()[-1]
    assert "0.300 s / 0.260 s / 0.280 s" in row and "0.200 s / 0.400 s / 0.210 s" in row
    assert "| cudnn/flash |" in row and row.endswith(f"| {0.28 / 0.21:.3f}x |")
