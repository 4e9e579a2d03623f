"""PEFT LoRA layers save their input for backward once, in the model's dtype (``compact_lora_inputs``).

PEFT keeps bf16 adapters in float32 (``autocast_adapter_dtype``) and casts each LoRA layer's input to
float32 before ``lora_A``, which saves that copy for its weight gradient. On a Qwen2.5-14B block those
copies are 174 KB of the ~330 KB a token the block saves for backward (seven projections, q/k/v and
gate/up each saving their own copy of one input; measured with saved-tensor hooks on the CPU). Here
``lora_A`` saves the bf16 tensor the input was cast from and casts it again in backward: the same
float32 values, the same matrix products, so the same gradients bit for bit; 2 bytes a value instead
of 4, and q/k/v (gate/up) share one saved tensor.

How the source is known: the layer's ``_cast_input_dtype`` (PEFT's one cast of ``x``) is replaced
per instance by one that remembers ``(float32 copy, source)`` in a thread-local slot; ``lora_A``'s
class becomes ``CompactInputLinear``, which takes the slot and uses it only when its input *is* that
float32 copy (object identity: ``lora_dropout`` is ``nn.Identity``, checked at install). Anything else
(another PEFT version, a call from elsewhere) runs ``nn.Linear``'s own forward. Parameters, state
dict keys and module tree are unchanged; ``remove()`` restores both.
"""

from __future__ import annotations

import threading
import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CompactInputLinear", "CompactLoraInputs", "eligible_layers"]

# Casts that are exact (every source value is a float32 value), so casting again in backward
# reproduces the saved tensor bit for bit.
_EXACT_UPCASTS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}
_pending = threading.local()  # .cast: (float32 copy, source) of this thread's last LoRA input cast
_is_compiling = torch.compiler.is_compiling


def _cast_input_dtype(self, x, dtype):
    """PEFT's ``_cast_input_dtype`` (same result), remembering an exact upcast's source. Named as PEFT's method:
    a pickled model's bound method unpickles by name, as PEFT's own."""
    if x is None:
        return None
    if not getattr(self, "cast_input_dtype_enabled", True) or x.dtype == dtype:
        return x
    cast = x.to(dtype=dtype)
    if not _is_compiling():  # compiled code: the compiler decides what is saved (no slot, no guards on it)
        _pending.cast = (cast, x) if (x.dtype, dtype) in _EXACT_UPCASTS else None
    return cast


def _take_source(x: torch.Tensor) -> torch.Tensor | None:
    cast = getattr(_pending, "cast", None)
    _pending.cast = None
    return cast[1] if cast is not None and cast[0] is x else None


class _LinearSavingSource(torch.autograd.Function):
    """``F.linear(x, weight)`` for ``x == source.to(x.dtype)``, saving ``source`` instead of ``x``.
    Backward runs the products autograd runs for ``F.linear`` without bias (matmul folded to one mm:
    grad_x = grad @ W, grad_W = grad.T @ x), so the gradients are the same bits. ``cast``: the autocast
    dtype the call ran under (None: none), applied as autocast applies it to ``F.linear``: both operands cast
    to it for the products, each gradient cast back to its operand's dtype."""

    @staticmethod
    def forward(ctx, x, weight, source, cast):
        ctx.save_for_backward(source, weight)
        ctx.x_dtype, ctx.x_shape, ctx.cast = x.dtype, x.shape, cast
        if cast is None:
            return F.linear(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(cast), weight.to(cast))

    @staticmethod
    def backward(ctx, grad):
        source, weight = ctx.saved_tensors
        cast = ctx.cast
        w = weight if cast is None else weight.to(cast)
        out_features, in_features = weight.shape
        grad2d = grad.reshape(-1, out_features)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad2d.mm(w).view(ctx.x_shape)
            grad_x = grad_x if cast is None else grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x2d = source.to(ctx.x_dtype).reshape(-1, in_features)
            grad_w = grad2d.t().mm(x2d if cast is None else x2d.to(cast))
            grad_w = grad_w if cast is None else grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


class CompactInputLinear(nn.Linear):
    """``lora_A`` of an installed layer: an ``nn.Linear`` that saves its input's bf16 source when the
    input is the float32 cast PEFT just made of it (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_compiling():
            return super().forward(x)
        source = _take_source(x)
        if source is None or self.bias is not None or not torch.is_grad_enabled():
            return super().forward(x)
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return _LinearSavingSource.apply(x, self.weight, source, cast)


def eligible_layers(modules) -> list[nn.Module]:
    """PEFT LoRA ``Linear`` layers among ``modules``' submodules whose adapters are plain: ``lora_A`` a
    bias-free ``nn.Linear``, no dropout, no variant (DoRA...)."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return []
    found = []
    for module in modules:
        for layer in module.modules():
            if not isinstance(layer, LoraLinear) or not len(layer.lora_A):
                continue
            plain = all(
                type(layer.lora_A[name]) in (nn.Linear, CompactInputLinear) and layer.lora_A[name].bias is None
                and isinstance(layer.lora_dropout[name], nn.Identity)
                and name not in getattr(layer, "lora_variant", {})
                for name in layer.lora_A)
            if plain:
                found.append(layer)
    return found


class CompactLoraInputs:
    """Installs the compact saving on ``layers`` (see ``eligible_layers``); ``remove()`` undoes it."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = list(layers)
        self._linears: list[nn.Linear] = []
        for layer in self.layers:
            layer._cast_input_dtype = types.MethodType(_cast_input_dtype, layer)
            for name in layer.lora_A:
                linear = layer.lora_A[name]
                if type(linear) is nn.Linear:
                    linear.__class__ = CompactInputLinear
                    self._linears.append(linear)

    def remove(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("_cast_input_dtype", None)
        for linear in self._linears:
            if type(linear) is CompactInputLinear:
                linear.__class__ = nn.Linear
        self.layers, self._linears = [], []
        _pending.cast = None
