"""Across packages: wrap() draws its state from ts-pinned's arena, and the main job runs as a command."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import torch
import trainstream
import ts_pinned


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def test_optimizer_state_lives_in_the_pinned_arena():
    gc.collect()  # an earlier test's unwrapped session (a reference cycle) must not be freed during this wrap
    before = ts_pinned.pinned_stats()["by_tag"]
    model, opt = trainstream.wrap(_model(), lr=1e-2)
    values = sum(p.numel() for p in model.parameters())
    grown = ts_pinned.pinned_stats()["by_tag"]
    assert grown.get("master", 0) - before.get("master", 0) == values * 4
    assert grown.get("moments", 0) - before.get("moments", 0) == values * 8
    x = torch.randn(16, 32)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    report = trainstream.memory_report(model)
    assert report["pinned_by_tag"] == ts_pinned.pinned_stats()["by_tag"]
    trainstream.unwrap(model)


def test_unwrap_keeps_training_state_equal_to_the_weights():
    model, opt = trainstream.wrap(_model(), lr=1e-2, moment_dtype="bfloat16")
    x = torch.randn(16, 32)
    for _ in range(4):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    masters = [s["master_param"] for s in opt.state_dict()["state"].values()]
    plain = trainstream.unwrap(model)
    for master, p in zip(masters, plain.parameters()):
        assert torch.equal(master, p.detach())


def test_main_job_runs_as_a_command(tmp_path):
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "trainstream.cli", "--steps", "5", "--seq", "64", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "memory report" in done.stdout
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 5 and all(loss == loss for loss in result["losses"])
