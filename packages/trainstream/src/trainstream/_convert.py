"""Turning the user's optimizer into an OffloadAdamW, hyper-parameters and state included."""

from __future__ import annotations

import torch

from ._optimizer import OffloadAdamW, check_hyper

__all__ = ["to_offload_adamw"]

_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize")
_DROPPED = ("amsgrad", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")


def _check_group(group: dict, kind: str, number: int) -> None:
    if isinstance(group.get("lr"), torch.Tensor):
        raise ValueError(f"param group {number} has a tensor lr; use a float")
    check_hyper(group, f"param group {number}: ")
    if kind == "Adam" and group.get("weight_decay", 0.0):
        raise ValueError(f"param group {number}: torch.optim.Adam's weight_decay is an L2 penalty, not AdamW's "
                         "decoupled decay; use torch.optim.AdamW, or weight_decay=0")


def to_offload_adamw(optimizer, model: torch.nn.Module, lr: float) -> tuple[OffloadAdamW, dict[int, dict]]:
    """(OffloadAdamW, existing state by parameter id). AdamW / Adam are converted (groups and
    state copied; the user's optimizer is not changed), an OffloadAdamW is used as is with the
    state it kept from an earlier unwrap(), None makes one over the model's trainable parameters."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        return OffloadAdamW(params, lr=lr), {}
    if isinstance(optimizer, OffloadAdamW):
        if optimizer._session is not None:
            raise ValueError("this OffloadAdamW is attached to a wrapped model; unwrap that model first")
        return optimizer, {id(p): dict(s) for p, s in optimizer.state.items() if s}
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(f"wrap() takes torch.optim.AdamW, torch.optim.Adam, trainstream.OffloadAdamW or None, "
                         f"not {kind}")
    groups = []
    for number, group in enumerate(optimizer.param_groups):
        _check_group(group, kind, number)
        converted = {k: group[k] for k in _KEYS if k in group}
        converted["params"] = list(group["params"])
        # Keys schedulers or users added (initial_lr, names...) come along.
        converted.update({k: v for k, v in group.items() if k not in _KEYS and k != "params" and k not in _DROPPED})
        groups.append(converted)
    state = {id(p): dict(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]
             if optimizer.state.get(p)}
    return OffloadAdamW(groups), state
