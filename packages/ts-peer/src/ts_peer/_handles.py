"""IpcHandle: what one rank sends the others so they can read its pool, and its byte format."""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["KINDS", "IpcHandle"]

KINDS = ("cuda", "host")
_MAGIC = b"TSPEER"
_VERSION = 1
# magic, version, kind, device, offset, nbytes, pid, len(handle), len(pci_bus_id)
_HEADER = struct.Struct("<6sBBiQQIHH")


@dataclass(frozen=True)
class IpcHandle:
    """An exported allocation: ``kind`` "cuda" (``handle`` is the 64-byte cudaIpcMemHandle_t) or
    "host" (``handle`` is the shared-memory file's path, UTF-8); the exported range starts
    ``offset`` bytes into it and spans ``nbytes``. ``device`` and ``pci_bus_id`` name the
    exporter's GPU (its index there, and the bus id that finds it in another process); ``pid``
    the exporting process (a process cannot open its own CUDA handle)."""

    kind: str
    handle: bytes
    offset: int
    nbytes: int
    device: int = -1
    pci_bus_id: str = ""
    pid: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"IpcHandle kind={self.kind!r} is not a kind; use one of {', '.join(KINDS)}")
        if not isinstance(self.handle, bytes) or not self.handle:
            raise ValueError("IpcHandle.handle must be non-empty bytes")
        for name in ("offset", "nbytes", "pid"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"IpcHandle.{name}={value!r} must be an int >= 0")
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < -1:
            raise ValueError(f"IpcHandle.device={self.device!r} must be an int >= -1 (-1: host memory)")

    def to_bytes(self) -> bytes:
        """A self-describing byte string (magic, version, fields); ``from_bytes`` reads it back."""
        bus = self.pci_bus_id.encode()
        header = _HEADER.pack(_MAGIC, _VERSION, KINDS.index(self.kind), self.device, self.offset, self.nbytes,
                              self.pid, len(self.handle), len(bus))
        return header + self.handle + bus

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        """The handle ``to_bytes`` wrote; ValueError naming what is wrong with anything else."""
        data = bytes(data)
        if len(data) < _HEADER.size or not data.startswith(_MAGIC):
            raise ValueError("not a ts_peer IpcHandle (bad magic or too short); pass what IpcHandle.to_bytes() made")
        _magic, version, kind, device, offset, nbytes, pid, n_handle, n_bus = _HEADER.unpack_from(data)
        if version != _VERSION:
            raise ValueError(f"IpcHandle format version {version} is not {_VERSION}: every rank must run the same "
                             "ts-peer version")
        if kind >= len(KINDS):
            raise ValueError(f"IpcHandle kind code {kind} is unknown")
        if len(data) != _HEADER.size + n_handle + n_bus:
            raise ValueError(f"IpcHandle bytes have length {len(data)}, the header says "
                             f"{_HEADER.size + n_handle + n_bus}: truncated or padded")
        handle = data[_HEADER.size:_HEADER.size + n_handle]
        bus = data[_HEADER.size + n_handle:].decode()
        return cls(KINDS[kind], handle, offset, nbytes, device, bus, pid)
