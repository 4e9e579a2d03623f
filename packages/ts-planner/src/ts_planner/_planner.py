"""Which blocks' weights stay in VRAM and which stream from host RAM.

Blocks that do not fit stream in: as few as possible (the smallest stay
resident first, so a larger budget never streams more), and among equals,
spread through the stack so each streamed block has resident neighbours whose
compute hides its copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Block", "ResidencyPlan", "plan_residency", "spread_order"]

GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of the repeated layer stack: its weight bytes, and whether they are trained
    (trained weights cross the link again as gradients)."""

    weight_bytes: int
    trained: bool = False


@dataclasses.dataclass(frozen=True)
class ResidencyPlan:
    resident: tuple[int, ...]
    streamed: tuple[int, ...]
    resident_bytes: int
    streamed_bytes: int
    link_bytes_per_step: int  # weights in for forward and backward, gradients out for trained blocks
    reason: str

    def link_seconds(self, gbps: float) -> float:
        """Time the streamed traffic of one step needs at `gbps` (GB/s, one direction)."""
        return self.link_bytes_per_step / (gbps * 1e9)


def spread_order(n: int) -> list[int]:
    """Block indices in the order they should start streaming: the bit-reversal permutation of
    the next power of two, restricted to [0, n). Every prefix is spread through the stack (the
    first m of 2^k land on every (2^k/m)-th block) and a longer prefix contains a shorter one. The one
    order of streamed blocks: the planner prices its first m, trainstream's runtime streams those m."""
    bits = max(1, (n - 1).bit_length())
    reverse = (int(f"{i:0{bits}b}"[::-1], 2) for i in range(1 << bits))
    return [i for i in reverse if i < n]


def plan_residency(blocks: Sequence[Block], vram_budget: int, host_budget: int) -> ResidencyPlan:
    """Keeps as many blocks resident as `vram_budget` (bytes) holds; the rest stream from host RAM,
    which must hold them within `host_budget` (bytes), else MemoryError with the numbers."""
    if not blocks:
        raise ValueError("plan_residency needs at least one block")
    if vram_budget < 0 or host_budget < 0:
        raise ValueError(f"budgets must be >= 0 bytes, got vram_budget={vram_budget}, host_budget={host_budget}")
    for i, b in enumerate(blocks):
        if not isinstance(b, Block) or b.weight_bytes < 0:
            raise ValueError(f"block {i} must be a Block with weight_bytes >= 0, got {b!r}")
    stream_rank = {index: rank for rank, index in enumerate(spread_order(len(blocks)))}
    # Keep the smallest first; among equals, keep last what should stream first.
    keep_order = sorted(range(len(blocks)), key=lambda i: (blocks[i].weight_bytes, -stream_rank[i]))
    resident, used = [], 0
    for i in keep_order:
        if used + blocks[i].weight_bytes > vram_budget:
            break
        resident.append(i)
        used += blocks[i].weight_bytes
    streamed = sorted(set(range(len(blocks))) - set(resident))
    streamed_bytes = sum(blocks[i].weight_bytes for i in streamed)
    if streamed_bytes > host_budget:
        raise MemoryError(
            f"{len(streamed)} blocks ({streamed_bytes / GiB:.2f} GiB) must stream from host RAM but only "
            f"{host_budget / GiB:.2f} GiB can hold them; quantize the frozen weights, free RAM or use fewer layers")
    link = sum(blocks[i].weight_bytes * (3 if blocks[i].trained else 2) for i in streamed)
    reason = ("every block fits in VRAM" if not streamed else
              f"{len(resident)} of {len(blocks)} blocks fit in {vram_budget / GiB:.2f} GiB of VRAM; "
              f"{len(streamed)} stream from host RAM ({streamed_bytes / GiB:.2f} GiB), spread through the stack")
    return ResidencyPlan(tuple(sorted(resident)), tuple(streamed), used, streamed_bytes, link, reason)
