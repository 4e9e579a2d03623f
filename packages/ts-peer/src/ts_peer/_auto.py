"""pool_blocks: the whole set-up in one collective call, for a weight streamer's ``peer="auto"``:
check support, size each rank's budget, assign the blocks, place this rank's, exchange."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ._native import gather, rank_and_world
from ._plan import assign_blocks
from ._pool import PeerPool, _as_bytes
from ._support import peer_support, pool_budgets

__all__ = ["pool_blocks"]


def pool_blocks(blocks: Mapping, group=None, *, device: torch.device | str | None = None, fraction: float = 0.5,
                budgets: Sequence[int] | None = None, backend: str = "cuda") -> tuple[PeerPool | None, str]:
    """Collective: ``(pool, reason)``, or ``(None, reason)`` when peer pools cannot be used here.

    ``blocks``: {block_id: tensor or bytes}, the same ids and sizes on every rank (each rank
    holds every block's host copy; only the owner's is read). ``fraction``: of each GPU's free
    memory the pools may take, split among the ranks sharing a GPU (or pass ``budgets``, bytes
    per rank). ``backend="host"`` runs the same protocol on the CPU (no support check). Blocks
    that fit in no budget are left out: ``block_id in pool`` says which came along.
    """
    if backend not in ("cuda", "host"):
        raise ValueError(f"backend={backend!r} is not a backend for pool_blocks; use cuda or host")
    rank, world = rank_and_world(group)
    if backend == "cuda":
        ok, reason = peer_support(group, device)
        if not ok:
            return None, reason
    sizes = {block_id: _as_bytes(data, block_id).numel() for block_id, data in blocks.items()}
    every = gather(sizes, group, world)
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            differ = sorted(set(theirs.items()) ^ set(every[0].items()), key=repr)[:3]
            raise ValueError(f"pool_blocks: rank {r}'s blocks differ from rank 0's (first differences, "
                             f"(id, bytes): {differ}); every rank must pass the same blocks")
    ids = list(every[0])
    if budgets is None:
        budgets = pool_budgets(group, device, fraction) if backend == "cuda" else [sum(sizes.values())] * world
    if len(budgets) != world:
        raise ValueError(f"budgets has {len(budgets)} entries for a group of {world} ranks")
    owners = assign_blocks([sizes[i] for i in ids], list(budgets))
    pool = PeerPool(group, device=device, backend=backend)
    for block_id, owner in zip(ids, owners):
        if owner == rank:
            pool.place(block_id, blocks[block_id])
    pool.exchange()
    pooled = [i for i, o in zip(ids, owners) if o is not None]
    pooled_bytes = sum(sizes[i] for i in pooled)
    return pool, (f"{len(pooled)} of {len(ids)} blocks ({pooled_bytes} bytes) pooled across {world} ranks; "
                  f"{len(ids) - len(pooled)} left with their host source")
