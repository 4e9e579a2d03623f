"""quantize_model: frozen linear weights of the block stack stored quantized (ts-quant), in place.

A quantized layer computes with the dequantized weight (on Hopper through the fused kernel), as QLoRA
does, so training on it is not bit-exact with the full-precision base. Only frozen weights are touched:
trainable ones, LoRA adapters included, stay as they are.
"""

from __future__ import annotations

import torch
from ts_quant import FORMATS, QuantLinear

from ._blocks import find_blocks

__all__ = ["QUANTIZE_CHOICES", "quantize_model"]

QUANTIZE_CHOICES = (None, False, "none", *FORMATS)


def check_quantize(value) -> str | None:
    """The format name, or None for no quantization; ValueError naming the valid values otherwise."""
    if value is None or value is False or value == "none":
        return None
    if isinstance(value, str) and value in FORMATS:
        return value
    if value == "auto":
        raise ValueError("quantize='auto' is not available yet; choose None, 'int8', 'nf4', 'fp8' or 'nvfp4'")
    shown = ", ".join(repr(c) for c in QUANTIZE_CHOICES)
    raise ValueError(f"quantize={value!r} is not valid; use one of {shown}")


def _frozen_linears(blocks: list[torch.nn.Module]):
    """(parent, attribute name, linear) for every frozen nn.Linear inside the blocks."""
    for block in blocks:
        for parent in block.modules():
            for name, child in parent.named_children():
                if type(child) is torch.nn.Linear and not child.weight.requires_grad:
                    yield parent, name, child


def quantize_model(model: torch.nn.Module, quantize: str = "nf4", *, blocks: list[torch.nn.Module] | None = None,
                   block_size: int | None = None) -> dict:
    """Replaces each frozen ``nn.Linear`` of the repeated blocks by a ``ts_quant.QuantLinear`` holding its
    weight in ``quantize`` (``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"``), on the weight's device.

    ``blocks``: the modules to search (default ``find_blocks(model)``: embeddings and the output layer
    are never quantized). ``block_size``: values per scale (the format's default when None).
    Returns ``{"tensors", "bytes_before", "bytes_after"}``. Freeze the base (or add adapters) first.
    """
    fmt = check_quantize(quantize)
    if fmt is None:
        raise ValueError("quantize_model needs a format: 'int8', 'nf4', 'fp8' or 'nvfp4'")
    blocks = find_blocks(model) if blocks is None else list(blocks)
    if not blocks:
        raise ValueError("quantize_model found no repeated blocks in this model; pass blocks=[...]")
    targets = list(_frozen_linears(blocks))
    if not targets and any(p.requires_grad for b in blocks for p in b.parameters()):
        raise ValueError("the blocks' linear weights are all trainable: freeze the base (or add adapters) first")
    before = after = 0
    with torch.no_grad():
        for parent, name, linear in targets:
            layer = QuantLinear.from_linear(linear, fmt, block_size)
            before += linear.weight.numel() * linear.weight.element_size()
            after += layer.qweight.nbytes
            setattr(parent, name, layer)
    return {"tensors": len(targets), "bytes_before": before, "bytes_after": after}
