"""Calls into the native core with the stream and device handled."""

from __future__ import annotations

import contextlib

import torch

from . import _core
from ._formats import FORMAT_IDS, fp8_grid

__all__ = ["native_dequantize", "native_quantize"]


def _stream_and_device(t: torch.Tensor):
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream, torch.cuda.device(t.device)
    return 0, contextlib.nullcontext()


def _geometry(format: str, shape: torch.Size, n: int) -> tuple[int, int]:
    if format == "fp8":
        return fp8_grid(shape)
    return 0, 0


def native_quantize(format: str, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                    global_scale: torch.Tensor | None, block: int) -> None:
    """Writes the codes of contiguous `x` into `data` and its block scales into `scales` (same device)."""
    n = x.numel()
    if n == 0:
        return
    rows, cols = _geometry(format, x.shape, n)
    stream, ctx = _stream_and_device(x)
    with ctx:
        _core.quantize(FORMAT_IDS[format], x.reshape(-1), data, scales, global_scale, n, block, rows, cols, stream)


def native_dequantize(format: str, shape: torch.Size, data: torch.Tensor, scales: torch.Tensor,
                      global_scale: torch.Tensor | None, block: int, out: torch.Tensor) -> None:
    """Decodes `data`/`scales` into contiguous `out` (float32, bfloat16 or float16, same device)."""
    n = out.numel()
    if n == 0:
        return
    rows, cols = _geometry(format, shape, n)
    stream, ctx = _stream_and_device(out)
    with ctx:
        _core.dequantize(FORMAT_IDS[format], data, scales, global_scale, out.view(-1), n, block, rows, cols, stream)
