"""The disk a run keeps optimizer state on: its sequential direct-I/O rates, measured once and cached.

The probe writes and reads back one scratch file in the directory, in 1 MiB transfers kept in flight by a
few threads (as ts-adamw's ``StateFile`` moves state), with ``O_DIRECT`` where the filesystem allows it so
the page cache does not flatter the rate. The file has no name in the directory (``O_TMPFILE``, else
created and unlinked at once). Results are cached per filesystem (its device number) in the same cache
directory as the hardware profile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import json
import mmap
import os
import tempfile
import time

from ._profile import _cache_root

__all__ = ["DiskRates", "disk_rates", "measure_disk"]

CHUNK = 1 << 20  # bytes per transfer, as ts-adamw's I/O threads move them
THREADS = 4  # transfers in flight


@dataclasses.dataclass(frozen=True)
class DiskRates:
    """Sequential rates of one filesystem in GB/s (1e9 bytes per second): reads alone, writes alone, and
    ``mixed_gbps`` the bytes read plus written per second with both under way at once (as a step reads one
    bucket's state while it writes another's; many drives, and virtual disks, share one budget between
    them). ``direct``: measured with ``O_DIRECT`` (False: buffered, the page cache dropped before the reads,
    which may flatter them)."""

    read_gbps: float
    write_gbps: float
    direct: bool
    directory: str
    probe_bytes: int
    mixed_gbps: float = 0.0

    def summary(self) -> str:
        how = "direct I/O" if self.direct else "buffered I/O (no O_DIRECT on this filesystem)"
        return (f"disk at {self.directory!r}: read {self.read_gbps:.2f} GB/s, write {self.write_gbps:.2f} GB/s, "
                f"both at once {self.mixed_gbps:.2f} GB/s "
                f"({how}, {self.probe_bytes >> 20} MiB probe)")


def _open_scratch(directory: str) -> int:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            raise
    fd, path = tempfile.mkstemp(prefix=".ts-disk-probe-", dir=directory)
    os.unlink(path)
    return fd


def _direct(fd: int) -> bool:
    """Turns O_DIRECT on where the filesystem accepts it."""
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        return False
    return True


def _transfer(fd: int, op: str, nbytes: int, buffers: list[mmap.mmap]) -> float:
    """Seconds to move ``nbytes`` in CHUNK pieces, THREADS in flight (os.preadv/pwritev release the GIL);
    ``op`` "mixed": half the threads read the first half while the others write the second."""
    def worker(t: int) -> None:
        view = memoryview(buffers[t])
        mine = op if op != "mixed" else ("read" if t % 2 == 0 else "write")
        start, step = (t * CHUNK, THREADS * CHUNK) if op != "mixed" else (
            (t // 2) * CHUNK + (0 if mine == "read" else nbytes // 2), THREADS // 2 * CHUNK)
        end = nbytes if op != "mixed" else (nbytes // 2 if mine == "read" else nbytes)
        for offset in range(start, end, step):
            done = os.preadv(fd, [view], offset) if mine == "read" else os.pwritev(fd, [view], offset)
            if done != CHUNK:
                raise OSError(errno.EIO, f"disk probe: short {op} of {done} of {CHUNK} bytes at offset {offset}")

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(worker, range(THREADS)))
    if op != "read":
        os.fsync(fd)
    return time.perf_counter() - started


def measure_disk(directory: str | os.PathLike, nbytes: int = 256 << 20, repeats: int = 2) -> DiskRates:
    """Writes then reads ``nbytes`` (a multiple of 1 MiB) in ``directory``, best of ``repeats`` each;
    OSError naming the directory when it cannot (missing, read-only, full)."""
    directory = os.fspath(directory)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < CHUNK or nbytes % CHUNK:
        raise ValueError(f"nbytes={nbytes!r} must be a multiple of {CHUNK} bytes (1 MiB), at least one")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    try:
        fd = _open_scratch(directory)
    except OSError as error:
        raise OSError(error.errno, f"disk probe: cannot create a scratch file in {directory!r}: "
                                   f"{os.strerror(error.errno or errno.EIO)}") from None
    buffers = [mmap.mmap(-1, CHUNK) for _ in range(THREADS)]  # page-aligned, as O_DIRECT needs
    try:
        for b in buffers:
            b.write(os.urandom(CHUNK))  # incompressible: a compressing filesystem is not flattered
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            raise OSError(error.errno, f"disk probe: cannot reserve {nbytes} bytes in {directory!r}: "
                                       f"{os.strerror(error.errno or errno.EIO)}") from None
        direct = _direct(fd)
        write = min(_transfer(fd, "write", nbytes, buffers) for _ in range(repeats))
        read = mixed = float("inf")
        for _ in range(repeats):
            if not direct:
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # read the disk, not the cache
            read = min(read, _transfer(fd, "read", nbytes, buffers))
            if not direct:
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
            mixed = min(mixed, _transfer(fd, "mixed", nbytes, buffers))
    finally:
        os.close(fd)
        for b in buffers:
            b.close()
    return DiskRates(nbytes / read / 1e9, nbytes / write / 1e9, direct, directory, nbytes, nbytes / mixed / 1e9)


def disk_rates(directory: str | os.PathLike, force: bool = False) -> DiskRates:
    """``measure_disk(directory)``, cached per filesystem in TRAINSTREAM_CACHE_DIR (see ``profile_hardware``);
    ``force`` measures again."""
    directory = os.fspath(directory)
    device = os.stat(directory).st_dev
    path = _cache_root() / f"disk-{device}.json"
    if path.exists() and not force:
        try:
            cached = DiskRates(**json.loads(path.read_text()))
            if cached.mixed_gbps > 0:  # a record from before the mixed probe is measured again
                return dataclasses.replace(cached, directory=directory)
        except (ValueError, TypeError):
            pass  # a stale or foreign file: measure again
    rates = measure_disk(directory)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(rates), indent=1))
    except OSError:
        pass  # a read-only cache: the rates still serve this run
    return rates
