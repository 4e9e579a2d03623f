"""PeerPool: frozen blocks spread over the ranks' GPUs, each copied from its owner's pool on demand.

Life cycle (every rank of the group runs the same calls, in the same order):
  ``place()`` the blocks this rank owns -> ``exchange()`` (collective: each rank copies its blocks
  into one buffer, exports it, and opens every other rank's) -> ``copy_block()`` as often as
  needed, on any stream -> ``close()`` (collective). After ``exchange()`` the blocks are frozen:
  nothing writes a pool, so copies need no ordering between ranks beyond that point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._backend import make_backend
from ._handles import IpcHandle
from ._native import gather, rank_and_world

__all__ = ["PeerPool"]

_ALIGN = 256  # bytes: every block starts aligned for the copy engines and vector loads


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_bytes(data, block_id) -> torch.Tensor:
    """A flat uint8 tensor over ``data``'s bytes (no copy where possible)."""
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError(f"block {block_id!r}: the tensor must be contiguous; call .contiguous() on it first")
        t = data.detach()
        return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    raise ValueError(f"block {block_id!r}: data must be a torch.Tensor, bytes, bytearray or memoryview, "
                     f"got {type(data).__name__}")


@dataclass(frozen=True)
class _Block:
    owner: int
    offset: int
    nbytes: int


