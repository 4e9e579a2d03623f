"""One host copy per machine of the frozen weights that every data-parallel rank streams.

Under data parallel every rank streams the same frozen blocks (param_offload=), so the ranks of one
machine map one shared-memory file instead of each holding its own copy. ``share()`` is collective
over the default process group (every rank calls it, at wrap()):

  1. every rank sends its machine key (host name, boot id, which /dev/shm), the layout of the bytes
     and a random token; the ranks with this rank's key share, the lowest of them (the leader)
     creates ``/dev/shm/<PREFIX><leader's token>``: unique per job, known to all before it exists;
  2. the leader reserves the whole size (``posix_fallocate``: a full /dev/shm is an error now, not a
     SIGBUS later) and fills it; the others wait for it at the collective;
  3. the others map it (checking it is the leader's file, by inode); after that collective the
     file is unlinked: the mapping lives on until the last process unmaps or exits, so a crash
     after set-up leaves nothing in /dev/shm. A failure before it unlinks the file on every rank
     that knows its name (the token came in step 1, so a follower removes a dead leader's file);
     ``atexit`` covers an exception nobody caught. Only every rank of the machine killed in that
     window of seconds leaves a file behind (named ``PREFIX*``).

Every wait is a collective with the data-parallel timeout (``trainstream.distributed``): a rank that
died raises ``DistributedError`` on the others. No room in /dev/shm (a container's 64 MiB default)
or a file a follower cannot map makes that machine's ranks keep private copies, with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import os
import uuid

import torch

from .._topology import SHM_DIR, machine_key
from .._units import fmt_bytes

__all__ = ["PREFIX", "SHM_DIR", "SharedRegion", "layout_digest", "machine_key", "share"]

PREFIX = "trainstream-weights-"
_pending: set[str] = set()  # files this process knows of that are not unlinked yet


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _pending.discard(path)


@atexit.register
def _unlink_pending() -> None:
    for path in list(_pending):
        with contextlib.suppress(OSError):
            _unlink(path)


def layout_digest(items) -> str:
    """A digest of (name, dtype, shape) items: the ranks must agree on what the bytes hold."""
    return hashlib.sha256(repr(list(items)).encode()).hexdigest()


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves the thread's last CUDA error set, and torch's next kernel-launch
    check would raise it; torch exposes no cudaGetLastError, the loaded runtime does."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).cudaGetLastError()


class SharedRegion:
    """This process's mapping of a machine's shared file: ``tensor`` (uint8, ``nbytes``)."""

    def __init__(self, tensor: torch.Tensor, path: str, leader: bool, local_ranks: int, inode: tuple[int, int]):
        self.tensor, self.path, self.leader, self.local_ranks, self.inode = tensor, path, leader, local_ranks, inode
        self.nbytes = tensor.numel()
        self.registered = False

    def register(self) -> str | None:
        """Page-locks the mapping for this process (cudaHostRegister), so copies from it are async
        DMA; returns why not (then it streams pageable, through ts-pinned's staging ring)."""
        if self.registered or self.tensor is None:
            return None
        if not torch.cuda.is_available():
            return "no CUDA device"
        # ts-pinned has no API to page-lock memory it did not allocate: torch's binding of the runtime call.
        err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 1))  # portable
        if err != 0:
            _clear_cuda_error()
            return f"cudaHostRegister failed (cudaError {err}; the memlock limit?)"
        self.registered = True
        return None

    def release(self) -> None:
        """Unregisters and drops this process's mapping (unmapped once no view of it is left)."""
        if self.registered:
            torch.cuda.synchronize()  # no copy from it may still be in flight
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        self.tensor = None
        _unlink(self.path)  # normally gone since set-up


def _gather(comm, value: dict, what: str) -> list[dict]:
    return [json.loads(b) for b in comm.all_gather_bytes(json.dumps(value).encode(), what)]


