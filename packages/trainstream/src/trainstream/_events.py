"""The session's decision log: every automatic choice, with why, readable by memory_report().

Each event also goes to ``logging.getLogger("trainstream")`` (INFO; failures at WARNING), so
applications route it as they route everything else. ``verbose=True`` makes sure it is seen: it
gives that logger a handler writing to stderr when it has none and lowers its level to INFO.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

__all__ = ["Event", "EventLog", "logger"]

logger = logging.getLogger("trainstream")
logger.addHandler(logging.NullHandler())
_verbose_handler: logging.Handler | None = None


def _show_info() -> None:
    """For verbose sessions: INFO records of the trainstream logger reach stderr."""
    global _verbose_handler
    if _verbose_handler is None and not any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        _verbose_handler = logging.StreamHandler(sys.stderr)
        _verbose_handler.setFormatter(logging.Formatter("trainstream %(message)s"))
        logger.addHandler(_verbose_handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


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
        if verbose:
            _show_info()

    def add(self, kind: str, message: str) -> Event:
        event = Event(time.perf_counter() - self._start, kind, message)
        with self._lock:
            self._events.append(event)
        logger.log(logging.WARNING if kind == "error" else logging.INFO, "%s", event)
        return event

    def __iter__(self):
        with self._lock:
            return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)

    def lines(self) -> list[str]:
        return [str(e) for e in self]
