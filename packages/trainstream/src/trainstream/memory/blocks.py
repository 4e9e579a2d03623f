"""find_blocks: the repeated layer stack of a model (what weight paging and the planner work on)."""

from __future__ import annotations

import torch

__all__ = ["find_blocks"]


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest ``ModuleList`` / ``Sequential`` whose children (at least 2) are all of one type,
    measured in parameter values (ties: more children); ``[]`` when the model has none."""
    best, best_key = [], (0, 0)
    for module in model.modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        key = (sum(p.numel() for p in module.parameters()), len(children))
        if key > best_key:
            best, best_key = children, key
    return best
