"""Assigning a QuantLinear's weight (how PEFT merges an adapter): stored quantized again, in place, or refused
with nothing changed; PEFT's merge_and_unload on a quantized base keeps the adapter."""

import io
import warnings

import pytest
import torch
import ts_quant
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from ts_quant import QuantLinear


def _layer(fmt="nf4", out_features=48, in_features=64, seed=0, **kw):
    torch.manual_seed(seed)
    return QuantLinear.from_linear(nn.Linear(in_features, out_features), fmt, **kw)


def _assign_quietly(layer, values):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer.weight.data = values


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(ts_quant.FORMATS), seed=st.integers(0, 2**16), double_quant=st.booleans())
def test_assigned_weight_is_stored_as_quantize_would_store_it(fmt, seed, double_quant):
    double_quant = double_quant and fmt == "nf4"
    layer = _layer(fmt, seed=seed, double_quant=double_quant)
    codes = layer.qweight.data
    values = torch.randn(48, 64, generator=torch.Generator().manual_seed(seed + 1))
    _assign_quietly(layer, values)
    expected = ts_quant.quantize(values, fmt, layer.qweight.block_size, double_quant=double_quant)
    assert layer.qweight.data is codes  # in place: holders of the codes see the new ones
    assert torch.equal(layer.weight, expected.dequantize(layer.qweight.dtype))
    assert layer.rounding_error == pytest.approx(
        float((expected.dequantize(torch.float32) - values).abs().max()), abs=0)


def test_peft_idioms_merge_and_unmerge_through_the_decoded_weight():
    layer = _layer("int8")
    base = layer.weight.clone()
    delta = torch.full((48, 64), 0.25)
    with pytest.warns(UserWarning, match="stored quantized again"):
        layer.weight.data += delta  # PEFT's merge
    assert torch.allclose(layer.weight, base + delta, atol=2 * layer.rounding_error + 1e-6)
    assert layer.rounding_error < 0.05
    merged = layer.weight.data.clone()  # PEFT's safe merge, then unmerge
    merged -= delta
    _assign_quietly(layer, merged)
    assert torch.allclose(layer.weight, base, atol=0.05)
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias, atol=1e-4)  # forward uses the stored codes


def test_bad_assignments_change_nothing():
    layer = _layer("nf4")
    before = layer.weight.clone()
    with pytest.raises(ValueError, match="shape"):
        layer.weight.data = torch.zeros(64, 48)
    with pytest.raises(ValueError, match="not finite"):
        layer.weight.data = torch.full((48, 64), float("nan"))
    layer.assign_refusal = "held by a streamer: unwrap first"
    with pytest.raises(RuntimeError, match="unwrap first"):
        layer.weight.data = torch.zeros(48, 64)
    assert torch.equal(layer.weight, before) and layer.rounding_error is None


def test_the_decoded_weight_is_a_plain_tensor_to_everything_else():
    layer = _layer("nf4")
    w = layer.weight
    assert type(w * 2) is torch.Tensor and type(w.detach()) is torch.Tensor and type(w.data) is torch.Tensor
    buf = io.BytesIO()
    torch.save({"w": w}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]  # saved as plain values: loads without our classes
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w)
    import copy
    assert type(copy.deepcopy(w)) is torch.Tensor
    w.add_(1.0)  # in-place arithmetic on the copy changes the copy alone
    assert not torch.equal(layer.weight, w)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_peft_merge_and_unload_keeps_the_adapter(fmt):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    model[0] = QuantLinear.from_linear(model[0], fmt)
    model[2] = QuantLinear.from_linear(model[2], fmt)
    x = torch.randn(8, 64)
    base_out = model(x).detach()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # a trained adapter: far from the base
    lora_out = lora(x).detach()
    with pytest.warns(UserWarning, match="stored quantized again"):
        merged = lora.merge_and_unload()
    merged_out = merged(x).detach()
    moved = (lora_out - base_out).norm()
    assert moved > 0.3 * lora_out.norm()  # the adapter matters
    # The merged model is the adapter's up to the format's rounding, not the base (the bug: it equalled the base).
    assert (merged_out - lora_out).norm() < 0.2 * moved
    assert isinstance(merged[0], QuantLinear) and merged[0].rounding_error is not None
