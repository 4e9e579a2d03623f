"""assign_blocks: which rank's pool holds which block; split_free_vram: how much each rank may pool.
Both pure (no GPU, no process group); pool_budgets in _support gathers their inputs."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_blocks", "split_free_vram"]


def _sizes(values: Sequence[int], name: str) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}[{i}]={v!r} must be an int >= 0 (bytes)")
        out.append(v)
    return out


def assign_blocks(block_bytes: Sequence[int], free_vram_per_rank: Sequence[int]) -> list[int | None]:
    """The owner rank of each block (``None``: it fits in no rank's pool and stays on the host).

    ``block_bytes[i]`` is block i's size and ``free_vram_per_rank[r]`` what rank r may spend on
    its pool, in bytes (leave headroom for activations before calling). Largest blocks first,
    each to the rank with the most room left (ties: the lower block index, the lower rank), so
    the pools fill evenly; deterministic, so every rank computes the same plan. No rank is given
    more than its free bytes, and a block left out is larger than any rank's room at the end.
    """
    sizes = _sizes(block_bytes, "block_bytes")
    room = _sizes(free_vram_per_rank, "free_vram_per_rank")
    owners: list[int | None] = [None] * len(sizes)
    if not room:
        return owners
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = max(range(len(room)), key=lambda r: (room[r], -r))
        if sizes[i] <= room[rank]:
            owners[i] = rank
            room[rank] -= sizes[i]
    return owners


def split_free_vram(gpus: Sequence[str], free_bytes: Sequence[int], fraction: float = 0.5) -> list[int]:
    """Each rank's pool budget in bytes: ``fraction`` of its GPU's free bytes, shared evenly by the
    ranks on that GPU (``gpus[r]`` names rank r's GPU, e.g. its PCI bus id; ranks on one GPU see
    the same free memory, which must not be counted twice). Pure."""
    if len(gpus) != len(free_bytes):
        raise ValueError(f"gpus has {len(gpus)} entries, free_bytes {len(free_bytes)}: one per rank")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction={fraction!r} must be a number in [0, 1]")
    free = _sizes(free_bytes, "free_bytes")
    sharing = {g: gpus.count(g) for g in gpus}
    # A GPU's free bytes as the lowest report of its ranks (they were measured at different instants).
    lowest = {g: min(f for gg, f in zip(gpus, free) if gg == g) for g in sharing}
    return [int(lowest[g] * fraction) // sharing[g] for g in gpus]
