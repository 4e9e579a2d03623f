"""Turning the user's optimizer into an OffloadAdamW, hyper-parameters and state included."""

from __future__ import annotations

import torch

from ._optimizer import OffloadAdamW

__all__ = ["to_offload_adamw"]

_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize")


def _check_group(group: dict, kind: str, number: int) -> None:
    if group.get("amsgrad"):
        raise ValueError(f"param group {number} uses amsgrad=True, which OffloadAdamW does not support; "
                         "use amsgrad=False")
    if kind == "Adam" and group.get("weight_decay", 0.0):
        raise ValueError(f"param group {number}: torch.optim.Adam's weight_decay is an L2 penalty, not AdamW's "
                         "decoupled decay; use torch.optim.AdamW, or weight_decay=0")
    if isinstance(group.get("lr"), torch.Tensor):
        raise ValueError(f"param group {number} has a tensor lr; use a float")


def to_offload_adamw(optimizer, model: torch.nn.Module, lr: float) -> OffloadAdamW:
    """AdamW / Adam (groups and existing state migrated), an OffloadAdamW as is, or
    None (one group of the model's trainable parameters with `lr`)."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        return OffloadAdamW(params, lr=lr)
    if isinstance(optimizer, OffloadAdamW):
        return optimizer
    kind = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(f"wrap() takes torch.optim.AdamW, torch.optim.Adam, trainstream.OffloadAdamW or None, "
                         f"not {kind}")
    groups = []
    for number, group in enumerate(optimizer.param_groups):
        _check_group(group, kind, number)
        extra = {k: v for k, v in group.items() if k not in _KEYS and k != "params"}
        converted = {k: group[k] for k in _KEYS if k in group}
        converted["params"] = list(group["params"])
        # Keys schedulers or users added (initial_lr, names...) come along.
        converted.update({k: v for k, v in extra.items()
                          if k not in ("amsgrad", "foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")})
        groups.append(converted)
    converted_optimizer = OffloadAdamW(groups)
    converted_optimizer._migrated_state = {
        id(p): dict(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"] if optimizer.state.get(p)
    }
    return converted_optimizer
