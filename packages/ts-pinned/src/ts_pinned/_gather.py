"""Rows of a page-locked host table looked up by the GPU (csrc/gather.cu): the kernel reads the host
pages over the link, so a lookup needs neither the table in VRAM nor a host synchronization."""

from __future__ import annotations

import torch

from . import _core

__all__ = ["gather_rows"]


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``out[...] = table[ids[...]]`` on ``ids``' CUDA device, on its current stream, and returns ``out``.

    ``table``: a contiguous 2-D CPU tensor in page-locked memory (``ts_pinned.empty`` within the budget, or
    ``pin_memory()``); ``ids``: integer ids on a CUDA device; ``out``: ``ids.shape + table.shape[1:]`` of
    ``table``'s dtype on that device; ``bad``: one int32 in page-locked memory that the kernel sets to 1
    when an id lies outside ``[0, rows)`` (that row of ``out`` is zeros): read it after the stream passed."""
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError("gather_rows: table must be a contiguous 2-D tensor")
    if out.dtype != table.dtype or tuple(out.shape) != (*ids.shape, table.shape[1]) or not out.is_contiguous():
        raise ValueError(f"gather_rows: out must be contiguous {table.dtype} of shape {(*ids.shape, table.shape[1])}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"gather_rows: ids must be integers, got {ids.dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    stream = torch.cuda.current_stream(ids.device).cuda_stream if ids.device.type == "cuda" else 0
    _core.gather_rows(table.view(torch.uint8).view(table.shape[0], -1), flat, out.view(-1).view(torch.uint8),
                      bad.view(torch.int32).view(-1), stream)
    return out
