"""``StateFile``: one scratch file of optimizer state on disk, owned by this process, with asynchronous aligned
(direct) I/O served by a few native threads; ``aligned_empty`` allocates the buffers it needs. ``DiskState``
(``_disk.py``) keeps AdamW state in one."""

from __future__ import annotations

import os

import torch

from . import _core
from ._args import plain

__all__ = ["DEFAULT_IO_THREADS", "DiskIOError", "StateFile", "aligned_empty"]

DEFAULT_IO_THREADS = 4
DiskIOError = _core.DiskIOError
_ALIGN = _core.DISK_ALIGN


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized CPU tensor of ``nbytes`` bytes whose data starts on a 4096-byte boundary (what
    ``StateFile`` requires of its buffers); pageable memory."""
    size = torch.empty((), dtype=dtype).element_size()
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0 or nbytes % size:
        raise ValueError(f"nbytes={nbytes!r} must be an int >= 0 and a multiple of {dtype}'s {size} bytes")
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    shift = -raw.data_ptr() % _ALIGN
    return raw[shift:shift + nbytes].view(dtype)


def _int(value, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what}={value!r} must be an int >= {low}")
    return value


class StateFile:
    """One scratch file in ``directory``, owned by this process: it never has a name there for longer than a
    few instructions (``O_TMPFILE`` where the filesystem has it, else created and unlinked at once), so it
    disappears when closed, collected, or when the process dies, SIGKILL included.

    ``nbytes`` (rounded up to 4096) are reserved at once with ``posix_fallocate`` and read as zeros until
    written; a full disk raises ``DiskIOError`` (an ``OSError``) naming the directory and the bytes asked.
    ``direct``: ``None`` uses ``O_DIRECT`` where the filesystem allows it and buffered I/O elsewhere
    (``.direct`` says which), ``True`` requires it, ``False`` never uses it. ``io_threads`` threads serve
    the transfers in chunks of up to 1 MiB, so one large request keeps several in flight.

    ``read(offset, buffer, nbytes=None)`` / ``write(...)`` queue a transfer between the file and a CPU
    tensor (``nbytes`` defaults to the buffer's size) and return a ticket at once; ``wait(ticket)`` blocks
    (GIL released) until it is done and raises its ``DiskIOError`` (naming the file, offset, bytes and errno).
    Offsets, sizes and buffer addresses must be multiples of 4096 (``aligned_empty`` allocates such
    buffers), on every filesystem, so code that works on tmpfs works on NVMe; anything else is a
    ``ValueError``, never a silent copy. The file holds a reference to each buffer until its ticket is
    waited; do not touch a buffer in between. ``close()`` waits for every transfer, then closes. A file
    belongs to the process that opened it: in a child of ``fork()`` every call but ``close()`` raises
    ``ValueError``.
    """

    def __init__(self, directory: str | os.PathLike, nbytes: int, *, io_threads: int = DEFAULT_IO_THREADS,
                 direct: bool | None = None, anonymous: bool = True):
        if direct not in (None, True, False):
            raise ValueError(f"direct={direct!r} must be None (where the filesystem allows it), True or False")
        _int(io_threads, "io_threads", 1)
        self._file = _core.StateFile(os.fspath(directory), _int(nbytes, "nbytes", 1), io_threads,
                                     {None: -1, False: 0, True: 1}[direct], bool(anonymous))

    def read(self, offset: int, buffer: torch.Tensor, nbytes: int | None = None) -> int:
        """Queues a read of ``nbytes`` at ``offset`` into ``buffer``; returns the ticket."""
        return self._file.submit("read", _int(offset, "offset"), plain(buffer, "buffer"),
                                 None if nbytes is None else _int(nbytes, "nbytes"))

    def write(self, offset: int, buffer: torch.Tensor, nbytes: int | None = None) -> int:
        """Queues a write of ``nbytes`` from ``buffer`` at ``offset``; returns the ticket."""
        return self._file.submit("write", _int(offset, "offset"), plain(buffer, "buffer"),
                                 None if nbytes is None else _int(nbytes, "nbytes"))

    def wait(self, ticket: int) -> None:
        """Blocks until the transfer is done; raises its ``DiskIOError``. Each ticket is waited once."""
        self._file.wait(ticket)

    def done(self, ticket: int) -> bool:
        """True once the transfer finished (successfully or not)."""
        return self._file.done(ticket)

    def close(self) -> None:
        """Waits for every queued transfer, stops the I/O threads and closes the file (its space is freed)."""
        self._file.close()

    def __enter__(self) -> StateFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    directory = property(lambda self: self._file.directory, doc="The directory the file was created in.")
    path = property(lambda self: self._file.path, doc="The file as messages name it (it has no name on disk).")
    direct = property(lambda self: self._file.direct, doc="True when transfers bypass the page cache (O_DIRECT).")
    anonymous = property(lambda self: self._file.anonymous, doc="True when created with O_TMPFILE.")
    size = property(lambda self: self._file.size, doc="The file's size in bytes (a multiple of 4096).")
    io_threads = property(lambda self: self._file.io_threads, doc="The threads serving transfers.")
    closed = property(lambda self: self._file.closed, doc="True once close() began.")
    pending = property(lambda self: self._file.pending, doc="Tickets issued and not waited yet.")

    def _fail_next(self, kind: str, op: str = "read", after: int = 0) -> None:
        """Tests only: the chunk of ``op`` after the next ``after`` ones fails: ``"eio"`` (EIO), ``"short"``
        (half moved, then end of file) or ``"partial"`` (half moved, then the rest: recovered)."""
        self._file._fail_next(kind, op, after)