def _create(path: str, nbytes: int) -> tuple[torch.Tensor, tuple[int, int]]:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _pending.add(path)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now rather than SIGBUS on first touch
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), (st.st_dev, st.st_ino)


def _open(path: str, nbytes: int, inode: list[int]) -> torch.Tensor:
    st = os.stat(path)
    if (st.st_dev, st.st_ino) != tuple(inode) or st.st_size != nbytes:
        raise OSError(f"{path} is not the file the leader created (another /dev/shm?)")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def share(nbytes: int, digest: str, fill, *, device: torch.device, timeout: float) -> tuple[SharedRegion | None, str]:
    """Collective over the default process group (see the module docstring). ``fill(tensor)`` runs on
    each machine's leader and writes the bytes. Returns (this rank's region, or None for a private
    copy, and a sentence saying what was done and why)."""
    from ..distributed import Comm, ModelMismatch

    comm = Comm(None, device, timeout)
    what = "the set-up of the streamed weights' shared host copy (param_offload=)"
    me = {"key": machine_key(), "nbytes": nbytes, "digest": digest, "token": uuid.uuid4().hex}
    ranks = _gather(comm, me, what)
    if any(r["digest"] != digest or r["nbytes"] != nbytes for r in ranks):
        bad = next(i for i, r in enumerate(ranks) if r["digest"] != digest or r["nbytes"] != nbytes)
        raise ModelMismatch(f"data parallel: the streamed blocks (param_offload=) differ between ranks "
                            f"{comm.rank} and {bad}; every rank must wrap the same model with the same options")
    local = [i for i, r in enumerate(ranks) if r["key"] == me["key"]]
    leader = local[0]
    path = os.path.join(SHM_DIR, PREFIX + ranks[leader]["token"])
    lead = comm.rank == leader
    # Every rank takes part in every collective (the group is global), those alone on their machine too.
    alone = len(local) < 2
    if not alone:
        _pending.add(path)
    region, status, failure = None, {"ok": True}, None
    try:
        if lead and not alone:
            try:
                tensor, inode = _create(path, nbytes)
                fill(tensor)
                status = {"ok": True, "inode": list(inode)}
            except OSError as error:  # no room or no /dev/shm: private copies, with the reason
                status = {"ok": False, "why": f"{SHM_DIR} could not hold {nbytes} bytes ({error})"}
            except Exception as error:
                status, failure = {"ok": False, "why": f"{type(error).__name__}: {error}", "fatal": True}, error
        statuses = _gather(comm, status, what)
        if failure is not None:
            raise failure
        fatal = next((i for i, st in enumerate(statuses) if st.get("fatal")), None)
        if fatal is not None:  # every rank stops here, those of other machines too
            raise RuntimeError(f"rank {fatal} failed to fill the shared host copy of the streamed weights: "
                               f"{statuses[fatal]['why']}")
        theirs = statuses[leader]
        mapped = {"ok": theirs["ok"]}
        if theirs["ok"] and not alone:
            try:
                if not lead:
                    tensor = _open(path, nbytes, theirs["inode"])
                    inode = tuple(theirs["inode"])
            except OSError as error:
                mapped = {"ok": False, "why": f"rank {comm.rank} could not map {path} ({error})"}
        mapped_all = _gather(comm, mapped, what)
        if alone:
            return None, "one rank on this machine: a private host copy"
        _unlink(path)  # every local rank mapped it (or gave up): the file's name is no longer needed
        failed = [m for i, m in enumerate(mapped_all) if i in local and not m["ok"]]
        if not theirs["ok"] or failed:
            why = theirs.get("why") or failed[0]["why"]
            return None, f"a private host copy per rank: {why}"
        region = SharedRegion(tensor, path, lead, len(local), inode)
        return region, (f"one host copy for the {len(local)} ranks on this machine ({fmt_bytes(nbytes)} in "
                        f"{SHM_DIR}, filled by rank {leader})")
    finally:
        if region is None and not alone:
            _unlink(path)
