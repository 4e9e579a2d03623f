"""Format names, default block sizes and argument validation."""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_BLOCK", "FORMATS", "FORMAT_IDS", "check_block", "check_format", "check_input", "fp8_grid"]

FORMATS = ("int8", "nf4", "fp8", "nvfp4")
FORMAT_IDS = {name: i for i, name in enumerate(FORMATS)}
# Values per scale: int8/nf4 blocks of the flattened tensor, fp8 square tiles
# (edge), nvfp4 blocks of 16 (fixed by the tensor-core format).
DEFAULT_BLOCK = {"int8": 64, "nf4": 64, "fp8": 128, "nvfp4": 16}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_format(format: str) -> str:
    """The format name, or ValueError naming the valid ones."""
    if format not in FORMATS:
        raise ValueError(f'quantize="{format}" is not a format; use one of {", ".join(FORMATS)}')
    return format


def check_block(format: str, block_size: int | None) -> int:
    """The block size for `format` (values per scale; fp8: tile edge), validated."""
    if block_size is None:
        return DEFAULT_BLOCK[format]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    if format == "nvfp4" and block_size != 16:
        raise ValueError(f"block_size={block_size} is not valid for nvfp4: its blocks are always 16 values")
    if format in ("int8", "nf4") and block_size % 2:
        raise ValueError(f"block_size={block_size} must be even for {format} (two 4-bit codes share a byte)")
    return block_size


def check_input(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous, detached float32/bfloat16/float16 view of `tensor` (float64 is narrowed to float32)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype == torch.float64:
        tensor = tensor.float()
    if tensor.dtype not in INPUT_DTYPES:
        raise ValueError(f"quantize: dtype {tensor.dtype} is not supported; use float32, bfloat16 or float16")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantize: device {tensor.device} is not supported; use a CPU or CUDA tensor")
    return tensor.detach().contiguous()


def fp8_grid(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of the 2-D view fp8 tiles: the last dim is cols (a 0-d tensor is 1 x 1)."""
    cols = shape[-1] if len(shape) else 1
    numel = 1
    for s in shape:
        numel *= s
    return (numel // cols if cols else 0), cols
