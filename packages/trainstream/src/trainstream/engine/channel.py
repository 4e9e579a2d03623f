"""Copies between model memory and host buffers, on dedicated streams, and the upload counter.

A CUDA channel owns a device-to-host, a host-to-device and an optimizer stream per device; copies
are ordered against compute with events, never with a device synchronize. Host updates are
numbered in the order they are queued (their *sequence*). To order the compute stream after
upload n, the host waits until the worker has *issued* it (not until it lands), then the compute
stream waits on its event on the device.

Why not a device-side wait on a counter the H2D stream writes (``cuStreamWaitValue64``), which
would not block the host at all? Such a wait is invisible to CUDA: when it is enqueued before
the write that releases it and the two streams share a hardware queue (8 by default, 1 under
``CUDA_DEVICE_MAX_CONNECTIONS=1``), the write sits behind the wait forever. A wait enqueued
after its write is safe, but then an event does the same job.

The host channel is the same interface for a model on the CPU: copies happen at once, every
token is complete, and waiting for an upload means waiting for the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

__all__ = ["ChannelOwner", "CudaChannel", "HostChannel", "ObservedChannel", "UploadMarks", "WaitObserver", "channel_for",
           "transfer_stats"]

WaitApplied = Callable[[int], None]  # blocks until the worker has handled every update up to a sequence


class UploadMarks:
    """One engine's newest upload: its H2D stream is first in, first out, so once that upload has
    landed every earlier one has too. Written by the engine's worker only."""

    def __init__(self) -> None:
        self.last_event = None


class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.d2h_bytes = self.d2h_copies = self.h2d_bytes = self.h2d_copies = 0

    def count(self, direction: str, nbytes: int) -> None:
        with self._lock:
            if direction == "d2h":
                self.d2h_bytes += nbytes
                self.d2h_copies += 1
            else:
                self.h2d_bytes += nbytes
                self.h2d_copies += 1

    def as_dict(self) -> dict[str, int]:
        return {"d2h_bytes": self.d2h_bytes, "d2h_copies": self.d2h_copies,
                "h2d_bytes": self.h2d_bytes, "h2d_copies": self.h2d_copies}


class HostChannel:
    """Model on the CPU: copies are plain memory copies, complete on return."""

    is_cuda = False

    def __init__(self, device: torch.device):
        self.device = device
        self.stats = _Stats()

    def mark_compute(self) -> None:
        return None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after) -> None:
        return self.to_host_many([src], [dst], after)

    def to_host_many(self, sources: list[torch.Tensor], targets: list[torch.Tensor], after) -> None:
        for src, dst in zip(sources, targets, strict=True):
            dst.copy_(src)
            self.stats.count("d2h", src.numel() * src.element_size())
        return None

    def upload_many(self, sources: list[torch.Tensor], targets: list[torch.Tensor], marks: UploadMarks) -> None:
        for src, dst in zip(sources, targets, strict=True):
            dst.copy_(src)
            self.stats.count("h2d", src.numel() * src.element_size())
        return None

    def to_new_device_tensor(self, src: torch.Tensor, shape, stride, dtype: torch.dtype, after) -> tuple:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        t.as_strided((t.numel(),), (1,)).copy_(src)  # a new dense tensor: its memory order from offset 0
        self.stats.count("h2d", src.numel() * src.element_size())
        return t, None

    def order_compute_after(self, marks: UploadMarks, sequence: int, wait_applied: WaitApplied, event=None) -> None:
        wait_applied(sequence)

    def host_wait(self, token) -> None:
        return None

    def compute_wait(self, token) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CudaChannel:
    """Dedicated D2H / H2D / optimizer streams for one CUDA device; tokens are CUDA events."""

    is_cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.optimizer = torch.cuda.Stream(device)
        self.stats = _Stats()

    def mark_compute(self) -> torch.cuda.Event:
        """An event after everything queued so far on the current (compute) stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, after: torch.cuda.Event) -> torch.cuda.Event:
        """Queues src (device) -> dst (pinned host) on the D2H stream after `after`.
        src's memory is handed to the D2H stream, so the caller may drop it at once."""
        return self.to_host_many([src], [dst], after)

    def to_host_many(self, sources: list[torch.Tensor], targets: list[torch.Tensor],
                     after: torch.cuda.Event) -> torch.cuda.Event:
        """to_host for several pairs: one wait, the copies in order, one event after the last."""
        self.d2h.wait_event(after)
        with torch.cuda.stream(self.d2h):
            for src, dst in zip(sources, targets, strict=True):
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)
        for src in sources:
            self.stats.count("d2h", src.numel() * src.element_size())
        return done

    def upload_many(self, sources: list[torch.Tensor], targets: list[torch.Tensor],
                    marks: UploadMarks) -> torch.cuda.Event:
        """Queues each src (pinned host) -> dst (device) on the H2D stream, in order; one event after the
        last, which also goes to `marks` (the newest upload)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            for src, dst in zip(sources, targets, strict=True):
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        marks.last_event = done
        for src in sources:
            self.stats.count("h2d", src.numel() * src.element_size())
        return done

    def to_new_device_tensor(self, src: torch.Tensor, shape, stride, dtype: torch.dtype,
                             after: torch.cuda.Event | None) -> tuple:
        """A new device tensor of `shape` / `stride` filled from `src` (pinned host, in the tensor's memory
        order) on the H2D stream, once `after` (the copy that wrote `src`) is complete; (tensor, event).

        The tensor is allocated while the H2D stream is current: memory the compute stream just freed may
        still be read by its queued kernels, and only the stream that freed a block may reuse it at once (a
        copy on another stream into compute-freed memory corrupted training with NaN). The caller hands
        it to the stream that uses it (``record_stream``)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            if after is not None:
                self.h2d.wait_event(after)
            t = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
            t.as_strided((t.numel(),), (1,)).copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d)
        self.stats.count("h2d", src.numel() * src.element_size())
        return t, done

    def order_compute_after(self, marks: UploadMarks, sequence: int, wait_applied: WaitApplied,
                            event: torch.cuda.Event | None = None) -> None:
        """The compute stream's next work runs after upload `sequence` landed: the host waits until it
        is issued, the device for `event` (default: the newest upload, which covers every earlier one)."""
        wait_applied(sequence)
        event = event if event is not None else marks.last_event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, token: torch.cuda.Event | None) -> None:
        if token is not None:
            token.synchronize()  # releases the GIL while it waits

    def compute_wait(self, token: torch.cuda.Event | None) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def synchronize(self) -> None:
        for stream in (self.d2h, self.h2d, self.optimizer):
            stream.synchronize()


