"""Streamed frozen bf16 weights cross the link exponent-packed: ts-quant's lossless 12-bit form
(``ts_quant.plan_bf16_packing``), 0.75 of the bytes for weights whose values span 15 binades, as
trained and freshly initialized weights do. A fetch copies a block's packed bytes into one device
staging buffer and decodes them into the block's device buffer on the H2D stream; every bit is the
host copy's, so training is unchanged (tests/test_packed_stream.py).

Invariants:
  1. The plain host copy (``StreamedBlock.host``) stays the authority: reads, ``load_state_dict`` and
     unwrapping use it. A block's packed copy is made from it, and made again before a fetch when a
     weight's version moved since: an in-place write through the parameter, as ``load_state_dict``'s.
     (A write through ``.data`` moves no version and is not seen: frozen weights are not written so.)
  2. Only blocks whose trained weights do not stream are packed (the host AdamW writes those into
     the plain copy every step) and only when packing saves ``MIN_BLOCK_SAVING`` of a block's bytes.
  3. The staging buffer is used on the H2D stream alone, so a fetch's copy into it is ordered after
     the previous fetch's decoding (same stream): one buffer serves every fetch.
  4. A packed copy is rewritten (or released) only after the newest copy out of it finished.
"""

from __future__ import annotations

import torch
import ts_pinned
from ts_quant import pack_bf16, plan_bf16_packing, unpack_bf16

from .sources import HostSource
from .streamed_block import align, view_in

__all__ = ["PackedHostSource"]

MIN_BLOCK_SAVING = 0.10  # pack a block when its packed bytes are at most 90 % of its plain bytes
MIN_PACKED_VALUES = 1 << 16  # smaller tensors (norms, biases) travel as they are


class _Part:
    __slots__ = ("nbytes", "packed_at", "param", "plain_at", "plan")

    def __init__(self, param, plain_at: int, packed_at: int, plan, nbytes: int):
        self.param, self.plain_at, self.packed_at, self.plan, self.nbytes = param, plain_at, packed_at, plan, nbytes


class _PackedBlock:
    __slots__ = ("copied", "host", "nbytes", "parts", "pinned", "versions")

    def __init__(self, parts: list[_Part], nbytes: int):
        self.parts, self.nbytes = parts, nbytes
        self.host = None  # flat uint8 host buffer of the packed parts
        self.pinned = False
        self.versions: list[int] = []
        self.copied = None  # event after the newest copy out of `host` (invariant 4)


class PackedHostSource(HostSource):
    """HostSource whose packed blocks cross the link as packed bytes (the others as they are)."""

    def __init__(self, arena: ts_pinned.PinnedArena, is_cuda: bool):
        super().__init__()
        self.arena, self.is_cuda = arena, is_cuda
        self.blocks: dict[int, _PackedBlock] = {}
        self.repacks = 0
        self._streamed: dict = {}  # the streamer's StreamedBlocks, whose plain host copies are packed
        self._staging: torch.Tensor | None = None

    # ---- packing ------------------------------------------------------------------------------

    def pack(self, blocks: dict) -> PackedHostSource:
        """Packs each StreamedBlock of `blocks` (index -> block) where it pays (invariant 2)."""
        self._streamed = blocks
        for index, b in blocks.items():
            if b.trained or b.host is None:
                continue
            packed = self._build(b)
            if packed is not None:
                self.blocks[index] = packed
        return self

    def _build(self, b, old: _PackedBlock | None = None) -> _PackedBlock | None:
        """Block `b` packed from its plain host copy (None when that would not pay, unless it replaces `old`:
        values loaded since may pack less well, and a part that does not shrink travels as it is)."""
        parts, at = [], 0
        for (_m, _n, p), offset in zip(b.params, b.offsets):
            plan = None
            if p.dtype == torch.bfloat16 and p.numel() >= MIN_PACKED_VALUES:
                plan = plan_bf16_packing(view_in(b.host, offset, p))
            size = plan.nbytes if plan is not None else p.numel() * p.element_size()
            parts.append(_Part(p, offset, at, plan, size))
            at += align(size)
        if old is None and at > (1 - MIN_BLOCK_SAVING) * b.nbytes:
            return None
        packed = _PackedBlock(parts, at)
        if old is not None and old.host.numel() >= at:  # _repack waited for its copies (invariant 4)
            packed.host, packed.pinned = old.host, old.pinned
        else:
            packed.host = self.arena.empty(at, torch.uint8, tag="packed-weights", allow_pageable=True)
            packed.pinned = self.is_cuda and self.arena.is_pinned(packed.host)
        for part in parts:
            plain = view_in(b.host, part.plain_at, part.param)
            segment = packed.host[part.packed_at:part.packed_at + part.nbytes]
            if part.plan is None:
                segment.copy_(plain.reshape(-1).view(torch.uint8))  # a 2-D weight into its flat segment
            else:
                pack_bf16(plain, part.plan, segment)
        packed.versions = [part.param._version for part in parts]
        return packed

    def _repack(self, index: int) -> _PackedBlock:
        old = self.blocks[index]
        if old.copied is not None:
            old.copied.synchronize()  # invariant 4, also when `old.host` is released below
        self.blocks[index] = self._build(self._streamed[index], old)
        self.repacks += 1
        return self.blocks[index]

    # ---- fetching --------------------------------------------------------------------------

    def copy(self, index: int, host: torch.Tensor, pinned: bool, dst: torch.Tensor, stream) -> int:
        packed = self.blocks.get(index)
        if packed is None:
            return super().copy(index, host, pinned, dst, stream)
        if [part.param._version for part in packed.parts] != packed.versions:
            packed = self._repack(index)
        if stream is None:  # CPU training: decode straight from the host buffer
            self._decode(packed, packed.host, dst)
            return packed.nbytes
        staging = self._staging_for(packed.nbytes, dst.device)
        if packed.pinned:
            staging.copy_(packed.host, non_blocking=True)
        else:
            ts_pinned.copy_to_device(packed.host, staging, stream)
            self.bounce_bytes += packed.nbytes
        packed.copied = torch.cuda.Event()
        packed.copied.record(stream)
        self._decode(packed, staging, dst)  # on the H2D stream, after the copy (invariant 3)
        return packed.nbytes

    def _staging_for(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # the old one goes back to the H2D stream's pool first
            self._staging = torch.empty(max(b.nbytes for b in self.blocks.values()), dtype=torch.uint8,
                                        device=device)
        return self._staging[:nbytes]

    @staticmethod
    def _decode(packed: _PackedBlock, source: torch.Tensor, dst: torch.Tensor) -> None:
        for part in packed.parts:
            segment = source[part.packed_at:part.packed_at + part.nbytes]
            n = part.param.numel() * part.param.element_size()
            out = dst[part.plain_at:part.plain_at + n]
            if part.plan is None:
                out.copy_(segment, non_blocking=True)
            else:
                unpack_bf16(segment, part.plan, out.view(torch.bfloat16))

    def link_bytes(self, index: int, nbytes: int) -> int:
        """Bytes a fetch of block `index` (`nbytes` unpacked) moves over the link."""
        packed = self.blocks.get(index)
        return packed.nbytes if packed is not None else nbytes

    def release(self) -> None:
        self._staging = None

    def stats(self) -> dict:
        plain = sum(self._streamed[i].nbytes for i in self.blocks)
        packed = sum(b.nbytes for b in self.blocks.values())
        return {**super().stats(), "packed_blocks": sorted(self.blocks), "packed_bytes": packed,
                "packed_ratio": packed / plain if plain else None, "repacks": self.repacks}
