"""PinnedArena: torch tensors carved from page-locked slabs."""

from __future__ import annotations

import math
import operator
import os
import threading
from collections.abc import Sequence

import torch

from . import _core
from ._sizes import _MAX_BYTES, parse_bytes

__all__ = ["PinnedArena", "default_arena", "empty", "pinned_stats", "reserve_pinned"]

SLAB_ENV = "TRAINSTREAM_HOST_ARENA_SLAB"
DEFAULT_SLAB_BYTES = 1 << 30


def _normalize_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    """Shape as a tuple of ints; accepts anything with ``__index__`` (numpy ints), rejects bools and floats."""
    if type(shape) is int and shape >= 0:  # the common cases, cheaply
        return (shape,)
    if type(shape) is tuple and all(type(d) is int and d >= 0 for d in shape):
        return shape
    if isinstance(shape, (str, bytes, bool)):
        raise ValueError(f"shape must be an int or a sequence of ints, got {shape!r}")
    try:
        dims_in = (operator.index(shape),) if not isinstance(shape, Sequence) else tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    dims = []
    for d in dims_in:
        try:
            if isinstance(d, bool):
                raise TypeError
            value = operator.index(d)
        except TypeError:
            raise ValueError(f"shape must be non-negative integers, got {dims_in!r}") from None
        if value < 0:
            raise ValueError(f"shape must be non-negative integers, got {dims_in!r}")
        dims.append(value)
    return tuple(dims)


class PinnedArena:
    """Page-locked slabs carved into blocks that back torch CPU tensors.

    ``slab_bytes``: size of each slab page-locked on demand. ``cap_bytes``: the
    arena grows slab by slab up to this many bytes (``None``: no cap). Requests
    beyond the cap are page-locked on their own and counted as fallbacks.
    """

    def __init__(self, slab_bytes: int | str = DEFAULT_SLAB_BYTES, cap_bytes: int | str | None = None):
        slab = parse_bytes(slab_bytes, "slab_bytes")
        if slab == 0:
            raise ValueError("slab_bytes must be positive")
        cap = None if cap_bytes is None else parse_bytes(cap_bytes, "cap_bytes")
        self._arena = _core.Arena(slab, cap)

    def reserve(self, bytes_now: int | str, cap: int | str = 0) -> int:
        """Page-locks slabs until ``bytes_now`` bytes are reserved; ``cap`` > 0 lets the
        arena grow on demand up to it. Returns the bytes reserved so far."""
        now = parse_bytes(bytes_now, "bytes_now")
        limit = parse_bytes(cap, "cap")
        if limit and limit < now:
            raise ValueError(f"cap ({limit} bytes) is below bytes_now ({now} bytes); pass cap >= bytes_now or 0")
        more = now - self._arena.stats()["arena_bytes"]
        available = _core.host_memory()["available"]
        if more > available:  # refused before any work: page-locking that much would not end, or end the machine
            raise ValueError(f"reserve({bytes_now!r}) needs {more / 2**30:.1f} GiB more than is reserved; this "
                             f"machine has {available / 2**30:.1f} GiB available (cgroup limits included); nothing "
                             f"was reserved")
        return self._arena.reserve(now, limit)

    def set_slab_bytes(self, slab_bytes: int | str) -> None:
        """Size of the slabs page-locked from now on."""
        slab = parse_bytes(slab_bytes, "slab_bytes")
        if slab == 0:
            raise ValueError("slab_bytes must be positive")
        self._arena.set_slab_bytes(slab)

    def empty(
        self,
        shape: int | Sequence[int],
        dtype: torch.dtype = torch.float32,
        tag: str = "",
        *,
        allow_pageable: bool = False,
    ) -> torch.Tensor:
        """An uninitialized CPU tensor backed by an arena block (zero-copy).

        The block returns to the arena when the last tensor viewing it dies.
        ``allow_pageable``: if page-locking fails, return pageable memory
        (counted in ``pageable_fallbacks``) instead of raising ``MemoryError``.
        """
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(tag, str):
            raise ValueError(f"tag must be a string, got {tag!r}")
        dims = _normalize_shape(shape)
        nbytes = math.prod(dims) * dtype.itemsize
        if nbytes > _MAX_BYTES:
            raise ValueError(f"shape {dims} of {dtype} is {nbytes} bytes, more than any host can hold")
        if nbytes == 0:
            return torch.empty(dims, dtype=dtype)
        raw = _core.allocate(self._arena, nbytes, tag, allow_pageable)
        if dtype != torch.uint8:
            raw = raw.view(dtype)
        return raw if len(dims) == 1 else raw.view(dims)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (from this arena's ``empty``) is page-locked; False for a pageable
        fallback or memory the arena did not hand out."""
        return bool(_core.block_is_pinned(self._arena, tensor.untyped_storage().data_ptr()))

    def trim(self, keep_bytes: int | str = 0) -> int:
        """Returns wholly free slabs to the system, the latest first, while more than ``keep_bytes``
        are reserved (slabs holding a live block stay). Returns the bytes released."""
        return self._arena.trim(parse_bytes(keep_bytes, "keep_bytes"))

    def stats(self) -> dict:
        """Counters: reserved / used bytes, slabs, cap, fallbacks, live bytes per tag."""
        return self._arena.stats()

    def check_invariants(self) -> None:
        """Raises RuntimeError if the free list and blocks do not tile the slabs (for tests)."""
        self._arena.check_invariants()


_default: PinnedArena | None = None
_default_lock = threading.Lock()


def default_arena() -> PinnedArena:
    """The process-wide arena. Its slab size comes from TRAINSTREAM_HOST_ARENA_SLAB
    (bytes or K / M / G, default 1G); it reserves nothing until asked and has cap 0,
    so requests it cannot serve are page-locked on their own."""
    global _default
    with _default_lock:
        if _default is None:
            slab = parse_bytes(os.environ.get(SLAB_ENV, DEFAULT_SLAB_BYTES), SLAB_ENV)
            if slab == 0:
                raise ValueError(f"{SLAB_ENV} must be positive")
            _default = PinnedArena(slab, cap_bytes=0)
        return _default


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32, tag: str = "", **kwargs) -> torch.Tensor:
    """``default_arena().empty(...)``."""
    return default_arena().empty(shape, dtype, tag, **kwargs)


def reserve_pinned(bytes_now: int | str, cap: int | str = 0, slab: int | str = 0) -> int:
    """Page-locks ``bytes_now`` for the default arena now, lets it grow to ``cap``,
    and sets its slab size when ``slab`` > 0. Returns the bytes reserved."""
    arena = default_arena()
    if parse_bytes(slab, "slab"):
        arena.set_slab_bytes(slab)
    return arena.reserve(bytes_now, cap)


def pinned_stats() -> dict:
    """Counters of the default arena (see ``PinnedArena.stats``)."""
    return default_arena().stats()
