"""quantize_model: frozen linear weights of the block stack stored quantized (ts-quant), in place.

A quantized layer computes with the dequantized weight (on Hopper through the fused kernel), as QLoRA
does, so training on it is not bit-exact with the full-precision base. Only frozen weights are touched:
trainable ones, LoRA adapters included, stay as they are.
"""

from __future__ import annotations

import torch
import ts_pinned
from ts_quant import FORMATS, QuantizedTensor, QuantLinear

from .._units import fmt_bytes
from ..memory.blocks import find_blocks

__all__ = ["QUANTIZE_CHOICES", "block_linears", "choose_quantize", "quantize_model", "size_estimates"]

QUANTIZE_CHOICES = ("auto", None, False, "none", *FORMATS)
# Bytes per weight with the default blocks of 64 and fp32 scales (docs/quant.md).
_BYTES_PER_WEIGHT = (("int8", 1.0625), ("nf4", 0.5625))
GiB = 1 << 30


def check_quantize(value, allow_auto: bool = True) -> str | None:
    """The format name, "auto", or None for no quantization; ValueError naming the valid values otherwise."""
    if value is None or value is False or value == "none":
        return None
    if isinstance(value, str) and (value in FORMATS or (allow_auto and value == "auto")):
        return value
    shown = ", ".join(repr(c) for c in QUANTIZE_CHOICES if allow_auto or c != "auto")
    raise ValueError(f"quantize={value!r} is not valid; use one of {shown}")


