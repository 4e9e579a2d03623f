"""wrap() options: one dataclass, validated up front with errors that name the valid values."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import torch
import ts_adamw

from .activations.policy import check_block_choice, check_param_offload
from .attention import WRAP_DEFAULT, check_attention_mode
from .weights.peer import check_peer_option
from .weights.quantize import check_quantize

__all__ = ["WrapOptions", "parse_options"]

_CHOICES: dict[str, tuple[Any, ...]] = {
    "optimizer_mode": ("cpu", "gpu", "auto"),
    "offload": ("auto", True),
    "moment_dtype": ("auto", "float32", "bfloat16"),
    "recompute_variant": ("full", "selective"),
    "compact_lora_inputs": ("auto", True, False),
    "stream_packing": ("auto", True, False),
    "host_embedding": ("auto", True, False),
    "prefer": ("exact", "speed"),
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
    guard_params: bool = True
    activation_offload: Any = "auto"
    recompute: Any = "auto"
    recompute_variant: str = "full"
    compact_lora_inputs: Any = False  # prototype (trainstream.prototype); "auto": where PEFT layers qualify
    prefetch_depth: int = 1  # paged activation blocks brought back ahead of backward
    weights_prefetch_depth: int = 1  # streamed weight blocks fetched ahead of the one running
    max_inflight_bytes: int | None = None
    min_offload_bytes: int = 1 << 20
    blocks: Any = None
    attention: Any = WRAP_DEFAULT  # "auto" on one GPU, "default" elsewhere (attention.resolve_wrap_default)
    param_offload: Any = False
    stream_packing: Any = False  # prototype; "auto": where host RAM holds the packed copies too
    host_embedding: Any = False  # prototype; "auto": where the model has a frozen untied embedding
    prefer: str = "exact"  # quantize="auto" with param_offload="auto": stream exact weights before quantizing
    peer: Any = False  # prototype; "auto": pooled where data parallel ranks share a machine
    mapped_trial: bool = False  # prototype: offload="auto" times mapped CUDA AdamW against host AdamW
    distributed: bool | None = None
    distributed_timeout: float | None = None  # seconds; None: trainstream.distributed.DEFAULT_TIMEOUT_S

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
        guesses = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
                   for name in unknown for close in [difflib.get_close_matches(name, known, n=1)]]
        raise ValueError(f"unknown wrap() option(s): {', '.join(guesses)}; valid options: {', '.join(sorted(known))}")
    opts = WrapOptions(**options)
    opts.quantize = check_quantize(opts.quantize)
    for name in _CHOICES:
        setattr(opts, name, _choice(name, getattr(opts, name)))
    if opts.max_grad_norm is not None:
        opts.max_grad_norm = _real("max_grad_norm", opts.max_grad_norm, "None or a finite number > 0", positive=True)
    opts.accumulation_steps = _integer("accumulation_steps", opts.accumulation_steps, 1, _MAX_INT32)
    if opts.threads is not None:
        opts.threads = _integer("threads", opts.threads, 1, thread_limit(), "None (all usable cores) or ")
    opts.vram_headroom = _real("vram_headroom", opts.vram_headroom, "a fraction in [0, 1)", upper=1.0)
    opts.lr = _real("lr", opts.lr, "a finite number >= 0")
    opts.seed = _integer("seed", opts.seed, 0, 2**63 - 1)
    for flag in ("check_memory", "verbose", "guard_params", "mapped_trial"):
        if not isinstance(getattr(opts, flag), bool):
            raise ValueError(f"{flag}={getattr(opts, flag)!r} is not valid; use True or False")
    opts.device = _device(opts.device)
    if opts.attention != WRAP_DEFAULT:
        opts.attention = check_attention_mode(opts.attention)
    opts.param_offload = check_param_offload(opts.param_offload)
    opts.peer = check_peer_option(opts.peer)
    if opts.distributed is not None and not isinstance(opts.distributed, bool):
        raise ValueError(f"distributed={opts.distributed!r} is not valid; use None (on when an initialized process "
                         f"group has more than one rank), True or False")
    if opts.distributed_timeout is not None:
        opts.distributed_timeout = _real("distributed_timeout", opts.distributed_timeout,
                                         "None (600 s) or a finite number of seconds > 0", positive=True)
    opts.activation_offload = check_block_choice("activation_offload", opts.activation_offload)
    opts.recompute = check_block_choice("recompute", opts.recompute)
    opts.prefetch_depth = _integer("prefetch_depth", opts.prefetch_depth, 1, 64)
    opts.weights_prefetch_depth = _integer("weights_prefetch_depth", opts.weights_prefetch_depth, 1, 64)
    if opts.max_inflight_bytes is not None:
        opts.max_inflight_bytes = _integer("max_inflight_bytes", opts.max_inflight_bytes, 1, 2**62,
                                           "None (1 GiB) or ")
    opts.min_offload_bytes = _integer("min_offload_bytes", opts.min_offload_bytes, 0, 2**62)
    if opts.blocks is not None and not (isinstance(opts.blocks, (list, tuple)) and opts.blocks
                                        and all(isinstance(b, torch.nn.Module) for b in opts.blocks)):
        raise ValueError(f"blocks={opts.blocks!r} is not valid; use None (find_blocks) or a list of the model's "
                         f"repeated layer modules")
    return opts


_MAX_INT32 = 2**31 - 1


def thread_limit() -> int:
    """The most host threads ``threads=`` accepts: 4 x the cores this process may use (affinity, cgroup quota)."""
    return ts_adamw.max_host_threads()


def _integer(name: str, value: Any, low: int, high: int, prefix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} is not valid; use {prefix}an integer in [{low}, {high}]")
    return int(value)


def _real(name: str, value: Any, valid: str, *, positive: bool = False, upper: float | None = None) -> float:
    try:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400)
        ok = False
    ok = ok and (value > 0 if positive else value >= 0) and (upper is None or value < upper)
    if not ok:
        raise ValueError(f"{name}={value!r} is not valid; use {valid}")
    return float(value)
