"""tools/demo_smollm2.py: the --smoke run trains (a SmolLM2-135M-shaped model cut to 2 layers, CPU)."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "tools" / "demo_smollm2.py"


def _demo():
    spec = importlib.util.spec_from_file_location("demo_smollm2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_trains_and_reports(capsys):
    demo = _demo()
    losses = demo.main(["--smoke"])
    out = capsys.readouterr().out
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert [line.split(" loss ")[0] for line in out.splitlines() if line.startswith("step ")] == \
        ["step 1/3", "step 2/3", "step 3/3"]
    assert "2 layers" in out and "LoRA r=16" in out and "held-out loss" in out
    # The shape is SmolLM2-135M's (9 heads of 64, 3 KV heads, tied 49152-token embeddings).
    assert demo.SMOLLM2_135M["hidden_size"] == 576 and demo.SMOLLM2_135M["num_hidden_layers"] == 30


@pytest.mark.parametrize(("argv", "message"), [(["--quantize", "nf4", "--rank", "0"], "LoRA"),
                                               (["--steps", "0"], "--steps"),
                                               (["--model", "/no/such/folder"], "not a folder")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        _demo().main(argv)
    assert message in capsys.readouterr().err