def choose_quantize(model: torch.nn.Module, budget: int) -> tuple[str | None, str]:
    """quantize="auto": (None, why) when the model's weights fit in `budget` bytes as they are, else the
    first of int8, NF4 that makes the frozen block weights fit; MemoryError, with the numbers, when
    neither does (weight paging is not built yet)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    weights = [linear.weight for _, _, linear in block_linears(find_blocks(model))]
    estimates = size_estimates(total, weights)
    for fmt, estimate in estimates:
        if estimate <= budget:
            if fmt is None:
                return None, f"the weights ({fmt_bytes(total)}) fit in {fmt_bytes(budget)} of usable VRAM as they are"
            return fmt, (f"the weights ({fmt_bytes(total)}) exceed {fmt_bytes(budget)} of usable VRAM; "
                         f"{fmt} frozen block weights bring them to {fmt_bytes(estimate)}")
    raise MemoryError(
        f"the weights need {fmt_bytes(total)} but only {fmt_bytes(budget)} of VRAM can be used; even NF4 "
        f"frozen block weights ({sum(w.numel() for w in weights) / 1e9:.2f} B values) leave "
        f"{fmt_bytes(estimates[-1][1])}. Freeze more of the model (LoRA), use a GPU with more memory, or lower "
        f"vram_headroom; weight paging is not built yet."
    )


def block_linears(blocks: list[torch.nn.Module], frozen_only: bool = True):
    """(parent, attribute name, linear) for every nn.Linear (frozen ones only, by default) inside the blocks."""
    for block in blocks:
        for parent in block.modules():
            for name, child in parent.named_children():
                if type(child) is torch.nn.Linear and not (frozen_only and child.weight.requires_grad):
                    yield parent, name, child


def size_estimates(total: int, weights: list[torch.Tensor]) -> list[tuple[str | None, float]]:
    """(format, bytes of the whole model) as it is (None), then with `weights` stored int8, then NF4."""
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    values = sum(w.numel() for w in weights)
    return [(None, float(total))] + [(fmt, total - weight_bytes + values * b) for fmt, b in _BYTES_PER_WEIGHT]


# Why save_pretrained refuses a TrainStream-quantized model, and what to do instead.
SAVE_PRETRAINED_REFUSAL = ("a model quantized by TrainStream cannot be saved with save_pretrained: the codes live in the "
             "QuantLinear layers' extra state, which safetensors cannot hold. Save the adapters instead "
             "(save_pretrained on the PEFT model writes only them), or the full-precision base. For a merged "
             "model, load the base in bf16 (no quantization_config), load the adapters onto it with "
             "peft.PeftModel.from_pretrained, then merge_and_unload() and save_pretrained(); "
             "torch.save(model) keeps the quantized model whole")


def _refuse_save_pretrained(*args, **kwargs):
    raise ValueError(SAVE_PRETRAINED_REFUSAL)


def refuse_saving(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, None]]:
    """The transformers models in `model` (the root, or the base inside a PEFT model, which keeps its own
    save_pretrained for the adapters) refuse save_pretrained with the ways out, instead of failing inside
    transformers' sharding on the layers' extra state. Returns undo entries: (module, name, None)."""
    marked = [m for m in model.modules() if "save_pretrained" not in vars(m)
              and any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__)]
    for module in marked:
        module.save_pretrained = _refuse_save_pretrained  # an instance attribute: no reference back to it
    return [(module, "save_pretrained", None) for module in marked]


def undo_swaps(swaps: list) -> None:
    """Puts back what quantize_model changed, newest first: a layer swapped, or a method it shadowed (None)."""
    for parent, name, original in reversed(swaps):
        if original is None:
            vars(parent).pop(name, None)
        else:
            setattr(parent, name, original)


def quantize_model(model: torch.nn.Module, quantize: str = "nf4", *, blocks: list[torch.nn.Module] | None = None,
                   block_size: int | None = None, pin_budget: int | None = None,
                   _replaced: list | None = None) -> dict:
    """Replaces each frozen ``nn.Linear`` of the repeated blocks by a ``ts_quant.QuantLinear`` holding its
    weight in ``quantize`` (``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"``), on the weight's device.

    ``blocks``: the modules to search (default ``find_blocks(model)``: embeddings and the output layer
    are never quantized). ``block_size``: values per scale (the format's default when None).
    ``pin_budget``: bytes of quantized weights held on the CPU to place in page-locked memory (the
    ts-pinned arena, tag ``"weights"``), the earliest blocks first, so they upload asynchronously;
    None (default) pins nothing.
    Returns ``{"tensors", "bytes_before", "bytes_after", "blocks"}`` (``blocks``: the indices of the blocks
    with a quantized layer), plus ``"pinned_bytes"`` when ``pin_budget`` is given. Freeze the base (or add adapters) first.
    A transformers model in ``model`` then refuses ``save_pretrained`` with the ways out
    (``SAVE_PRETRAINED_REFUSAL``). All or nothing: if one layer fails, the layers already replaced are put back.
    (``_replaced``, internal: receives each ``(parent, name, original)`` swapped, for wrap()'s undo.)
    """
    fmt = check_quantize(quantize, allow_auto=False)
    if fmt is None:
        raise ValueError("quantize_model needs a format: 'int8', 'nf4', 'fp8' or 'nvfp4'")
    if pin_budget is not None and (isinstance(pin_budget, bool) or not isinstance(pin_budget, int) or pin_budget < 0):
        raise ValueError(f"pin_budget={pin_budget!r} is not valid; use None (pin nothing) or bytes >= 0")
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise ValueError("quantize_model found no repeated blocks in this model; pass blocks=[...]")
    targets = list(block_linears(blocks))
    hit = [i for i, b in enumerate(blocks) if next(block_linears([b]), None) is not None]
    if not targets and any(p.requires_grad for b in blocks for p in b.parameters()):
        raise ValueError("the blocks' linear weights are all trainable: freeze the base (or add adapters) first")
    before = after = pinned = 0
    replaced = []
    try:
        with torch.no_grad():
            for parent, name, linear in targets:
                layer = QuantLinear.from_linear(linear, fmt, block_size)
                before += linear.weight.numel() * linear.weight.element_size()
                after += layer.qweight.nbytes
                if pin_budget is not None and layer.qweight.device.type == "cpu" and \
                        pinned + layer.qweight.nbytes <= pin_budget:
                    layer.qweight = _page_locked(layer.qweight)
                    pinned += layer.qweight.nbytes
                setattr(parent, name, layer)
                replaced.append((parent, name, linear))
        replaced += refuse_saving(model) if targets else []
    except BaseException:
        undo_swaps(replaced)
        raise
    if _replaced is not None:
        _replaced.extend(replaced)
    result = {"tensors": len(targets), "bytes_before": before, "bytes_after": after, "blocks": hit}
    if pin_budget is not None:
        result["pinned_bytes"] = pinned
    return result


def _page_locked(qweight: QuantizedTensor) -> QuantizedTensor:
    """The same codes and scales, copied into the page-locked arena (pageable without a GPU driver)."""
    state = qweight.to_state_dict()
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.numel():
            copy = ts_pinned.empty(value.shape, value.dtype, tag="weights", allow_pageable=True)
            state[key] = copy.copy_(value)
    return QuantizedTensor.from_state_dict(state)
