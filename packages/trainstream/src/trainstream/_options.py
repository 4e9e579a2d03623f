"""wrap() options: one dataclass, validated up front with errors that name the valid values."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._quantize import check_quantize

__all__ = ["WrapOptions", "parse_options"]

_CHOICES: dict[str, tuple[Any, ...]] = {
    "optimizer_mode": ("cpu", "gpu", "auto"),
    "offload": ("auto", True),
    "moment_dtype": ("auto", "float32", "bfloat16"),
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclasses.dataclass
class WrapOptions:
    """Every option of ``wrap()``; see the README's option table for their meaning."""

    optimizer_mode: str = "cpu"
    offload: str | bool = "auto"
    moment_dtype: str = "auto"
    max_grad_norm: float | None = None
    accumulation_steps: int = 1
    threads: int | None = None
    device: torch.device | None = None
    check_memory: bool = True
    vram_headroom: float = 0.10
    lr: float = 1e-3
    seed: int = 0
    verbose: bool = False
    quantize: str | None = "auto"

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _choice(name: str, value: Any) -> Any:
    if name == "moment_dtype" and isinstance(value, (str, torch.dtype)):
        value = _DTYPE_ALIASES.get(value, value)
    choices = _CHOICES[name]
    # Booleans match only themselves: offload=1 is a typo, not True.
    if not any(value is c if isinstance(c, bool) else (not isinstance(value, bool) and value == c) for c in choices):
        shown = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} is not valid; use one of {shown}")
    return value


def _device(value: Any) -> torch.device | None:
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={value!r} is not a device; use None, 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device={value!r} is not supported; use None, 'cuda', 'cuda:N' or 'cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def parse_options(options: dict[str, Any]) -> WrapOptions:
    """Validates wrap()'s keyword options; unknown names and bad values raise ValueError."""
    known = {f.name for f in dataclasses.fields(WrapOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown wrap() option(s): {', '.join(unknown)}; valid options: {', '.join(sorted(known))}")
    opts = WrapOptions(**options)
    opts.quantize = check_quantize(opts.quantize)
    for name in _CHOICES:
        setattr(opts, name, _choice(name, getattr(opts, name)))
    if opts.max_grad_norm is not None and not (isinstance(opts.max_grad_norm, (int, float)) and opts.max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={opts.max_grad_norm!r} is not valid; use None or a positive number")
    if isinstance(opts.accumulation_steps, bool) or not isinstance(opts.accumulation_steps, int) or opts.accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={opts.accumulation_steps!r} is not valid; use an integer >= 1")
    if opts.threads is not None and (isinstance(opts.threads, bool) or not isinstance(opts.threads, int) or opts.threads < 1):
        raise ValueError(f"threads={opts.threads!r} is not valid; use None (all physical cores) or an integer >= 1")
    if not isinstance(opts.vram_headroom, (int, float)) or not 0.0 <= opts.vram_headroom < 1.0:
        raise ValueError(f"vram_headroom={opts.vram_headroom!r} is not valid; use a fraction in [0, 1)")
    if not isinstance(opts.lr, (int, float)) or opts.lr < 0:
        raise ValueError(f"lr={opts.lr!r} is not valid; use a number >= 0")
    for flag in ("check_memory", "verbose"):
        if not isinstance(getattr(opts, flag), bool):
            raise ValueError(f"{flag}={getattr(opts, flag)!r} is not valid; use True or False")
    opts.device = _device(opts.device)
    return opts
