"""Plain-PyTorch references of the four formats, op for op what csrc/formats.h does.

`quantize_reference(x, format, block_size)` returns (data, scales, global_scale)
in exactly the layout of `ts_quant.quantize`; `dequantize_reference` decodes
them. Slow and memory-hungry on purpose: they are the specification the
kernels are tested against, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._formats import check_block, check_format, fp8_grid

__all__ = ["E2M1_VALUES", "NF4_CODES", "dequantize_reference", "pack_bf16_reference", "quantize_reference",
           "unpack_bf16_reference"]

# bitsandbytes 0.50.2, bitsandbytes/backends/utils.py (_NF4_QUANT_TABLE).
NF4_CODES = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], dtype=torch.float32)
# OCP microscaling spec, FP4 E2M1 magnitudes of codes 0..7.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
_NAN = float("nan")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


def _amax(blocks: torch.Tensor, dims: int | tuple[int, int] = -1) -> tuple[torch.Tensor, torch.Tensor]:
    finite = torch.isfinite(blocks)
    amax = torch.where(finite, blocks.abs(), 0.0).amax(dim=dims)
    return amax, (~finite).any(dim=dims) if isinstance(dims, int) else (~finite).flatten(-2).any(-1)


def _to_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _pack(codes: torch.Tensor, first_high: bool, pad_code: int) -> torch.Tensor:
    codes = codes.reshape(-1).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), pad_code)])
    first, second = codes[0::2], codes[1::2]
    return (first << 4) | second if first_high else first | (second << 4)


def _unpack(data: torch.Tensor, n: int, first_high: bool) -> torch.Tensor:
    high, low = data >> 4, data & 0x0F
    first, second = (high, low) if first_high else (low, high)
    return torch.stack([first, second], dim=1).reshape(-1)[:n].long()


def _int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    blocks = _blocks(x, block)
    amax, bad = _amax(blocks)
    scale = torch.where(bad, _NAN, amax / 127.0)
    ok = (scale > 0)[:, None]
    q = torch.where(ok, (blocks / scale[:, None]).round().clamp(-127.0, 127.0), 0.0)
    return q.to(torch.int8).view(torch.uint8).reshape(-1)[: x.numel()], scale, None


def _nf4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n = x.numel()
    blocks = _blocks(x, block)
    amax, bad = _amax(blocks)
    clamped = amax.clamp(min=1e-38)
    # bitsandbytes: full blocks multiply by the reciprocal, the partial last block divides.
    scaled = (blocks * (1.0 / clamped)[:, None]).clamp(-1.0, 1.0)
    stored = amax.clone()
    if n % block:
        last = blocks[-1, : n % block]
        scaled[-1, : n % block] = (last / clamped[-1]).clamp(-1.0, 1.0)
        stored[-1] = clamped[-1]
    bounds = (NF4_CODES[:-1] + NF4_CODES[1:]) / 2
    codes = torch.bucketize(scaled, bounds)
    codes = torch.where(bad[:, None], 7, codes)
    stored = torch.where(bad, _NAN, stored)
    return _pack(codes.reshape(-1)[:n], True, 7), stored, None


def _fp8(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    rows, cols = fp8_grid(x.shape)
    grid = x.reshape(rows, cols).float()
    tr, tc = math.ceil(rows / tile), math.ceil(cols / tile)
    padded = torch.nn.functional.pad(grid, (0, tc * tile - cols, 0, tr * tile - rows))
    tiles = padded.view(tr, tile, tc, tile).permute(0, 2, 1, 3)
    amax, bad = _amax(tiles, dims=(-2, -1))
    scale = torch.where(bad, _NAN, amax / 448.0)
    full = scale.repeat_interleave(tile, 0).repeat_interleave(tile, 1)[:rows, :cols]
    codes = torch.where(full > 0, _to_e4m3_bytes(grid / full), 0)
    return codes.reshape(-1).to(torch.uint8), scale, None


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    a = v.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
            + (a >= 3.5).int() + (a > 5.0).int())
    return code | (torch.signbit(v).int() << 3)


def _nvfp4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n = x.numel()
    g = (x.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).amax().float() / 2688.0).reshape(1)
    blocks = _blocks(x, block)
    amax, bad = _amax(blocks)
    scale_byte = torch.where(g > 0, _to_e4m3_bytes((amax / 6.0) / g), 0)
    scale_byte = torch.where(bad, 0x7F, scale_byte).to(torch.uint8)
    block_scale = torch.where(bad, 0.0, scale_byte.view(torch.float8_e4m3fn).float() * g)
    ok = (block_scale > 0)[:, None]
    codes = torch.where(ok, _e2m1(blocks / block_scale[:, None]), 0)
    return _pack(codes.reshape(-1)[:n], False, 0), scale_byte.view(torch.float8_e4m3fn), g


def quantize_reference(x: torch.Tensor, format: str, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(data uint8, scales, global_scale or None) of `x` on the CPU, the layout of ts_quant.quantize."""
    format = check_format(format)
    block = check_block(format, block_size)
    x = x.detach().cpu()
    return {"int8": _int8, "nf4": _nf4, "fp8": _fp8, "nvfp4": _nvfp4}[format](x, block)


