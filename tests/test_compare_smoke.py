"""tools/bench/compare.py end to end on the CPU: every engine path that can run here runs a tiny scenario, so a
wiring error fails CI, not a GPU session; the others end with their precise reason, never "not wired"."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"
sys.path.insert(0, str(BENCH))
import render  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _compare(tmp_path, scenario: str, engines: list[str], rounds: int) -> dict:
    out = tmp_path / f"compare-{scenario}.json"
    env = {k: v for k, v in os.environ.items() if k != "TS_BENCH_REFERENCE_PREFIX"}
    done = subprocess.run([sys.executable, str(BENCH / "compare.py"), "--scenario", scenario, "--rounds", str(rounds),
                           "--steps", "4", "--timeout", "240", "--engines", *engines, "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def _expected_outcome(engine: str) -> str:
    """What a CPU-only machine without the external packages reports for `engine`."""
    if engine.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    if engine == "reference-0.4.1":
        return "the reference 0.4.1 is not installed"
    if engine == "trainstream-gpu":
        return "wrap() raised ValueError: optimizer_mode='gpu' needs a CUDA device"
    return "ok"


def test_every_full_fine_tune_engine_runs_or_says_why(tmp_path):
    engines = ["stock-bf16", "stock-mixed", "stock-bf16-uncapped", "trainstream-cpu", "trainstream-gpu",
               "trainstream-auto", "trainstream-cpu-noguard", "deepspeed-zero2", "deepspeed-zero3", "reference-0.4.1"]
    data = _compare(tmp_path, "tiny", engines, rounds=1)
    assert list(data["engines"]) == engines
    for engine in engines:
        (run,) = data["engines"][engine]["runs"]
        assert str(run["outcome"]).startswith(_expected_outcome(engine)), (engine, run["outcome"])
        if run["outcome"] == "ok":
            assert run["median_s"] > 0 and run["window"]["kept"] == [2, 3]
            assert len(run["losses"]) == 4 and all(loss == loss for loss in run["losses"])
    for engine in ("trainstream-cpu", "trainstream-auto"):  # each TrainStream run beside its bound
        assert data["bounds"][engine]["value"] > 0
        assert set(data["bounds"][engine]["terms"]) >= {"compute_fwd_bwd", "dequantize", "link", "host_adamw"}
    assert data["floors"] == ["stock-bf16-uncapped"]
    text = render.sections(str(tmp_path))["compare"]
    for engine in engines:
        assert f"| {engine}" in text


def test_lora_engines_alternate_in_rounds(tmp_path):
    engines = ["stock-lora", "trainstream-lora", "trainstream-lora-bf16", "bnb-qlora", "unsloth"]
    data = _compare(tmp_path, "lora_tiny", engines, rounds=2)
    assert data["order"] == engines * 2
    assert [r["engine"] for r in data["results"]] == engines * 2
    for engine in ("stock-lora", "trainstream-lora", "trainstream-lora-bf16"):
        runs = data["engines"][engine]["runs"]
        assert [r["round"] for r in runs] == [0, 1] and all(r["outcome"] == "ok" for r in runs), runs
        assert data["engines"][engine]["summary"]["runs"] == 2
    for engine in ("bnb-qlora", "unsloth"):  # not installable on a CPU machine: a reason, not a crash
        outcome = data["engines"][engine]["runs"][0]["outcome"]
        assert outcome != "ok" and "not wired" not in outcome and "raised" not in outcome, outcome
