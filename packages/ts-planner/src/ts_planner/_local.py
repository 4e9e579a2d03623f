"""How many training processes share this machine, from the launcher's environment."""

from __future__ import annotations

import os

__all__ = ["LOCAL_PROCESS_VARS", "local_process_count"]

# torchrun / accelerate set the first, Slurm the second; the first one set wins.
LOCAL_PROCESS_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def local_process_count() -> int:
    """Processes on this machine that share its host RAM (1 when no launcher says otherwise), so a
    planner gives each 1/n of the RAM and page-lock budget. Slurm's ``2(x3)`` form counts its first
    number. ValueError naming the variable when it is set to something that is not a count >= 1."""
    for name in LOCAL_PROCESS_VARS:
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        head = raw.split("(")[0].split(",")[0]
        if not head.isdigit() or int(head) < 1:
            raise ValueError(f"{name}={raw!r} is not a process count; set it to an integer >= 1 or unset it")
        return int(head)
    return 1
