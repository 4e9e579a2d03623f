"""Where a streamed block's bytes come from: host memory (page-locked, or pageable through ts-pinned's
staging ring; ``packed_source.py``: exponent-packed) or a peer GPU's pool (ts-peer). WeightStreamer copies
through one ``source``; a new source (another kind of pool) implements ``kind``, ``copy`` (returning the bytes
that crossed the link), ``link_bytes`` and ``stats``."""

from __future__ import annotations

import torch
import ts_pinned

__all__ = ["HostSource", "PeerSource"]


class HostSource:
    """A block's bytes from host memory: a page-locked buffer in one async copy, a pageable one
    (beyond the page-lock budget) through ts-pinned's staging ring, which all cores fill while the
    previous slot crosses the link (a plain pageable copy reaches a sixth of the link's rate)."""

    kind = "host"

    def __init__(self):
        self.bounce_bytes = 0

    def copy(self, index: int, host: torch.Tensor, pinned: bool, dst: torch.Tensor, stream) -> int:
        if stream is None:  # CPU training: a memory copy
            dst.copy_(host)
        elif pinned:
            dst.copy_(host, non_blocking=True)
        else:
            ts_pinned.copy_to_device(host, dst, stream)
            self.bounce_bytes += host.numel()
        return host.numel()

    def link_bytes(self, index: int, nbytes: int) -> int:
        return nbytes

    def release(self) -> None:
        """Drops what the source holds on the device (unwrap)."""

    def stats(self) -> dict:
        return {"bounce_bytes": self.bounce_bytes}


class PeerSource:
    """Blocks held in the peer-GPU pools (ts-peer) are copied from their owner GPU; the others
    come from ``fallback`` (the host)."""

    kind = "peer"

    def __init__(self, pool, fallback: HostSource):
        self.pool, self.fallback = pool, fallback

    def copy(self, index: int, host: torch.Tensor, pinned: bool, dst: torch.Tensor, stream) -> int:
        if index in self.pool:
            self.pool.copy_block(index, dst, stream)
            return host.numel()  # over NVLink, not the host link; counted as it is
        return self.fallback.copy(index, host, pinned, dst, stream)

    def link_bytes(self, index: int, nbytes: int) -> int:
        return nbytes if index in self.pool else self.fallback.link_bytes(index, nbytes)

    def release(self) -> None:
        self.fallback.release()

    def stats(self) -> dict:
        pool = self.pool.stats()
        return {**self.fallback.stats(), "peer_bytes": pool["peer_bytes"], "peer_blocks": pool["blocks"],
                "peer_owned_bytes": pool["pool_bytes"]}
