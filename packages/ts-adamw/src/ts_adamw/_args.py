"""Argument plumbing shared by the public functions: tensors to DLPack-ready views, thread counts."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import _core

__all__: list[str] = []

_INT64_MAX = (1 << 63) - 1


def plain(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` without autograd tracking (torch refuses DLPack export of tensors that require grad)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what} is a sparse tensor; AdamW here takes dense tensors")
    return tensor.detach()


def plain_list(tensors, what: str) -> list[torch.Tensor]:
    """Each tensor of a list through ``plain`` (``what[i]`` names it in errors)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise ValueError(f"{what} must be a list of tensors")
    return [plain(t, f"{what}[{i}]") for i, t in enumerate(tensors)]


def threads_limit() -> str:
    """The accepted thread counts, for messages."""
    usable = _core.usable_cores()
    return (f"1 to {_core.max_host_threads()} (4 x the {usable} cores this process may use, from its CPU "
            f"affinity and cgroup CPU quota; see ts_adamw.usable_cores())")


def thread_count(threads: int | None) -> int:
    """Native thread limit: 0 means the whole host pool."""
    if threads is None:
        return 0
    if (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
            or threads > _core.max_host_threads()):
        raise ValueError(f"threads={threads!r} must be None (the whole host pool) or an int from {threads_limit()}")
    return threads


def bump_versions(tensors: Iterable[torch.Tensor | None]) -> None:
    """Marks tensors the native code wrote as modified in place, as torch's own in-place ops do, so autograd
    refuses a backward that would read a saved tensor's new value."""
    increment_versions([t for t in tensors if t is not None and not t.is_inference()])


def increment_versions(live: list[torch.Tensor]) -> None:
    """``bump_versions`` for a list already free of None and inference tensors."""
    try:
        torch.autograd.graph.increment_version(live)
    except TypeError:  # torch < 2.6 takes one tensor at a time
        for t in live:
            torch.autograd.graph.increment_version(t)


def step_number(step) -> int:
    """The step count as an int >= 1 (accepts ints, floats that are whole, and 0-dim tensors)."""
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= _INT64_MAX:
        raise ValueError(f"step={step!r} must be an int from 1 to 2**63 - 1 (the count including this step)")
    return step


def seed_number(seed) -> int:
    """The stochastic-rounding seed as an unsigned 64-bit int."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int")
    return seed & 0xFFFFFFFFFFFFFFFF


def scalar(value, what: str) -> float:
    """A hyper-parameter as a Python float (0-dim tensors accepted, as torch optimizers allow)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{what}={value!r} must be a number that fits a float") from None


def rounding_keys(keys, count: int) -> list[int]:
    """The native list of per-tensor rounding keys ([] for the default: each tensor's position)."""
    if keys is None:
        return []
    keys = list(keys)
    if len(keys) != count or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in keys):
        raise ValueError(f"keys must be {count} integers in [0, 2**32), one per tensor; got {keys!r}")
    return keys


def rounding_offsets(offsets, count: int) -> list[int]:
    """The native list of per-tensor first rounding indices ([] for the default: every tensor starts at 0)."""
    if offsets is None:
        return []
    if isinstance(offsets, (str, bytes, torch.Tensor)) or not hasattr(offsets, "__iter__"):
        raise ValueError(f"offsets must be a list of {count} integers, one per tensor; got {offsets!r}")
    offsets = list(offsets)
    if len(offsets) != count or not all(
            isinstance(o, int) and not isinstance(o, bool) and 0 <= o <= 2**62 for o in offsets):
        raise ValueError(f"offsets must be {count} integers in [0, 2**62], one per tensor (the index of its element "
                         f"0 in its whole tensor's stochastic-rounding stream); got {offsets!r}")
    return offsets
