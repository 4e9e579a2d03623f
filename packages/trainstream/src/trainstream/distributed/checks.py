"""Every rank must train the same model: the same parameters (names, shapes, dtypes, trainable or
not), in the same optimizer groups with the same hyper-parameters and engine settings.

``check_same_model`` compares one SHA-256 digest per rank (one small all-gather); only when they
differ are the descriptions gathered, so every rank raises the same error naming the first
difference. Shards, buckets and collectives all assume this holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .collectives import Comm

__all__ = ["ModelMismatch", "check_same_model", "describe_slots", "first_mismatch"]

_HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")


class ModelMismatch(ValueError):
    """The ranks of a data-parallel run were given different models, optimizers or settings."""


def describe_slots(slots: Sequence, settings: dict | None = None) -> list[str]:
    """One line per optimizer parameter (index, name, shape, dtype, trainable, group hyper-parameters),
    and a first line for the engine settings that must agree."""
    lines = ["settings " + ", ".join(f"{k}={v!r}" for k, v in sorted((settings or {}).items()))]
    groups: dict[int, int] = {}
    for s in slots:
        number = groups.setdefault(id(s.group), len(groups))
        hyper = ", ".join(f"{k}={s.group.get(k)!r}" for k in _HYPER)
        p = s.param
        lines.append(f"parameter {s.index} ({s.name or 'unnamed'}): {str(p.dtype).removeprefix('torch.')} "
                     f"{list(p.shape)} requires_grad={p.requires_grad} in param group {number} ({hyper})")
    return lines


def _digest(lines: list[str]) -> bytes:
    return hashlib.sha256("\n".join(lines).encode()).digest()


def first_mismatch(per_rank: list[list[str]]) -> str | None:
    """None when every rank's description is the same, else a sentence naming the first difference."""
    base = per_rank[0]
    for rank, lines in enumerate(per_rank[1:], start=1):
        if lines == base:
            continue
        for i in range(max(len(base), len(lines))):
            a = base[i] if i < len(base) else "(nothing)"
            b = lines[i] if i < len(lines) else "(nothing)"
            if a != b:
                what = "the engine settings differ" if i == 0 else f"the optimizer's parameter {i - 1} differs"
                return f"{what}: rank 0 has {a!r}, rank {rank} has {b!r}"
    return None


def check_same_options(comm: Comm, options: dict) -> None:
    """ModelMismatch on every rank when the ranks' wrap() options that decide which collectives the set-up
    runs differ (streamed blocks, peer pools, attention agreement): run before that set-up, so a rank
    streaming weights never pairs its collectives with another rank's model check."""
    lines = [f"{key}={value!r}" for key, value in sorted(options.items())]
    digests = comm.all_gather_bytes(_digest(lines), "the check that every rank passes the same wrap() options")
    if all(d == digests[0] for d in digests):
        return
    gathered = comm.all_gather_bytes("\n".join(lines).encode(), "gathering the wrap() options")
    per_rank = [g.decode().split("\n") for g in gathered]
    rank, (mine, theirs) = next((r, pair) for r, lines_r in enumerate(per_rank) if lines_r != per_rank[0]
                                for pair in zip(per_rank[0], lines_r) if pair[0] != pair[1])
    raise ModelMismatch(f"data parallel: the ranks were given different wrap() options: rank 0 has {mine}, rank "
                        f"{rank} has {theirs}. Pass the same options on every rank")


def check_same_model(comm: Comm, slots: Sequence, settings: dict | None = None) -> None:
    """ModelMismatch on every rank when the ranks' models differ (see the module docstring);
    DistributedError when a rank does not take part within the timeout."""
    lines = describe_slots(slots, settings)
    digests = comm.all_gather_bytes(_digest(lines), "the check that every rank wraps the same model")
    if all(d == digests[0] for d in digests):
        return
    gathered = comm.all_gather_bytes("\n".join(lines).encode(), "gathering the model descriptions")
    problem = first_mismatch([g.decode().split("\n") for g in gathered])
    raise ModelMismatch(f"data parallel: the ranks were given different models: {problem}. Build the same model "
                        f"and optimizer (same parameters, order, dtypes, frozen parameters, hyper-parameters) "
                        f"and pass the same wrap() options on every rank")
