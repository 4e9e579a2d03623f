"""The session's decision log: every automatic choice, with why, readable by memory_report()."""

from __future__ import annotations

import dataclasses
import threading
import time

__all__ = ["Event", "EventLog"]


@dataclasses.dataclass(frozen=True)
class Event:
    time: float  # seconds since the session started
    kind: str  # "plan", "optimizer", "switch", "memory", "error", ...
    message: str

    def __str__(self) -> str:
        return f"[{self.time:8.3f}s] {self.kind}: {self.message}"


class EventLog:
    """Append-only, thread-safe. ``verbose`` also prints each event as it happens."""

    def __init__(self, verbose: bool = False):
        self._start = time.perf_counter()
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self.verbose = verbose

    def add(self, kind: str, message: str) -> Event:
        event = Event(time.perf_counter() - self._start, kind, message)
        with self._lock:
            self._events.append(event)
        if self.verbose:
            print(f"trainstream {event}", flush=True)
        return event

    def __iter__(self):
        with self._lock:
            return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)

    def lines(self) -> list[str]:
        return [str(e) for e in self]
