"""Which trained parameters keep their optimizer state on disk (``nvme_path=``): the one rule.

The disk tier holds a parameter's fp32 master weights and both AdamW moments in a scratch file
(ts-adamw's ``DiskState``); host RAM keeps its gradient landing buffer and the buffer its rounded weight
is uploaded from, plus a few staging buffers the tier reads and writes through. The plan puts on disk the
least state with which host RAM fits its budget, taking first the parameters registered last: backward
reaches them first, so their updates (a read, the update, a write) have the most time to finish before
``step()`` returns. Parameters smaller than ``MIN_DISK_VALUES`` stay in RAM (their bytes save little and
each costs a transfer).

Staging buffers are pageable: they move bytes between the file and host memory only, never over the
GPU link, so page-locking them would take from the page-lock budget for nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch
import ts_adamw

__all__ = [
    "MIN_DISK_VALUES",
    "STAGING_DEPTH",
    "DiskChoice",
    "check_disk_directory",
    "choose_disk_state",
    "disk_free_bytes",
    "disk_state_bytes",
    "ram_bytes_on_disk",
    "segment_values",
    "staging_bytes",
]

MIN_DISK_VALUES = 1 << 16
STAGING_DEPTH = ts_adamw.DiskState.DEFAULT_DEPTH  # read ahead, update, write behind


def disk_state_bytes(param: torch.Tensor, moment_bytes: int) -> int:
    """Bytes one parameter's state takes in the file: fp32 master and two moments."""
    return param.numel() * (4 + 2 * moment_bytes)


def ram_bytes_on_disk(param: torch.Tensor) -> int:
    """Host RAM a parameter keeps while its state is on disk: the gradient landing buffer and the upload
    buffer of its rounded weight (which the fp32 master no longer doubles as)."""
    return 2 * param.numel() * param.element_size()


def segment_values(disk_values: int) -> int:
    """Values per transfer of the tier: ts-adamw's default (large transfers keep the disk at its rate), or an
    eighth of the state when that is smaller, so the staging of a small tier stays small beside it."""
    quantum = ts_adamw.DiskState.SEGMENT_QUANTUM
    eighth = -(-max(disk_values // 8, 1) // quantum) * quantum
    return min(ts_adamw.DiskState.DEFAULT_SEGMENT_VALUES, eighth)


def staging_bytes(disk_values: int, moment_dtype: torch.dtype) -> int:
    """Host RAM of the tier's staging sets for ``disk_values`` values on disk."""
    if disk_values == 0:
        return 0
    return STAGING_DEPTH * ts_adamw.DiskState.staging_bytes(segment_values(disk_values), moment_dtype)


@dataclasses.dataclass(frozen=True)
class DiskChoice:
    """The parameters (positions in the list planned) whose state goes to disk, and what that leaves."""

    on_disk: tuple[int, ...]
    ram_bytes: int  # host RAM of every parameter's state with these on disk, staging included
    disk_bytes: int  # bytes of the scratch file
    staging_bytes: int


def choose_disk_state(params: list[torch.Tensor], ram_bytes_in_ram: list[int], moment_dtype: torch.dtype,
                      budget: int) -> DiskChoice:
    """The fewest parameters, last registered first, whose state moved to disk lets the whole state fit in
    ``budget`` bytes of host RAM (``ram_bytes_in_ram``: each parameter's bytes with its state in RAM). When
    even every eligible parameter on disk does not fit, all eligible ones are chosen: the caller refuses
    with the numbers."""
    moment_bytes = torch.empty((), dtype=moment_dtype).element_size()
    ram = sum(ram_bytes_in_ram)
    chosen: list[int] = []
    disk_values = 0
    for i in reversed(range(len(params))):
        if ram + staging_bytes(disk_values, moment_dtype) <= budget:
            break
        if params[i].numel() < MIN_DISK_VALUES:
            continue
        chosen.append(i)
        disk_values += params[i].numel()
        ram += ram_bytes_on_disk(params[i]) - ram_bytes_in_ram[i]
    staging = staging_bytes(disk_values, moment_dtype)
    disk = sum(disk_state_bytes(params[i], moment_bytes) for i in chosen)
    return DiskChoice(tuple(sorted(chosen)), ram + staging, disk, staging)


def check_disk_directory(path: str) -> None:
    """ValueError naming ``path`` when it is not a directory this process can create files in."""
    if not os.path.isdir(path):
        raise ValueError(f"nvme_path={path!r} is not a directory; create it (on a fast local disk) or pass another")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"nvme_path={path!r} is not writable by this process (or is on a read-only filesystem); "
                         f"pass a directory it can create files in")


def disk_free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free
