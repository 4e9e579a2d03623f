"""quantized_linear as torch custom ops, for code that torch.compile traces.

Dynamo cannot trace the eager path (a nanobind call, plan lookups that compare addresses): each call
was a graph break. Under tracing, quantized_linear calls ``ts_quant::quantized_linear`` instead, whose
arguments are plain tensors and constants: the weight's tensors (codes, scales, ...) and its format,
shape and block size. Its implementation finds the QuantizedTensor again by its codes tensor
(``QuantizedTensor.owner_of``), so the per-weight plan cached by eager calls serves compiled calls too;
a weight it cannot find (a copy a CUDA graph tree made of it) is rebuilt around the given tensors and
runs unplanned. The backward is ``ts_quant::dequantize`` and a matmul, both visible to the compiler.
"""

from __future__ import annotations

import torch

from . import _linear
from ._tensor import QuantizedTensor

__all__ = ["traced_linear", "weight_tensors"]

# How a weight's tensors are laid out in the ops' `tensors` argument.
PLAIN, GLOBAL_SCALE, DOUBLE_QUANT = 0, 1, 2


def weight_tensors(q: QuantizedTensor) -> tuple[list[torch.Tensor], int, int]:
    """(tensors, layout, inner block size) of q: what the ops take instead of the object."""
    if q.double_quant:
        s = q.scales
        return [q.data, s.data, s.scales, q.scale_offset], DOUBLE_QUANT, s.block_size
    if q.global_scale is not None:
        return [q.data, q.scales, q.global_scale], GLOBAL_SCALE, 0
    return [q.data, q.scales], PLAIN, 0


def _weight(tensors: list[torch.Tensor], fmt: str, shape: list[int], block: int, layout: int,
            inner_block: int) -> QuantizedTensor:
    q = QuantizedTensor.owner_of(tensors[0])
    if q is not None and q.format == fmt and list(q.shape) == shape and q.block_size == block:
        held, held_layout, _ = weight_tensors(q)
        if held_layout == layout and all(a is b for a, b in zip(held, tensors)):
            return q
    if layout == DOUBLE_QUANT:
        data, codes, scales, offset = tensors
        inner = QuantizedTensor("int8", (codes.numel(),), codes, scales, inner_block, torch.float32)
        return QuantizedTensor(fmt, shape, data, inner, block, scale_offset=offset)
    return QuantizedTensor(fmt, shape, tensors[0], tensors[1], block,
                           global_scale=tensors[2] if layout == GLOBAL_SCALE else None)


@torch.library.custom_op("ts_quant::quantized_linear", mutates_args=())
def _linear_op(x: torch.Tensor, tensors: list[torch.Tensor], bias: torch.Tensor | None, fmt: str,
               shape: list[int], block: int, layout: int, inner_block: int, outliers: float) -> torch.Tensor:
    q = _weight(tensors, fmt, shape, block, layout, inner_block)
    return _linear._run(x, q, _linear.checked_plan(x, q, bias, outliers), bias, outliers)


@_linear_op.register_fake
def _(x, tensors, bias, fmt, shape, block, layout, inner_block, outliers):
    return x.new_empty((*x.shape[:-1], shape[0]))


@torch.library.custom_op("ts_quant::dequantize", mutates_args=())
def _dequantize_op(tensors: list[torch.Tensor], fmt: str, shape: list[int], block: int, layout: int,
                   inner_block: int, like: torch.Tensor) -> torch.Tensor:
    """The weight decoded in like's dtype on like's device (like: any tensor of that dtype)."""
    q = _weight(tensors, fmt, shape, block, layout, inner_block)
    plan = _linear.checked_plan(like.new_empty((0, shape[1])), q, None, 0.0) if like.device == q.device else None
    return _linear.dequantized_like(q, plan, like)


@_dequantize_op.register_fake
def _(tensors, fmt, shape, block, layout, inner_block, like):
    return like.new_empty(shape)


def _setup(ctx, inputs, output):
    _x, tensors, bias, fmt, shape, block, layout, inner_block, _outliers = inputs
    ctx.meta = (fmt, shape, block, layout, inner_block)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(*tensors)


def _backward(ctx, grad_out):
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = _dequantize_op(list(ctx.saved_tensors), *ctx.meta, grad_out)
        grad_x = _linear.input_grad(grad_out, w)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
    no_grads = [None] * len(ctx.saved_tensors)  # the weight's tensors: frozen
    return grad_x, no_grads, grad_bias, None, None, None, None, None, None


_linear_op.register_autograd(_backward, setup_context=_setup)


def traced_linear(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None, outliers: float) -> torch.Tensor:
    """quantized_linear(x, q, bias, outliers) as one custom op call (what dynamo records)."""
    tensors, layout, inner_block = weight_tensors(q)
    return _linear_op(x, tensors, bias, q.format, list(q.shape), q.block_size, layout, inner_block, outliers)
