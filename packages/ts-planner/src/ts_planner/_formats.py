"""Stored bytes of a weight matrix by format, following ts-quant's layouts (ts-planner does not import
ts-quant; a test compares these numbers with ts_quant.quantize(...).nbytes)."""

from __future__ import annotations

import math

__all__ = ["DTYPE_BYTES", "WEIGHT_FORMATS", "weight_bytes"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# None: the compute dtype as is. int8 / nf4: blocks of 64 values with an fp32 scale each; fp8: e4m3 values
# with an fp32 scale per 128 x 128 tile; nvfp4: 4-bit values with an e4m3 scale per 16 plus one fp32 scale.
WEIGHT_FORMATS = (None, "int8", "nf4", "fp8", "nvfp4")
_BLOCK = {"int8": 64, "nf4": 64, "fp8": 128, "nvfp4": 16}


def weight_bytes(rows: int, cols: int, format: str | None, dtype_bytes: int = 2) -> int:
    """Bytes of a [rows, cols] weight stored in `format` (None: `dtype_bytes` per value), scales included."""
    n = rows * cols
    if format is None:
        return n * dtype_bytes
    block = _BLOCK.get(format)
    if block is None:
        raise ValueError(f"quantize={format!r} is not a format; use one of int8, nf4, fp8, nvfp4 (or None)")
    if format == "int8":
        return n + 4 * math.ceil(n / block)
    if format == "nf4":
        return (n + 1) // 2 + 4 * math.ceil(n / block)
    if format == "fp8":
        return n + 4 * math.ceil(rows / block) * math.ceil(cols / block)
    return (n + 1) // 2 + math.ceil(n / block) + 4  # nvfp4
