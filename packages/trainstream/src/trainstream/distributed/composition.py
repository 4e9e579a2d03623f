"""Which parallel wrappers wrap() composes with, decided before anything changes.

trainstream's data parallel reduces gradients itself and keeps whole (replicated) parameters. A model
under ``DistributedDataParallel`` would have every gradient reduced twice: refused. A model sharded by
FSDP2 (``fully_shard``) composes: each rank trains its own shards (``distributed/fsdp.py``, which checks
the sharding it takes). The older ``FullyShardedDataParallel`` and DTensor parameters outside FSDP2
(tensor parallel) are refused at ``plan()`` / ``wrap()`` with the way that works; a ``fully_shard()``
applied after ``wrap()`` replaces the parameters under the optimizer, which the engine's forward guard
refuses at the next forward (``engine/guard.py``).
"""

from __future__ import annotations

import torch

from ..engine.slots import is_dtensor
from .fsdp import check_sharded, sharded_by_fsdp2

__all__ = ["WAYS", "check_composable"]

WAYS = ("use trainstream's own data parallel instead (wrap() the plain model in every process of an initialized "
         "process group, e.g. under torchrun: gradients are averaged once and each rank keeps its share of the "
         "optimizer state), or keep the wrapper with torch's own optimizer")


def check_composable(model: torch.nn.Module) -> None:
    """ValueError for a model under DistributedDataParallel or FullyShardedDataParallel, with DTensor
    parameters outside FSDP2, or sharded by FSDP2 in a way trainstream does not take (fsdp.check_sharded)."""
    fsdp2 = sharded_by_fsdp2(model)
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            where = "the model is" if not name else f"{name!r} is"
            raise ValueError(f"{where} under DistributedDataParallel: its gradient reduction and trainstream's "
                             f"would both run. Pass the module inside (model.module) to wrap(): {WAYS}")
        if kind == "FullyShardedDataParallel":
            where = "the model" if not name else f"{name!r}"
            raise ValueError(f"{where} is sharded by FullyShardedDataParallel (FSDP1), which wrap() does not "
                             f"compose with: shard it with FSDP2's fully_shard() instead, or {WAYS}")
    if fsdp2:
        check_sharded(model)
        return
    sharded = next((n for n, p in model.named_parameters() if is_dtensor(p)), None)
    if sharded is not None:
        raise ValueError(f"parameter {sharded!r} is a DTensor (tensor parallel or FSDP sharding), which wrap() "
                         f"does not take yet: {WAYS}")
