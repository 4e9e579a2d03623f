"""Exponent-packed bfloat16 (csrc/packed_bf16.h): a lossless 12-bit form of a bf16 tensor, 1.5 bytes
a value plus 6 bytes per escape, for moving frozen weights over the host-to-device link.

``plan_bf16_packing(x)`` measures a CPU tensor's exponents and picks the window of 15 that covers
most values (or None when packing would not save ``MIN_SAVING``); ``pack_bf16`` writes the segment
(CPU); ``unpack_bf16`` restores every bit into a bf16 tensor, on the CPU or on the GPU on the
current stream. ``reference.pack_bf16_reference`` is the same format in plain PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _core

__all__ = ["MIN_SAVING", "PackedBf16", "pack_bf16", "packed_bf16_layout", "plan_bf16_packing", "unpack_bf16"]

MIN_SAVING = 0.10  # pack a tensor only when its segment is at least this much smaller
WINDOW = 15  # exponents coded in place: base .. base + 14 (offset 15 is the escape)


@dataclass(frozen=True)
class PackedBf16:
    """How one tensor packs: its values, the window's first exponent, the escapes, the segment's bytes."""

    numel: int
    base: int
    escapes: int
    nbytes: int

    @property
    def ratio(self) -> float:
        return self.nbytes / (2 * self.numel)


def packed_bf16_layout(numel: int, escapes: int) -> tuple[int, int, int, int]:
    """Byte offsets of a segment's offsets, escape indices, escape values, and its total size."""
    return tuple(_core.packed_bf16_layout(numel, escapes))


def _bits(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"exponent packing is for bfloat16 tensors, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("exponent packing needs a contiguous tensor")
    return x.view(-1).view(torch.int16)


def plan_bf16_packing(x: torch.Tensor) -> PackedBf16 | None:
    """The packing of the CPU bf16 tensor `x` whose window holds the most values, or None where it
    would not save MIN_SAVING of its bytes (exponents spread wide) or `x` is not a bf16 tensor."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.numel() == 0 or x.numel() >= 2**31:
        return None
    counts = torch.zeros(256, dtype=torch.int64)
    _core.exponent_histogram(_bits(x.contiguous()), counts)
    covered = counts.unfold(0, WINDOW, 1).sum(1)  # covered[b]: values with exponents b .. b + 14
    base = int(covered.argmax())
    escapes = x.numel() - int(covered[base])
    nbytes = packed_bf16_layout(x.numel(), escapes)[3]
    if nbytes > (1 - MIN_SAVING) * 2 * x.numel():
        return None
    return PackedBf16(x.numel(), base, escapes, nbytes)


def pack_bf16(x: torch.Tensor, plan: PackedBf16, segment: torch.Tensor) -> None:
    """Writes CPU bf16 `x`, as `plan` (from plan_bf16_packing(x)) says, into the uint8 `segment` (16-byte aligned)."""
    if x.numel() != plan.numel:
        raise ValueError(f"the plan is for {plan.numel} values, x has {x.numel()}")
    _core.pack_bf16(_bits(x), segment, plan.base, plan.escapes)


def unpack_bf16(segment: torch.Tensor, plan: PackedBf16, out: torch.Tensor) -> None:
    """Decodes `segment` into contiguous bf16 `out` (same device; 16-byte aligned). CUDA: on the current stream."""
    if out.numel() != plan.numel:
        raise ValueError(f"the plan is for {plan.numel} values, out has {out.numel()}")
    stream = torch.cuda.current_stream(out.device).cuda_stream if out.device.type == "cuda" else 0
    _core.unpack_bf16(segment, _bits(out), plan.base, plan.escapes, stream)
