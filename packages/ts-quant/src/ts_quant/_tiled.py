"""Dequantize-then-matmul with the dequantization hidden behind the matmul.

W [N, K] is split into row tiles; a side stream dequantizes tile i+1 into one
of two bf16 buffers while the caller's stream multiplies tile i into its
columns of the output. Memory: two tiles of bf16, never the whole weight.
"""

from __future__ import annotations

import math

import torch

from ._native import native_dequantize
from ._tensor import QuantizedTensor

__all__ = ["dequantize_rows", "tile_rows", "tiled_linear"]

_side_streams: dict[int, torch.cuda.Stream] = {}


def tile_rows(q: QuantizedTensor, tiles: int) -> int:
    """Rows per tile: about N / tiles, rounded so tiles start on whole scale blocks and 16-byte boundaries."""
    n, k = q.shape
    if q.format == "fp8":
        unit = q.block_size
    else:
        # tile values must be a multiple of the block and of 32 values (16 bytes of 4-bit codes)
        values = math.lcm(q.block_size, 32)
        unit = values // math.gcd(values, k)
    per_tile = math.ceil(n / max(1, tiles))
    return max(unit, math.ceil(per_tile / unit) * unit)


def dequantize_rows(q: QuantizedTensor, scales: torch.Tensor, r0: int, r1: int, out: torch.Tensor) -> None:
    """Decodes rows [r0, r1) of 2-D `q` into contiguous `out` ([r1 - r0, K]); r0 starts a scale block/tile.

    `scales`: q.block_scales() (taken once per call, so double quantization is undone once).
    """
    k = q.shape[1]
    rows = r1 - r0
    if q.format == "fp8":
        t = q.block_size
        data = q.data[r0 * k: r1 * k]
        scales = scales[r0 // t: math.ceil(r1 / t)]
    else:
        e0, e1 = r0 * k, r1 * k
        if q.format in ("nf4", "nvfp4"):
            data = q.data[e0 // 2: (e1 + 1) // 2]
        else:
            data = q.data[e0:e1]
        scales = scales.reshape(-1)[e0 // q.block_size: math.ceil(e1 / q.block_size)]
        if q.format == "nvfp4":
            scales = scales.view(torch.uint8)
    native_dequantize(q.format, torch.Size((rows, k)), data, scales, q.global_scale, q.block_size, out)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def _mm_into(x2d: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x2d, w.t(), out=out)
    else:
        torch.addmm(bias, x2d, w.t(), out=out)


def tiled_linear(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None, tiles: int,
                 overlap: bool = True) -> torch.Tensor:
    """x2d [M, K] @ dequantize(q)^T (+ bias) in row tiles of q; overlap=True (CUDA) pipelines on two streams."""
    n, k = q.shape
    m = x2d.shape[0]
    dtype, device = x2d.dtype, x2d.device
    rows = tile_rows(q, tiles)
    bounds = [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]
    out = torch.empty(m, n, dtype=dtype, device=device)
    buffers = [torch.empty(rows, k, dtype=dtype, device=device) for _ in range(min(2, len(bounds)))]
    scales = q.block_scales()
    if not overlap:
        for i, (r0, r1) in enumerate(bounds):
            buf = buffers[i % 2][: r1 - r0]
            dequantize_rows(q, scales, r0, r1, buf)
            _mm_into(x2d, buf, None if bias is None else bias[r0:r1], out[:, r0:r1])
        return out
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    side.wait_stream(main)  # the weight, scales and fresh buffers are ready in main's order
    done: list[torch.cuda.Event] = []
    for i, (r0, r1) in enumerate(bounds):
        buf = buffers[i % 2][: r1 - r0]
        ready = torch.cuda.Event()
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(done[i - 2])  # buffer i % 2 is free once matmul i - 2 has read it
            dequantize_rows(q, scales, r0, r1, buf)
            ready.record(side)
        main.wait_event(ready)
        _mm_into(x2d, buf, None if bias is None else bias[r0:r1], out[:, r0:r1])
        finished = torch.cuda.Event()
        finished.record(main)
        done.append(finished)
    # main waited for every tile, so the buffers are free in main's order when they are released
    return out
