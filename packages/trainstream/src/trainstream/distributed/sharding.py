"""Which rank owns which trained parameter, and how their bytes are grouped for collectives.

Pure functions of sizes and ranks: every rank computes the same answer from the same model, so no
collective is needed to agree on it. Parameters are owned whole (ZeRO-1/2 style: no tensor is split),
balanced by bytes with the greedy longest-first rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Bucket", "assign_owners", "host_shares", "make_buckets"]


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


def host_shares(sizes: Sequence[int], world: int, rank: int) -> tuple[list[int], list[int]]:
    """(indices of `rank`'s trained tensors, indices of the largest rank's) for tensors of `sizes` bytes
    owned as ``assign_owners`` assigns them: host memory is planned on the largest share (every rank then
    makes the same choices) and page-locked for its own. One process: all of them, twice."""
    if world < 2:
        every = list(range(len(sizes)))
        return every, every
    owners = assign_owners(sizes, world)
    shares = [[i for i, o in enumerate(owners) if o == r] for r in range(world)]
    largest = max(shares, key=lambda share: sum(sizes[i] for i in share))
    return shares[rank], largest
