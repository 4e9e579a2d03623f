"""Which processes share this machine: the one rule behind every decision that splits a machine (the
page-lock budget and the plan's host RAM, the streamed weights' shared host copy, peer pools).

A machine is a key: hostname, boot id, and the device and inode of /dev/shm (ranks with equal keys share
its RAM and its /dev/shm; two containers on one host with separate /dev/shm count as two machines, as
they should for a shared copy). With an initialized process group of two or more ranks the keys are
gathered once (collective) and kept for that group; the count of ranks whose key is this rank's is the
answer. Without a group, the launcher's word (``ts_planner.local_process_count``: LOCAL_WORLD_SIZE,
SLURM_NTASKS_PER_NODE), else 1. With a group, the launcher's word is still used when it is set (no
collective then, so ``trainstream.plan()`` on one rank does not wait for the others); ``check_launcher``
compares it with the keys once every rank gathered them, and refuses a launcher that miscounted.
"""

from __future__ import annotations

import os
import socket

import torch
import ts_planner

__all__ = ["SHM_DIR", "check_launcher", "local_process_count", "machine_key", "machine_keys"]

SHM_DIR = "/dev/shm"

_keys: dict[int, list[str]] = {}  # id(the process group's world) -> every rank's key, gathered once


def machine_key() -> str:
    """This process's machine (module docstring)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        st = os.stat(SHM_DIR)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = "no-shm"
    return f"{socket.gethostname()}|{boot}|{shm}"


def _group_id() -> int | None:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return id(dist.group.WORLD)


def machine_keys() -> list[str] | None:
    """Every rank's machine key, in rank order (collective the first time for a process group); None
    without a group of two or more."""
    group = _group_id()
    if group is None:
        return None
    if group not in _keys:
        keys = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(keys, machine_key())
        _keys[group] = keys
    return _keys[group]


def local_process_count() -> int:
    """Processes on this machine that share its RAM: the launcher's word when it gives one, else (with a
    process group) the ranks whose machine key is this rank's, else 1."""
    from_launcher = any(os.environ.get(name, "").strip() for name in ts_planner.LOCAL_PROCESS_VARS)
    if from_launcher or _group_id() is None:
        return ts_planner.local_process_count()
    keys = machine_keys()
    return sum(k == keys[torch.distributed.get_rank()] for k in keys)


def check_launcher() -> None:
    """Collective (with a process group): ValueError when the launcher's count of local processes is not the
    number of ranks that share this machine, which would split its RAM wrongly."""
    keys = machine_keys()
    if keys is None:
        return
    here = sum(k == keys[torch.distributed.get_rank()] for k in keys)
    said = ts_planner.local_process_count()
    named = next((n for n in ts_planner.LOCAL_PROCESS_VARS if os.environ.get(n, "").strip()), None)
    if named is not None and said != here:
        raise ValueError(f"{named}={os.environ[named]!r} says {said} processes share this machine, but {here} ranks "
                         f"of the process group run on it (same hostname, boot id and /dev/shm); fix the launch, "
                         f"or unset {named} and trainstream counts them")
