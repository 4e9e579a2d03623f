"""quantize_model() and wrap(quantize=...): frozen block weights stored quantized, the rest untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import trainstream
from ts_quant import QuantLinear
from ts_quant.reference import quantize_reference
from ts_testing import batches, loss_of, tiny_llama, train

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _frozen_base(layers: int = 2) -> torch.nn.Module:
    """A tiny Llama whose block linears are frozen; norms, embeddings and the head still train."""
    model = tiny_llama(layers=layers)
    for block in trainstream.find_blocks(model):
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.requires_grad_(False)
    return model


def _block_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.weight for b in trainstream.find_blocks(model) for m in b.modules() if type(m) is torch.nn.Linear]


def _format_bytes(fmt: str, rows: int, cols: int) -> int:
    """Stored bytes of one [rows, cols] weight, by the format's definition (default blocks, docs/quant.md)."""
    n = rows * cols
    if fmt == "int8":  # an int8 code per value, an fp32 scale per 64 values
        return n + 4 * -(-n // 64)
    if fmt == "nf4":  # two 4-bit codes a byte, an fp32 absmax per 64 values
        return -(-n // 2) + 4 * -(-n // 64)
    if fmt == "fp8":  # an e4m3 code per value, an fp32 scale per 128 x 128 tile
        return n + 4 * -(-rows // 128) * -(-cols // 128)
    assert fmt == "nvfp4"  # e2m1 codes two a byte, an e4m3 scale per 16 values, one fp32 scale per tensor
    return -(-n // 2) + -(-n // 16) + 4


def _reference_bytes(w: torch.Tensor, fmt: str) -> int:
    """Stored bytes of ts_quant.reference's encoding of w (codes, scales, per-tensor scale)."""
    return sum(t.numel() * t.element_size() for t in quantize_reference(w, fmt) if t is not None)


def _dequantized_copy(model: torch.nn.Module, fmt: str) -> torch.nn.Module:
    """The reference: the same model with each frozen block weight replaced by its dequantized value."""
    ref = copy.deepcopy(model)
    trainstream.quantize_model(model, fmt)
    for module, ref_module in zip(model.modules(), ref.modules()):
        if isinstance(module, QuantLinear):
            ref_module.weight.data.copy_(module.qweight.dequantize(torch.float32))
    return ref


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_quantize_model_replaces_only_frozen_block_linears(fmt):
    model = _frozen_base()
    head, embed = model.lm_head, model.model.embed_tokens
    weights = [w.detach().clone() for w in _block_weights(model)]
    result = trainstream.quantize_model(model, fmt)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert result["tensors"] == len(quantized) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert model.lm_head is head and model.model.embed_tokens is embed  # outside the blocks
    assert all(q.qweight.format == fmt for q in quantized)
    expected = sum(_format_bytes(fmt, *w.shape) for w in weights)
    assert result["bytes_after"] == expected == sum(_reference_bytes(w, fmt) for w in weights)
    assert result["bytes_before"] == sum(w.numel() * 4 for w in weights)
    assert result["bytes_after"] < result["bytes_before"] / 3


def test_quantized_forward_is_the_dequantized_model():
    model = _frozen_base()
    ref = _dequantized_copy(model, "nf4")
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_wrap_quantize_trains_like_adamw_on_the_dequantized_base():
    ours = _frozen_base()
    ref = _dequantized_copy(copy.deepcopy(ours), "int8")
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **HYPER)
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], **HYPER)
    ours, opt = trainstream.wrap(ours, opt, quantize="int8")
    data = batches(6)
    ours_losses, ref_losses = [], []
    for ids in data:
        for model, optimizer, losses in ((ours, opt, ours_losses), (ref, ref_opt, ref_losses)):
            loss = loss_of(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    ours._trainstream_session.synchronize()
    assert ours_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert ours_losses[-1] < ours_losses[0]
    trained = [p for p in ours.parameters() if p.requires_grad]
    ref_trained = [p for p in ref.parameters() if p.requires_grad]
    assert max((a - b).abs().max().item() for a, b in zip(trained, ref_trained)) <= 1e-5
    report = trainstream.memory_report(ours)
    assert report["params"]["quantize"] == "int8" and report["params"]["tensors"] == 14
    assert any("stored as int8" in line for line in report["events"])
    trainstream.unwrap(ours)


def test_quantized_model_state_dict_round_trips():
    model = _frozen_base()
    trainstream.quantize_model(model, "nf4")
    state = model.state_dict()
    again = _frozen_base()
    trainstream.quantize_model(again, "nf4", block_size=128)  # different scales until loaded
    again.load_state_dict(state)
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)


def test_lora_base_layers_are_quantized_and_adapters_train():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    result = trainstream.quantize_model(model, "nf4")
    assert result["tensors"] == 2 * 7  # every base linear of the blocks, adapted or not
    lora = [m for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    assert lora and all(isinstance(m.base_layer, QuantLinear) for m in lora)
    assert all(type(m.lora_A["default"]) is torch.nn.Linear for m in lora)
    loss_of(model, batches(1)[0]).backward()
    assert all(m.lora_B["default"].weight.grad is not None for m in lora)


def test_auto_keeps_weights_on_the_cpu():
    model, _ = trainstream.wrap(_frozen_base())  # quantize="auto" is the default
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    report = trainstream.memory_report(model)
    assert report["params"]["quantize"] is None
    assert any("auto: training on the CPU" in line for line in report["events"])
    trainstream.unwrap(model)


def test_auto_picks_the_first_format_that_fits():
    from trainstream.weights.quantize import choose_quantize

    model = _frozen_base()
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    weights = _block_weights(model)
    rest = total - sum(w.numel() * 4 for w in weights)  # all but the fp32 block weights
    # What the model takes with its block weights stored int8 / NF4, counted from the formats' definitions:
    # a budget of exactly that picks the format, one byte less does not.
    as_int8 = rest + sum(_format_bytes("int8", *w.shape) for w in weights)
    as_nf4 = rest + sum(_format_bytes("nf4", *w.shape) for w in weights)
    assert as_nf4 < as_int8 < total
    assert choose_quantize(model, total)[0] is None
    assert choose_quantize(model, total - 1)[0] == "int8"
    assert choose_quantize(model, as_int8)[0] == "int8"
    fmt, why = choose_quantize(model, as_int8 - 1)
    assert fmt == "nf4" and "exceed" in why
    assert choose_quantize(model, as_nf4)[0] == "nf4"
    with pytest.raises(MemoryError, match="even NF4"):
        choose_quantize(model, as_nf4 - 1)


def test_quantize_choices_are_checked():
    with pytest.raises(ValueError, match="quantize='auto' is not valid"):
        trainstream.quantize_model(_frozen_base(), "auto")
    with pytest.raises(ValueError, match="quantize='fp4' is not valid"):
        trainstream.wrap(_frozen_base(), quantize="fp4")
    with pytest.raises(ValueError, match="freeze the base"):
        trainstream.quantize_model(tiny_llama(), "nf4")
    with pytest.raises(ValueError, match="needs a format"):
        trainstream.quantize_model(_frozen_base(), None)
    with pytest.raises(ValueError, match="no repeated blocks"):
        trainstream.quantize_model(torch.nn.Linear(4, 4).requires_grad_(False), "int8")


def test_memory_report_names_the_quantized_blocks_and_outliers():
    """params: quantized_blocks (the blocks with a quantized layer), outliers (0: none kept exact)."""
    model, _ = trainstream.wrap(_frozen_base(layers=3), lr=1e-3, quantize="int8")
    params = trainstream.memory_report(model)["params"]
    assert params["quantize"] == "int8" and params["quantized_blocks"] == [0, 1, 2] and params["outliers"] == 0.0
    assert "blocks" not in params
    trainstream.unwrap(model)
    plain, _ = trainstream.wrap(tiny_llama(), lr=1e-3)
    assert trainstream.memory_report(plain)["params"] == {"quantize": None, "quantized_blocks": [], "outliers": 0.0}
    trainstream.unwrap(plain)


def _trained_quantized_lora(fmt: str, **options):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model, opt = trainstream.wrap(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                           lr=2e-2), quantize=fmt, **options)
    train(model, opt, batches(4))
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_merge_and_unload_on_a_quantized_base_keeps_the_trained_adapter(fmt):
    model = _trained_quantized_lora(fmt)
    ids = batches(1, seed=5)[0]
    lora = _logits(model, ids)
    with model.disable_adapter():
        base = _logits(model, ids)
    with pytest.warns(UserWarning, match="stored quantized again"):
        merged_model = model.merge_and_unload()
    merged = _logits(merged_model, ids)
    moved = (lora - base).norm()
    assert moved > 0.05 * lora.norm()  # training moved the adapter
    assert (merged - lora).norm() < 0.25 * moved  # the merge keeps it, up to the format's rounding


def test_merge_into_a_streamed_quantized_base_is_refused_until_unwrap():
    model = _trained_quantized_lora("nf4", param_offload=True)
    assert any(getattr(m, "assign_refusal", None) for m in model.modules() if isinstance(m, QuantLinear))
    ids = batches(1, seed=5)[0]
    lora = _logits(model, ids)
    before = [m.qweight.data.clone() for m in model.modules() if isinstance(m, QuantLinear)]
    with pytest.raises(RuntimeError, match="unwrap"):
        model.merge_adapter()
    after = [m.qweight.data for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing half-merged
    trainstream.unwrap(model)
    with pytest.warns(UserWarning, match="stored quantized again"):
        merged = _logits(model.merge_and_unload(), ids)
    assert (merged - lora).norm() < 0.25 * lora.norm()
