"""Which parallel wrappers wrap() composes with, decided before anything changes.

trainstream's data parallel reduces gradients itself and keeps whole (replicated) parameters. A model
under ``DistributedDataParallel`` would have every gradient reduced twice; FSDP (``fully_shard``, or the
older ``FullyShardedDataParallel``) and tensor parallel hold DTensor shards that the engine's host
updates and buckets do not take yet. Both are refused at ``plan()`` / ``wrap()`` with the way that
works; a ``fully_shard()`` applied after ``wrap()`` replaces the parameters under the optimizer, which
the engine's forward guard refuses at the next forward (``engine/guard.py``).
"""

from __future__ import annotations

import torch

from ..engine.slots import is_dtensor

__all__ = ["WAYS", "check_composable"]

WAYS = ("use trainstream's own data parallel instead (wrap() the plain model in every process of an initialized "
         "process group, e.g. under torchrun: gradients are averaged once and each rank keeps its share of the "
         "optimizer state), or keep the wrapper with torch's own optimizer")


def check_composable(model: torch.nn.Module) -> None:
    """ValueError for a model under DistributedDataParallel or FSDP, or with DTensor parameters."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            where = "the model is" if not name else f"{name!r} is"
            raise ValueError(f"{where} under DistributedDataParallel: its gradient reduction and trainstream's "
                             f"would both run. Pass the module inside (model.module) to wrap(): {WAYS}")
        if kind == "FullyShardedDataParallel" or any(c.__name__ == "FSDPModule" for c in type(module).__mro__):
            where = "the model" if not name else f"{name!r}"
            raise ValueError(f"{where} is sharded by FSDP (fully_shard / FullyShardedDataParallel), which wrap() "
                             f"does not compose with yet (its parameters are DTensor shards): {WAYS}")
    sharded = next((n for n, p in model.named_parameters() if is_dtensor(p)), None)
    if sharded is not None:
        raise ValueError(f"parameter {sharded!r} is a DTensor (tensor parallel or FSDP sharding), which wrap() "
                         f"does not take yet: {WAYS}")
