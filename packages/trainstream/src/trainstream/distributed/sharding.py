"""Which rank owns which values of the trained parameters, and how their bytes are grouped for collectives.

Pure functions of sizes and ranks: every rank computes the same answer from the same model, so no
collective is needed to agree on it. The trained values, laid end to end in parameter order (each
parameter in its memory order), are cut into ``world`` ranges of equal length (``split_evenly``): rank r
owns the r-th, so each rank's share of the host state is 1/world of it to one value, however large the
largest tensor (ZeRO's even partition). A parameter is owned whole by one rank unless a cut falls inside
it; then each rank keeps a *piece*, one contiguous range of its values. ``assign_owners`` (whole tensors,
greedy by size) places what has no values to split: the frozen parameters, which may be unfrozen later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Bucket", "Piece", "assign_owners", "host_shares", "make_buckets", "split_evenly"]


def assign_owners(sizes: Sequence[int], world: int, loads: Sequence[int] | None = None) -> list[int]:
    """The owning rank of each item, balanced by size (bytes): largest first, each to the least loaded
    rank (ties: the lower rank, and among equal sizes the lower index first). Deterministic.

    ``loads`` are bytes the ranks already own (e.g. from an earlier call). The bound: no rank ends
    above the average load plus the largest item.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} is not valid; use an integer >= 1")
    load = [0] * world if loads is None else [int(x) for x in loads]
    if len(load) != world:
        raise ValueError(f"loads has {len(load)} entries for a world of {world} ranks")
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        if sizes[i] < 0:
            raise ValueError(f"item {i} has a negative size ({sizes[i]})")
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += int(sizes[i])
    return owners


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Items (indices into the caller's list) with one owner and one dtype, reduced or broadcast as one
    flat buffer of ``nbytes``."""

    owner: int
    dtype: object
    items: tuple[int, ...]
    nbytes: int


def make_buckets(owners: Sequence[int], nbytes: Sequence[int], dtypes: Sequence[object],
                 bucket_bytes: int) -> list[Bucket]:
    """Groups items (in index order) sharing an owner and a dtype into buckets of at most
    ``bucket_bytes`` (an item larger than that is a bucket alone). The order is the items' order of
    first appearance, the same on every rank."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} is not valid; use an integer >= 1")
    open_: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    done: list[tuple[int, Bucket]] = []  # (first item, bucket) to keep a stable order

    def close(key):
        items = open_.pop(key)
        done.append((items[0], Bucket(key[0], key[1], tuple(items), sizes.pop(key))))

    for i, (owner, size, dtype) in enumerate(zip(owners, nbytes, dtypes)):
        key = (owner, dtype)
        if key in open_ and sizes[key] + size > bucket_bytes:
            close(key)
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + int(size)
    for key in list(open_):
        close(key)
    return [b for _, b in sorted(done, key=lambda x: x[0])]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Values ``[lo, hi)`` (memory order) of parameter ``item``, owned by ``owner``."""

    item: int
    owner: int
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def split_evenly(numels: Sequence[int], world: int) -> list[list[Piece]]:
    """Each item's pieces, in order, covering its values once: the items' values laid end to end and cut
    at ``r * total // world`` for r = 1 .. world - 1 (module docstring). An item of no values has no piece."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} is not valid; use an integer >= 1")
    if any(n < 0 for n in numels):
        raise ValueError(f"negative sizes: {[n for n in numels if n < 0]}")
    total = sum(int(n) for n in numels)
    cuts = [r * total // world for r in range(world + 1)]
    pieces: list[list[Piece]] = []
    start, rank = 0, 0
    for item, n in enumerate(numels):
        end, mine = start + int(n), []
        while start < end:
            while cuts[rank + 1] <= start:
                rank += 1
            stop = min(end, cuts[rank + 1])
            mine.append(Piece(item, rank, start - (end - int(n)), stop - (end - int(n))))
            start = stop
        pieces.append(mine)
    return pieces


def host_shares(params: Sequence, world: int, rank: int) -> tuple[list, list]:
    """(`rank`'s share of the trained tensors `params`, the largest rank's share) as ``split_evenly``
    splits them: a tensor owned whole stands for itself, a piece is a flat view of its values. Host
    memory is planned on the largest share (every rank then makes the same choices) and page-locked for
    its own. One process: every tensor, twice."""
    params = list(params)
    if world < 2:
        return params, params
    pieces = split_evenly([p.numel() for p in params], world)
    shares: list[list] = [[] for _ in range(world)]
    for p, mine in zip(params, pieces):
        for piece in mine:
            whole = piece.numel == p.numel()
            shares[piece.owner].append(p if whole else p.detach().reshape(-1)[piece.lo:piece.hi])
    largest = max(shares, key=lambda share: sum(t.numel() * t.element_size() for t in share))
    return shares[rank], largest