_channels: dict[torch.device, HostChannel | CudaChannel] = {}
_channels_lock = threading.Lock()


def channel_for(device: torch.device) -> HostChannel | CudaChannel:
    """The process-wide channel of a device (created on first use)."""
    with _channels_lock:
        if device not in _channels:
            _channels[device] = CudaChannel(device) if device.type == "cuda" else HostChannel(device)
        return _channels[device]


def transfer_stats(device: torch.device | str | int | None = None) -> dict[str, int]:
    """Cumulative bytes and copies on TrainStream's D2H and H2D streams of a device
    (default: the current CUDA device, or the CPU channel without CUDA)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    with _channels_lock:
        channel = _channels.get(device)
    return channel.stats.as_dict() if channel else _Stats().as_dict()


class WaitObserver(Protocol):
    """Times the training loop's waits (the stall clock, ``trainstream._stalls.StallClock``): ``host_wait``
    around a wait that blocks the calling thread, ``device_wait`` around one enqueued on the compute stream.
    ``cause`` names what is waited on: "link" or "host_optimizer"."""

    def host_wait(self, cause: str) -> AbstractContextManager: ...

    def device_wait(self, cause: str) -> AbstractContextManager: ...


class ObservedChannel:
    """One owner's view of a (shared) channel whose waits its observer times as link waits."""

    def __init__(self, channel, observer: WaitObserver):
        self.base, self._observer = channel, observer

    def host_wait(self, token) -> None:
        with self._observer.host_wait("link"):
            self.base.host_wait(token)

    def compute_wait(self, token) -> None:
        if token is None or (self.base.is_cuda and token.query()):
            # Nothing left to wait for: no stall to time. (Thousands of these a step, mostly prefetched
            # pages and weights: two timing events each cost the training thread more than the wait.)
            self.base.compute_wait(token)
            return
        with self._observer.device_wait("link"):
            self.base.compute_wait(token)

    def __getattr__(self, name):
        return getattr(self.base, name)


class ChannelOwner:
    """Something that waits on a copy channel (``self.channel``) in the training loop: ``observe`` has an
    observer time those waits, ``observe(None)`` stops it."""

    channel: HostChannel | CudaChannel | ObservedChannel

    def observe(self, observer: WaitObserver | None) -> None:
        base = self.channel.base if isinstance(self.channel, ObservedChannel) else self.channel
        self.channel = base if observer is None else ObservedChannel(base, observer)
