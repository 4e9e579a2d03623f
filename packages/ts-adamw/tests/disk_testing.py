"""What the disk tier's tests share (test_state_file.py, test_disk_state.py): AdamW's settings, the transfer
alignment, and helpers for aligned random data and a directory's entries."""

from __future__ import annotations

import os

import torch
import ts_adamw

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
BLOCK = 4096  # direct I/O's alignment: offsets and lengths of the transfers
MIB = 1 << 20


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` seeded random bytes in an aligned buffer (direct I/O can read and write it)."""
    out = ts_adamw.aligned_empty(nbytes)
    out.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return out


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))
