"""CopyTimer: the rate the streamed blocks' copies reach while they copy (memory_report's
``params.link_bytes_per_s``), to set beside the link's measured peak.

On CUDA each fetch is bracketed by two timing events on the H2D stream, recorded after the
stream's waits, so the time between them is the copy's own; pairs are read once their end has
passed (never waited for). On the CPU a fetch is a memory copy timed on the host.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["CopyTimer"]


class CopyTimer:
    """Bytes and seconds of completed copies. At most ``pending`` CUDA pairs wait to be read; older
    unread ones are dropped (a rate from fewer copies, never a wait)."""

    def __init__(self, pending: int = 256):
        self.bytes = 0
        self.seconds = 0.0
        self._pending: collections.deque = collections.deque()
        self._limit = pending

    def start(self, stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def finish(self, start: torch.cuda.Event, stream, nbytes: int) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._pending.append((start, end, nbytes))
        self._read()
        while len(self._pending) > self._limit:
            self._pending.popleft()

    def host(self, seconds: float, nbytes: int) -> None:
        self.bytes += nbytes
        self.seconds += seconds

    def rate(self) -> float | None:
        """Bytes per second over the copies read so far (None before the first)."""
        self._read()
        return self.bytes / self.seconds if self.seconds > 0 else None

    def _read(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end, nbytes = self._pending.popleft()
            self.bytes += nbytes
            self.seconds += start.elapsed_time(end) / 1e3
