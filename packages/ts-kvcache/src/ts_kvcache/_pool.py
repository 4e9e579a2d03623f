"""HostPagePool: fixed-size pages carved from page-locked chunks (ts-pinned), and
the free list that hands them to layers' page tables."""

from __future__ import annotations

import torch
import ts_pinned

__all__ = ["HostPagePool"]


class HostPagePool:
    """Pages of ``page_bytes`` bytes in host memory, page-locked where the host allows.

    Pages are identified by integers; ``allocate`` hands out free ones (growing by a
    chunk when none are left), ``free`` takes them back. Memory returns to the arena
    only when the pool dies. ``arena``: a ``ts_pinned.PinnedArena`` (default: the
    process-wide one).
    """

    def __init__(self, page_bytes: int, *, arena: ts_pinned.PinnedArena | None = None, tag: str = "kvcache"):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self._arena = arena
        self._tag = tag
        self._chunks: list[torch.Tensor] = []
        self._address: list[int] = []  # by page id
        self._page_chunk: list[tuple[int, int]] = []  # page id -> (chunk, index in chunk)
        self._free: list[int] = []  # a stack: the lowest ids are handed out first
        self._used: set[int] = set()
        self.pinned = True  # every chunk page-locked (the kernel copy path needs it)

    @property
    def capacity(self) -> int:
        """Pages the pool holds, free or not."""
        return len(self._address)

    @property
    def in_use(self) -> int:
        return len(self._used)

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return self.capacity * self.page_bytes

    def reserve(self, pages: int) -> None:
        """Grows the pool so that ``pages`` pages are free (one chunk)."""
        short = pages - len(self._free)
        if short > 0:
            self._grow(short)

    def allocate(self, count: int) -> list[int]:
        """``count`` free page ids; grows by at least half the pool when short."""
        if count > len(self._free):
            self._grow(max(count - len(self._free), self.capacity // 2, 1))
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Returns pages to the free list; a page not in use is an error (a double free)."""
        wrong = [page for page in ids if page not in self._used]
        if wrong or len(set(ids)) != len(ids):
            raise RuntimeError(f"HostPagePool: pages {wrong or ids} are not in use once each (freed twice?)")
        self._used.difference_update(ids)
        self._free.extend(sorted(ids, reverse=True))

    def addresses(self, ids: list[int]) -> torch.Tensor:
        """The pages' host addresses as an int64 CPU tensor (what the native copies take)."""
        return torch.tensor([self._address[i] for i in ids], dtype=torch.int64)

    def page(self, page: int) -> torch.Tensor:
        """Page ``page`` as a uint8 CPU tensor viewing the pool's memory."""
        chunk, index = self._page_chunk[page]
        return self._chunks[chunk][index * self.page_bytes : (index + 1) * self.page_bytes]

    def check_invariants(self) -> None:
        """RuntimeError unless every page is either free or in use, exactly once (for tests)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("HostPagePool: a page is on the free list twice")
        if free & self._used:
            raise RuntimeError(f"HostPagePool: pages {sorted(free & self._used)} are both free and in use")
        if free | self._used != set(range(self.capacity)):
            raise RuntimeError("HostPagePool: some pages are neither free nor in use")

    def _grow(self, pages: int) -> None:
        nbytes = pages * self.page_bytes
        try:
            if self._arena is not None:
                chunk = self._arena.empty(nbytes, torch.uint8, self._tag, allow_pageable=True)
            else:
                chunk = ts_pinned.empty(nbytes, torch.uint8, self._tag, allow_pageable=True)
        except MemoryError as error:
            raise MemoryError(
                f"PagedKVCache: could not allocate {nbytes} bytes of host memory for {pages} KV pages "
                f"({self.host_bytes} bytes held already): keep more layers in VRAM (resident_layers=), "
                f"lower the batch or max_tokens, or free host RAM ({error})"
            ) from None
        if torch.cuda.is_available():
            self.pinned = self.pinned and chunk.is_pinned()
        else:
            self.pinned = False
        index = len(self._chunks)
        self._chunks.append(chunk)
        base = chunk.data_ptr()
        first = self.capacity
        self._address.extend(base + i * self.page_bytes for i in range(pages))
        self._page_chunk.extend((index, i) for i in range(pages))
        self._free.extend(range(first + pages - 1, first - 1, -1))
