"""Block-scale layout of the FP4/FP8 block-scaled tensor cores (Blackwell).

cuBLAS ("1D block scaling factors layout") and torch's SWIZZLE_32_4_4 store a
[rows, k_blocks] scale matrix in tiles of 128 rows x 4 k-blocks, tiles in
row-major order, 512 bytes each; inside a tile, scale (r, c) sits at byte
(r % 32) * 16 + (r // 32) * 4 + c. Rows pad to 128 and k-blocks to 4 with zeros.
"""

from __future__ import annotations

import torch

__all__ = ["swizzle_block_scales", "swizzled_size"]


def swizzled_size(rows: int, k_blocks: int) -> int:
    """Entries of the swizzled layout for a [rows, k_blocks] scale matrix (padding included)."""
    return -(-rows // 128) * 128 * -(-k_blocks // 4) * 4


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """The [rows, k_blocks] scales rearranged into the tensor-core layout, flat, same dtype and device."""
    rows, k_blocks = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-k_blocks // 4)
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    padded = raw.new_zeros(row_tiles * 128, col_tiles * 4)
    padded[:rows, :k_blocks] = raw
    # [tile row, r // 32, r % 32, tile col, c] -> [tile row, tile col, r % 32, r // 32, c]
    tiled = padded.view(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    return tiled.view(scales.dtype) if scales.element_size() == 1 else tiled
