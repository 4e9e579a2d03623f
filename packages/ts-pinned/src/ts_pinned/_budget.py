"""How much memory this process may page-lock: the probe the planner uses."""

from __future__ import annotations

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
    no more than the memlock limit where one was raised on purpose (1 GiB or
    more: the small distribution defaults do not bind the CUDA driver's own
    page-locking). Containers and cudaHostRegister do honour a raised limit,
    so the smaller value is the safe plan.
    """

    memlock_limit: int | None
    mem_available: int
    mem_total: int
    budget: int
    memory_source: str = "meminfo"
    cgroup_limit: int | None = None


def page_lock_budget(fraction: float = 0.8, processes: int = 1) -> PageLockBudget:
    """Measures the memlock limit and available RAM (cgroup-bounded); the budget is ``fraction`` (0, 1] of
    this process's share of it (``processes`` on the machine split it evenly), by the rule every core shares
    (``_core.page_lock_budget_bytes``, native/src/page_lock.cpp)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r} must be an integer >= 1")
    memlock = _core.memlock_limit()
    info = _core.host_memory()
    available = info["available"]
    budget = _core.page_lock_budget_bytes(available, fraction, processes, memlock)
    return PageLockBudget(memlock, available, info["total"], budget, info["source"], info["cgroup_limit"])
