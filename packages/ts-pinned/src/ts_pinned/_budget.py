"""How much memory this process may page-lock: the probe the planner uses."""

from __future__ import annotations

import resource
from dataclasses import dataclass

from . import _core

__all__ = ["PageLockBudget", "page_lock_budget"]


@dataclass(frozen=True)
class PageLockBudget:
    """Limits on page-locking, in bytes. ``memlock_limit`` is ``None`` when unlimited.

    ``mem_available`` / ``mem_total`` are the host's RAM as this process may use it:
    /proc/meminfo, bounded by the cgroup memory limit (v1 or v2) where one is set,
    since a container is killed at its limit whatever /proc/meminfo says.
    ``memory_source`` says which bounds ``mem_available`` ("meminfo", "cgroup v1",
    "cgroup v2"); ``cgroup_limit`` is the limiting cgroup's limit (``None``: none).

    ``budget`` is what a caller may page-lock: ``fraction`` of available RAM, and
    no more than the memlock limit where one applies. (The CUDA driver's own
    allocations are usually exempt from RLIMIT_MEMLOCK, but containers and
    cudaHostRegister are not, so the smaller value is the safe plan.)
    """

    memlock_limit: int | None
    mem_available: int
    mem_total: int
    budget: int
    memory_source: str = "meminfo"
    cgroup_limit: int | None = None


def page_lock_budget(fraction: float = 0.8) -> PageLockBudget:
    """Measures the memlock limit and available RAM (cgroup-bounded); ``fraction`` (0, 1] of it is the budget."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    memlock = None if soft == resource.RLIM_INFINITY else int(soft)
    info = _core.host_memory()
    available = info["available"]
    budget = int(available * fraction)
    # A tiny default memlock (64 KiB) means the limit is not enforced for the
    # CUDA driver's allocations in practice; only a deliberately raised limit
    # is a real plan bound.
    if memlock is not None and memlock >= (1 << 30):
        budget = min(budget, memlock)
    return PageLockBudget(memlock, available, info["total"], budget, info["source"], info["cgroup_limit"])