class PeerPool:
    """Blocks of bytes held in the GPUs' memory of a process group's ranks.

    ``group``: a torch.distributed process group (None: the default one, or this process alone
    when torch.distributed is not initialized). ``device``: this rank's GPU (default: the current
    one). ``backend``: "cuda" (CUDA IPC), "host" (shared-memory files and CPU tensors: for tests
    and CPU-only runs) or "auto" (CUDA when the device is a GPU or CUDA works).
    """

    def __init__(self, group=None, *, device: torch.device | str | None = None, backend: str = "auto"):
        self.group = group
        self.rank, self.world = rank_and_world(group)
        self._backend = make_backend(backend, device)
        self.device = self._backend.device
        self.kind = self._backend.kind
        self._pending: dict = {}
        self._blocks: dict = {}
        self._regions: dict = {}
        self._buffer = None
        self._state = "placing"
        self.counters = {"copies": 0, "peer_bytes": 0, "remote_bytes": 0, "local_bytes": 0}

    # ---- building (collective) --------------------------------------------------------------

    def place(self, block_id, data) -> int:
        """Adds a block this rank owns (a tensor, or bytes); returns its bytes. Its bytes are read
        at ``exchange()``: do not change ``data`` before then. ``block_id``: int or str, unique
        across all ranks."""
        if self._state != "placing":
            raise RuntimeError(f"PeerPool.place: the pool is {self._state}; place every block before exchange()")
        if isinstance(block_id, bool) or not isinstance(block_id, (int, str)):
            raise ValueError(f"block_id={block_id!r} must be an int or a str")
        if block_id in self._pending:
            raise ValueError(f"block {block_id!r} was already placed on this rank")
        flat = _as_bytes(data, block_id)
        self._pending[block_id] = flat
        return flat.numel()

    def _build_local(self) -> tuple[bytes | None, dict]:
        layout, total = {}, 0
        for block_id, flat in self._pending.items():
            layout[block_id] = (total, flat.numel())
            total += _aligned(flat.numel())
        if total == 0:
            return None, layout
        self._buffer, view = self._backend.allocate(total)
        for block_id, flat in self._pending.items():
            offset, n = layout[block_id]
            if n:
                view[offset:offset + n].copy_(flat)
        del view
        self._backend.synchronize()  # blocks complete before any other rank may read them
        return self._backend.export(self._buffer).to_bytes(), layout

    def exchange(self) -> None:
        """Collective: builds this rank's pool, shares its handle, opens every other rank's pool.
        Errors on any rank (out of memory, a block placed twice, a handle that does not open)
        raise on every rank. Synchronizes this rank's device once."""
        if self._state != "placing":
            raise RuntimeError(f"PeerPool.exchange: the pool is {self._state}; exchange() runs once")
        info = {"rank": self.rank, "kind": self.kind, "handle": None, "blocks": {}, "error": None}
        try:
            info["handle"], info["blocks"] = self._build_local()
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
        infos = gather(info, self.group, self.world)
        try:
            self._check_infos(infos)
        except Exception:
            self._free_local()
            raise
        error = None
        try:
            for r, other in enumerate(infos):
                if r != self.rank and other["handle"] is not None:
                    self._regions[r] = self._backend.open(IpcHandle.from_bytes(other["handle"]))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        errors = gather(error, self.group, self.world)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            self._close_regions()
            self._free_local()
            where = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise RuntimeError(f"PeerPool.exchange: opening the other ranks' pools failed ({where})")
        if self._buffer is not None:
            self._backend.shared(self._buffer)
            self._regions[self.rank] = self._backend.local_region(self._buffer)
        for r, other in enumerate(infos):
            for block_id, (offset, n) in other["blocks"].items():
                self._blocks[block_id] = _Block(r, offset, n)
        self._pending = {}
        self._state = "ready"

    def _check_infos(self, infos: list[dict]) -> None:
        failed = [(i["rank"], i["error"]) for i in infos if i["error"]]
        if failed:
            where = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise RuntimeError(f"PeerPool.exchange: building the pools failed ({where})")
        kinds = {i["kind"] for i in infos}
        if len(kinds) > 1:
            raise ValueError(f"PeerPool.exchange: ranks use different backends ({', '.join(sorted(kinds))}); "
                             "every rank must pass the same backend")
        owner: dict = {}
        for i in infos:
            for block_id in i["blocks"]:
                if block_id in owner:
                    raise ValueError(f"PeerPool.exchange: block {block_id!r} was placed by ranks {owner[block_id]} "
                                     f"and {i['rank']}; place each block on one rank (see assign_blocks)")
                owner[block_id] = i["rank"]

    # ---- using -------------------------------------------------------------------------------

    def _block(self, block_id) -> _Block:
        if self._state != "ready":
            raise RuntimeError(f"PeerPool: the pool is {self._state}; call exchange() first" if
                               self._state == "placing" else "PeerPool: the pool is closed")
        try:
            return self._blocks[block_id]
        except KeyError:
            raise KeyError(f"block {block_id!r} is in no rank's pool (pooled: {len(self._blocks)} blocks)") from None

    def copy_block(self, block_id, dst: torch.Tensor, stream=None) -> int:
        """Enqueues a copy of the block from its owner's pool into ``dst`` (contiguous, on this
        rank's device, exactly the block's bytes, any dtype) on ``stream`` (None: the current
        stream; a torch.cuda.Stream or a cudaStream_t int). Never synchronizes; returns the bytes."""
        b = self._block(block_id)
        if not isinstance(dst, torch.Tensor):
            raise ValueError(f"dst must be a torch.Tensor, got {type(dst).__name__}")
        nbytes = dst.numel() * dst.element_size()
        if nbytes != b.nbytes:
            raise ValueError(f"dst has {nbytes} bytes, block {block_id!r} has {b.nbytes}; pass a tensor of its size")
        if not dst.is_contiguous():
            raise ValueError("dst must be contiguous; copy into a contiguous buffer and view it")
        self._backend.check_dst(dst)
        if nbytes:
            with torch.no_grad():
                self._backend.copy(dst.detach(), self._regions[b.owner], b.offset, nbytes, stream)
        self.counters["copies"] += 1
        self.counters["peer_bytes"] += nbytes
        self.counters["remote_bytes" if b.owner != self.rank else "local_bytes"] += nbytes
        return nbytes

    def owner(self, block_id) -> int:
        """The rank whose GPU holds the block."""
        return self._block(block_id).owner

    def nbytes(self, block_id) -> int:
        return self._block(block_id).nbytes

    @property
    def block_ids(self) -> list:
        return list(self._blocks)

    def __contains__(self, block_id) -> bool:
        return block_id in self._blocks

    @property
    def peer_bytes(self) -> int:
        """Bytes copied out of the pools so far (from any rank's, this rank's own included)."""
        return self.counters["peer_bytes"]

    @property
    def pool_bytes(self) -> int:
        """Device (or shared host) bytes this rank's pool holds."""
        return 0 if self._buffer is None else self._buffer.nbytes

    @property
    def pooled_blocks(self) -> list:
        """The block ids held in some rank's pool (the reference library's name for ``block_ids``)."""
        return self.block_ids

    @property
    def bytes_owned(self) -> int:
        """The reference library's name for ``pool_bytes``: what this rank's pool holds."""
        return self.pool_bytes

    def stats(self) -> dict:
        """Counters (copies, peer_bytes, remote_bytes from other ranks, local_bytes from this
        rank's own pool), pool_bytes, blocks (all ranks) and owned (this rank's)."""
        owned = sum(1 for b in self._blocks.values() if b.owner == self.rank)
        return {**self.counters, "pool_bytes": self.pool_bytes, "blocks": len(self._blocks), "owned": owned,
                "backend": self.kind, "rank": self.rank, "world": self.world}

    # ---- teardown (collective) ---------------------------------------------------------------

    def _close_regions(self) -> None:
        for r in list(self._regions):
            region = self._regions.pop(r)
            if r != self.rank:
                self._backend.close(region)

    def _free_local(self) -> None:
        self._regions.pop(self.rank, None)
        if self._buffer is not None:
            self._backend.free(self._buffer)
            self._buffer = None

    def close(self) -> None:
        """Collective: waits for this rank's device (the copies out of the pools), unmaps the
        other ranks' pools, waits for every rank to get there, then frees this rank's pool."""
        if self._state == "closed":
            return
        self._backend.synchronize()
        self._close_regions()
        gather(None, self.group, self.world)  # no rank frees its pool while another may still read it
        self._free_local()
        self._blocks, self._pending = {}, {}
        self._state = "closed"

    def __enter__(self) -> PeerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
