"""One scaled_dot_product_attention call, taken apart: its arguments, the key its measurement is
cached by, a readable label, and the signature of a whole forward's inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SdpaCall", "forward_signature"]

_POSITIONAL = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _autocast_state(device_type: str) -> tuple:
    try:
        if torch.is_autocast_enabled(device_type):
            return (True, torch.get_autocast_dtype(device_type))
    except (RuntimeError, TypeError):  # a device type without autocast
        pass
    return (False, None)


def determinism() -> tuple[bool, bool]:
    """(deterministic mode on, warn_only)."""
    on = torch.are_deterministic_algorithms_enabled()
    return on, on and torch.is_deterministic_algorithms_warn_only_enabled()


@dataclasses.dataclass
class SdpaCall:
    """The arguments of one ``F.scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    extra: dict = dataclasses.field(default_factory=dict)  # arguments a later torch may add
    train: bool | None = None  # set when the model's forward began with gradients on
    grad_cache: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # measuring's dO

    @classmethod
    def from_args(cls, args: tuple, kwargs: dict) -> SdpaCall:
        values = dict(_DEFAULTS)
        for name, arg in zip(_POSITIONAL, args):
            values[name] = arg
        extra = {}
        for name, arg in kwargs.items():
            if name in _POSITIONAL:
                values[name] = arg
            else:
                extra[name] = arg
        return cls(**values, extra=extra)

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def needs_grad(self) -> bool:
        """Whether backward will run through this call. Inside a training forward a call under
        no_grad (reentrant checkpointing) is recomputed with gradients in backward: it counts."""
        inputs = any(t.requires_grad for t in (self.query, self.key, self.value))
        if self.train is None:
            return torch.is_grad_enabled() and inputs
        return self.train and (inputs or not torch.is_grad_enabled())

    def options(self, dropout_p: float | None = None) -> dict[str, Any]:
        """Keyword arguments for F.scaled_dot_product_attention beside q, k, v."""
        options = {"attn_mask": self.attn_mask, "dropout_p": self.dropout_p if dropout_p is None else dropout_p,
                   "is_causal": self.is_causal, "scale": self.scale, **self.extra}
        if self.enable_gqa:
            options["enable_gqa"] = True
        return options

    def key_of(self) -> tuple:
        """What decides which backends can run the call and how fast: shapes, layouts, dtypes, device,
        mask kind, causality, dropout, autocast and deterministic mode. Not grad mode: a forward
        without gradients uses what the training forward of the same shape measured."""
        q, k, v, mask = self.query, self.key, self.value, self.attn_mask
        mask_kind = None if mask is None else (mask.dtype, tuple(mask.shape), mask.stride())
        return (tuple(q.shape), q.stride(), q.dtype, tuple(k.shape), k.stride(), k.dtype,
                tuple(v.shape), v.stride(), v.dtype, q.device, mask_kind, bool(self.is_causal),
                self.dropout_p > 0, self.scale is None, bool(self.enable_gqa), tuple(sorted(self.extra)),
                _autocast_state(q.device.type), determinism())

    def family_of(self) -> tuple:
        """The key without batch size, sequence lengths and strides: calls that differ only in how
        many tokens they hold (dynamic padding) are one family."""
        q, k, v, mask = self.query, self.key, self.value, self.attn_mask

        def dims(t: torch.Tensor) -> tuple:
            shape = list(t.shape)
            return tuple(shape[1:-2] + shape[-1:])

        return (dims(q), q.dtype, dims(k), k.dtype, dims(v), v.dtype, q.device,
                None if mask is None else (mask.dtype, mask.dim()), bool(self.is_causal), self.dropout_p > 0,
                self.scale is None, bool(self.enable_gqa), tuple(sorted(self.extra)),
                _autocast_state(q.device.type), determinism())

    @property
    def cached_keys(self) -> bool:
        """More keys than queries: the call reads a KV cache (decoding, chunked prefill)."""
        return self.key.shape[-2] > self.query.shape[-2]

    def size_of(self) -> tuple[int, int, int]:
        """(batch, query length, key length)."""
        q = self.query
        return (q.shape[0] if q.dim() >= 3 else 1, q.shape[-2], self.key.shape[-2])

    def label(self) -> str:
        """e.g. ``b1 h40/8 q2048 k2048 d128 bfloat16 causal cuda:0``."""
        q, k = self.query, self.key
        dims = list(q.shape)
        if len(dims) >= 4:
            text = f"b{dims[0]} h{dims[-3]}" + (f"/{k.shape[-3]}" if k.shape[-3] != dims[-3] else "")
        else:
            text = "x".join(str(d) for d in dims[:-2]) or "-"
        text += f" q{q.shape[-2]} k{k.shape[-2]} d{q.shape[-1]}"
        if self.value.shape[-1] != q.shape[-1]:
            text += f"/{self.value.shape[-1]}"
        autocast = _autocast_state(q.device.type)
        dtype = autocast[1] if autocast[0] and q.dtype.is_floating_point else q.dtype
        text += " " + str(dtype).removeprefix("torch.")
        if self.is_causal:
            text += " causal"
        if self.attn_mask is not None:
            text += f" {str(self.attn_mask.dtype).removeprefix('torch.')}-mask"
        if self.dropout_p > 0:
            text += f" dropout{self.dropout_p:g}"
        return text + f" {q.device}"


def _walk(value: Any, out: list, depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        out.append((value.shape, value.dtype, value.device))
    elif value is None or isinstance(value, (bool, str)):
        out.append(value)
    elif depth < 4 and isinstance(value, Mapping):
        for name, item in value.items():
            out.append(name)
            _walk(item, out, depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple)):
        out.append(len(value))
        for item in value:
            _walk(item, out, depth + 1)
    else:  # numbers and objects (a KV cache): their type only, so a counter does not make every call new
        out.append(type(value))


def forward_signature(args: tuple, kwargs: dict) -> tuple:
    """What a forward's attention calls are expected to depend on: the inputs' shapes, dtypes and
    devices, grad mode, autocast and deterministic mode."""
    out: list = []
    _walk(args, out)
    _walk(kwargs, out)
    out.append((torch.is_grad_enabled(), _autocast_state("cuda"), _autocast_state("cpu"), determinism()))
    return tuple(out)