def dequantize_reference(format: str, shape: Sequence[int], data: torch.Tensor, scales: torch.Tensor,
                         global_scale: torch.Tensor | None = None, block_size: int | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decodes reference (or kernel) bytes on the CPU: fp32 code * fp32 scale, then rounded to `dtype`."""
    block = check_block(format, block_size)
    shape = torch.Size(shape)
    n = math.prod(shape)
    data, scales = data.cpu(), scales.cpu()
    if format == "fp8":
        rows, cols = fp8_grid(shape)
        full = scales.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
        values = data.view(torch.float8_e4m3fn).float().reshape(rows, cols) * full
        return values.to(dtype).reshape(shape)
    index = torch.arange(n) // block
    if format == "int8":
        values = data.view(torch.int8).float() * scales[index]
    elif format == "nf4":
        values = NF4_CODES[_unpack(data, n, True)] * scales[index]
    else:
        codes = _unpack(data, n, False)
        magnitude = E2M1_VALUES[codes & 7]
        signed = torch.where((codes & 8) > 0, -magnitude, magnitude)
        if global_scale is None:
            raise ValueError("nvfp4 bytes decode with their global_scale; none was given")
        block_scale = scales.view(torch.float8_e4m3fn).float() * global_scale.cpu()
        values = signed * block_scale[index]
    return values.to(dtype).reshape(shape)


def _packed_offsets(n: int) -> tuple[int, int]:
    """Where a packed segment of n values puts its offsets and its escape indices (parts 16-byte aligned)."""
    at_nibbles = (n + 15) // 16 * 16
    return at_nibbles, (at_nibbles + (n + 1) // 2 + 15) // 16 * 16


def pack_bf16_reference(x: torch.Tensor, base: int) -> torch.Tensor:
    """The exponent-packed segment of bf16 `x` with window base .. base + 14 (csrc/packed_bf16.h), as uint8."""
    bits = x.contiguous().view(-1).view(torch.int16).to(torch.int32) & 0xFFFF
    n = bits.numel()
    exponent = (bits >> 7) & 0xFF
    escaped = (exponent < base) | (exponent >= base + 15)
    offset = torch.where(escaped, 15, exponent - base)
    low = ((bits >> 8) & 0x80) | (bits & 0x7F)
    offset = torch.nn.functional.pad(offset, (0, n % 2))
    nibbles = offset[0::2] | (offset[1::2] << 4)
    index = escaped.nonzero().view(-1).to(torch.int32)
    at_nibbles, at_indices = _packed_offsets(n)
    at_values = at_indices + 4 * index.numel()
    segment = torch.zeros(at_values + 2 * index.numel(), dtype=torch.uint8)
    segment[:n] = low.to(torch.uint8)
    segment[at_nibbles:at_nibbles + nibbles.numel()] = nibbles.to(torch.uint8)
    segment[at_indices:at_values] = index.view(torch.uint8)
    segment[at_values:] = bits[index.long()].to(torch.int16).view(torch.uint8)
    return segment


def unpack_bf16_reference(segment: torch.Tensor, n: int, escapes: int, base: int) -> torch.Tensor:
    """The bf16 values of an exponent-packed segment (n values, `escapes` escapes, window base .. base + 14)."""
    at_nibbles, at_indices = _packed_offsets(n)
    low = segment[:n].to(torch.int32)
    packed = segment[at_nibbles:at_nibbles + (n + 1) // 2].to(torch.int32)
    offset = torch.stack([packed & 0xF, packed >> 4], 1).view(-1)[:n]
    bits = ((low & 0x80) << 8) | (((base + offset) & 0xFF) << 7) | (low & 0x7F)
    index = segment[at_indices:at_indices + 4 * escapes].view(torch.int32).long()
    value = segment[at_indices + 4 * escapes:at_indices + 6 * escapes].view(torch.int16).to(torch.int32) & 0xFFFF
    bits[index] = value
    return bits.to(torch.uint16).view(torch.bfloat16) if hasattr(torch, "uint16") else \
        bits.to(torch.int16).view(torch.bfloat16)
