"""activation_offload='auto' / recompute='auto': keep, page or recompute each block, by measurement.

The probe (the first forward with gradients on): one block's saved tensors (the second block's when there
are two or more: policy.py's ``_probe``) are paged and counted,
and its forward is timed; from that and the VRAM under the target, ``choose()`` decides the other
blocks before they run, so the probe itself fits. After each of the first steps the measured peak
corrects the VRAM estimate (the loss, the output layer and backward's working memory are only known
then), and a few trials, one step each, time the candidate settings; the fastest is kept and the
policy settles. Every decision is an event.

``choose()`` is a pure function of the measurements, so its rules are tested on their own:
- keep the latest blocks while their activations fit in the room (backward reaches them first);
- of the others, page as many as host memory holds and the link can carry while compute runs
  (forward carries the pages out, backward brings them back beside the optimizer's uploads),
  spread among them so recomputed blocks between paged ones give the copies time;
- recompute the rest.
More room never pages or recomputes more blocks.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Choice", "Measured", "choose"]

# Copies overlap compute imperfectly at a block's edges: plan for this share of the link's rate.
LINK_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the probe measured (bytes, seconds, bytes per second)."""

    blocks: int
    block_bytes: int  # saved activations of one block
    forward_s: float  # one block's forward
    link_bytes_per_s: float  # the slower direction of the pinned link
    room_bytes: int  # VRAM under the target for kept activations
    host_bytes: int  # host memory the pages may take
    reserved_link_bytes: int = 0  # host->device bytes backward already moves (uploads, streamed weights)


@dataclasses.dataclass(frozen=True)
class Choice:
    kept: tuple[int, ...]
    paged: tuple[int, ...]
    recomputed: tuple[int, ...]

    def policy(self, blocks: int) -> list[str]:
        kinds = ["keep"] * blocks
        for i in self.paged:
            kinds[i] = "offload"
        for i in self.recomputed:
            kinds[i] = "recompute"
        return kinds


def link_capacity(m: Measured) -> int:
    """Blocks whose pages the link can carry out during forward and back during backward."""
    if m.block_bytes <= 0:
        return m.blocks
    forward = m.blocks * m.forward_s
    out = forward * m.link_bytes_per_s * LINK_SHARE
    back = 2.0 * forward * m.link_bytes_per_s * LINK_SHARE - m.reserved_link_bytes  # backward ~ 2x forward
    return max(0, int(min(out, back) // m.block_bytes))


def kept_count(m: Measured) -> int:
    if m.block_bytes <= 0:
        return m.blocks
    return max(0, min(m.blocks, int(m.room_bytes // m.block_bytes)))


def spread(count: int, among: int) -> list[int]:
    """`count` indices spread evenly over range(among)."""
    if count <= 0:
        return []
    return sorted({min(among - 1, math.floor((i + 0.5) * among / count)) for i in range(count)})


def choose(m: Measured, *, page: bool = True, recompute: bool = True, paged: int | None = None) -> Choice:
    """The policy for these measurements. ``page`` / ``recompute`` False forbid that path (a block
    that can go nowhere is kept: the caller warns). ``paged`` overrides how many of the blocks that
    do not fit are paged (a trial); it is still bounded by host memory."""
    keep = kept_count(m)
    rest = m.blocks - keep
    host_cap = m.blocks if m.block_bytes <= 0 else int(max(0, m.host_bytes) // m.block_bytes)
    if not page:
        count = 0
    elif not recompute:
        count = min(rest, host_cap)
    else:
        count = min(rest, host_cap, link_capacity(m) if paged is None else paged)
    count = max(0, count)
    paged_blocks = spread(count, rest)
    others = [i for i in range(rest) if i not in set(paged_blocks)]
    recomputed = others if recompute else []
    kept = [i for i in range(m.blocks) if i not in set(paged_blocks) and i not in set(recomputed)]
    return Choice(tuple(kept), tuple(paged_blocks), tuple(recomputed))


def trial_candidates(m: Measured, *, page: bool, recompute: bool) -> list[Choice]:
    """The settings worth timing: the planned one, all recomputed, and as many paged as host memory
    holds (distinct ones only, the planned one first)."""
    planned = choose(m, page=page, recompute=recompute)
    options = [planned]
    if page and recompute:
        options.append(choose(m, page=page, recompute=recompute, paged=0))
        options.append(choose(m, page=page, recompute=recompute, paged=m.blocks))
    unique = []
    for c in options:
        if c not in unique:
            unique.append(c)
    return unique
