"""The README's main job: `trainstream` with no arguments trains the built-in decoder."""

from __future__ import annotations

import json

from trainstream import cli
from trainstream._demo_text import byte_batches


def test_default_run_trains_and_reports(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["--steps", "12", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "optimizer_mode='cpu'" in printed.out  # the plan is printed before training
    assert "memory report" in printed.out
    assert "step   12/12" in printed.err  # the progress bar reached the end
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 12
    assert result["losses"][-1] < result["losses"][0]
    assert result["report"]["optimizer"]["steps"] == 12


def test_byte_batches_are_reproducible_and_in_range():
    a = list(byte_batches(3, 40, 4, seed=5))
    b = list(byte_batches(3, 40, 4, seed=5))
    assert all((x == y).all() for x, y in zip(a, b))
    assert all(x.shape == (3, 40) and int(x.max()) < 256 for x in a)
