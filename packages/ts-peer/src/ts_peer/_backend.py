"""Where a pool's memory lives and how a rank reads another rank's: CUDA (cudaMalloc buffers
exported by CUDA IPC, copies on the copy engines) or host (shared-memory files, copies with
torch on the CPU: how CI exercises the pools without a GPU).

A backend makes *regions*: one rank's pool as this process can read it (its own buffer, or an
opened handle). Opened handles are cached per handle and closed when the last user releases."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid

import torch

from . import _core
from ._handles import IpcHandle
from ._native import cuda_available, stream_handle, unavailable_reason

__all__ = ["CudaBackend", "HostBackend", "Region", "make_backend"]


class Region:
    """One pool's memory readable here: ``address``/``device`` (CUDA) or ``tensor`` (host)."""

    __slots__ = ("address", "device", "handle", "nbytes", "tensor")

    def __init__(self, nbytes: int, *, address: int = 0, device: int = -1, tensor=None, handle=None):
        self.nbytes, self.address, self.device, self.tensor, self.handle = nbytes, address, device, tensor, handle


class CudaBackend:
    kind = "cuda"

    def __init__(self, device: torch.device):
        if not cuda_available():
            raise RuntimeError(f"PeerPool on {device}: {unavailable_reason()}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)

    def allocate(self, nbytes: int):
        buffer = _core.DeviceBuffer(self.device.index, nbytes)
        return buffer, buffer.tensor()

    def local_region(self, buffer) -> Region:
        return Region(buffer.nbytes, address=buffer.ptr, device=buffer.device)

    def export(self, buffer) -> IpcHandle:
        handle, offset, _size, device = buffer.ipc_export()
        return IpcHandle("cuda", handle, offset, buffer.nbytes, device, _core.pci_bus_id(device), os.getpid())

    def open(self, h: IpcHandle) -> Region:
        if h.kind != "cuda":
            raise ValueError(f"a {h.kind} handle cannot be opened by the CUDA backend: every rank must use one kind")
        if h.pid == os.getpid():
            raise ValueError("this handle was exported by this process; read its memory directly")
        local = _core.device_from_pci_bus_id(h.pci_bus_id) if h.pci_bus_id else h.device
        if local < 0:
            raise RuntimeError(f"the exporting rank's GPU (PCI {h.pci_bus_id}) is not visible in this process; "
                               "peer pools need every rank to see every GPU (do not narrow CUDA_VISIBLE_DEVICES "
                               "per rank; use torch.cuda.set_device)")
        base = _core.ipc_open(h.handle, local)
        return Region(h.nbytes, address=base + h.offset, device=local, handle=h)

    def close(self, region: Region) -> None:
        if region.handle is not None:
            _core.ipc_release(region.handle.handle, region.device)
            region.handle = None

    def shared(self, buffer) -> None:
        """Every rank has opened this rank's export (nothing to do for CUDA)."""

    def free(self, buffer) -> None:
        buffer.release()

    def check_dst(self, dst: torch.Tensor) -> None:
        if dst.device != self.device:
            raise ValueError(f"dst is on {dst.device}, this pool's GPU is {self.device}; copy into a tensor there")

    def copy(self, dst: torch.Tensor, region: Region, offset: int, nbytes: int, stream) -> None:
        _core.copy_async(dst.data_ptr(), self.device.index, region.address + offset, region.device, nbytes,
                         stream_handle(stream, self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _HostMapping:
    __slots__ = ("map", "refs", "tensor")


_host_open: dict[bytes, _HostMapping] = {}  # this process's opened host handles, by path


class HostBuffer:
    """A pool in a shared-memory file (a stand-in for a GPU allocation)."""

    def __init__(self, nbytes: int):
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(directory, f"ts_peer_{os.getpid()}_{uuid.uuid4().hex}")
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def release(self) -> None:
        self.unlink()
        self.tensor = None
        if self.map is not None:
            # A view still alive somewhere (a caller's, a traceback's) keeps the buffer exported:
            # then the mapping goes with the last view; the file is already unlinked.
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None


class HostBackend:
    kind = "host"
    device = torch.device("cpu")

    def allocate(self, nbytes: int):
        buffer = HostBuffer(nbytes)
        return buffer, buffer.tensor

    def local_region(self, buffer) -> Region:
        return Region(buffer.nbytes, tensor=buffer.tensor)

    def export(self, buffer) -> IpcHandle:
        return IpcHandle("host", buffer.path.encode(), 0, buffer.nbytes, -1, "", os.getpid())

    def open(self, h: IpcHandle) -> Region:
        if h.kind != "host":
            raise ValueError(f"a {h.kind} handle cannot be opened by the host backend: every rank must use one kind")
        m = _host_open.get(h.handle)
        if m is None:
            path = h.handle.decode()
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise RuntimeError(f"the shared pool file {path} is gone: its rank closed the pool") from None
            try:
                m = _HostMapping()
                m.map, m.refs = mmap.mmap(fd, 0), 0
            finally:
                os.close(fd)
            m.tensor = torch.frombuffer(m.map, dtype=torch.uint8)
            _host_open[h.handle] = m
        m.refs += 1
        return Region(h.nbytes, tensor=m.tensor[h.offset:h.offset + h.nbytes], handle=h)

    def close(self, region: Region) -> None:
        h, region.handle, region.tensor = region.handle, None, None
        if h is None:
            return
        m = _host_open[h.handle]
        m.refs -= 1
        if m.refs == 0:
            del _host_open[h.handle]
            m.tensor = None
            with contextlib.suppress(BufferError):  # as in HostBuffer.release
                m.map.close()

    def shared(self, buffer) -> None:
        """Every rank has mapped the file: unlink it now, so nothing is left behind if a rank dies."""
        buffer.unlink()

    def free(self, buffer) -> None:
        buffer.release()

    def check_dst(self, dst: torch.Tensor) -> None:
        if dst.device.type != "cpu":
            raise ValueError(f"dst is on {dst.device}; a host-backend pool copies into CPU tensors")

    def copy(self, dst: torch.Tensor, region: Region, offset: int, nbytes: int, stream) -> None:
        dst.view(-1).view(torch.uint8).copy_(region.tensor[offset:offset + nbytes])

    def synchronize(self) -> None:
        pass


def host_open_count() -> int:
    """Host handles mapped in this process now (tests)."""
    return len(_host_open)


def make_backend(backend: str, device) -> CudaBackend | HostBackend:
    """``backend`` "auto" (CUDA when ``device`` is a CUDA device, or None and CUDA works), "cuda" or "host"."""
    if backend not in ("auto", "cuda", "host"):
        raise ValueError(f"backend={backend!r} is not a backend; use one of auto, cuda, host")
    dev = None if device is None else torch.device(device)
    if backend == "auto":
        if dev is not None:
            backend = "cuda" if dev.type == "cuda" else "host"
        else:
            backend = "cuda" if cuda_available() else "host"
    if backend == "host":
        if dev is not None and dev.type != "cpu":
            raise ValueError(f"backend='host' keeps pools in host memory; device must be cpu or None, got {dev}")
        return HostBackend()
    if dev is not None and dev.type != "cuda":
        raise ValueError(f"backend='cuda' needs a CUDA device, got {dev}")
    return CudaBackend(dev or torch.device("cuda"))
