"""The session's decision log: every automatic choice, with why, readable by memory_report().

Each event also goes to ``logging.getLogger("trainstream")`` (INFO; failures at WARNING), so
applications route it as they route everything else. ``verbose=True`` also prints it to stdout
as it happens (the demo's plan lines).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

__all__ = ["Event", "EventLog", "logger"]

logger = logging.getLogger("trainstream")
logger.addHandler(logging.NullHandler())


@dataclasses.dataclass(frozen=True)
class Event:
    time: float  # seconds since the session started
    kind: str  # "plan", "optimizer", "switch", "memory", "error", ...
    message: str

    def __str__(self) -> str:
        return f"[{self.time:8.3f}s] {self.kind}: {self.message}"


class EventLog:
    """Append-only, thread-safe; each event is also logged (see the module docstring)."""

    def __init__(self, verbose: bool = False):
        self._start = time.perf_counter()
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self.verbose = verbose

    def add(self, kind: str, message: str) -> Event:
        event = Event(time.perf_counter() - self._start, kind, message)
        with self._lock:
            self._events.append(event)
        logger.log(logging.WARNING if kind == "error" else logging.INFO, "%s", event)
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
