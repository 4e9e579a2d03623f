"""The session's decision log: every automatic choice, with why, readable by memory_report().

Each event is a record of ``logging.getLogger("trainstream")``: ``"kind: message"`` at INFO, failures
(kind "error") at WARNING, details that do not apply to this machine (a GPU feature on a CPU run) at DEBUG;
the record's ``trainstream_event`` attribute is the Event. An application routes them as it routes
everything else. Without any logging configuration, WARNING records are printed to stderr (as logging's
last resort would, named ``trainstream error: ...``) and the rest stays silent; ``verbose=True`` prints
INFO records too. A record is printed by trainstream only where no handler the application configured
already prints it to stdout or stderr, so nothing appears twice.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ._console import ConsoleHandler, is_console

__all__ = ["Event", "EventLog", "logger"]

logger = logging.getLogger("trainstream")
logger.addHandler(logging.NullHandler())  # the last-resort printing is EventLog's own (see the docstring)
_CONSOLE = ConsoleHandler()  # where verbose=True, and warnings nothing else handles, are printed


@dataclasses.dataclass(frozen=True)
class Event:
    time: float  # seconds since the session started
    kind: str  # "plan", "optimizer", "switch", "memory", "error", ...
    message: str
    level: int = dataclasses.field(default=logging.INFO, compare=False)  # its logging level

    def __str__(self) -> str:
        return f"[{self.time:8.3f}s] {self.kind}: {self.message}"


def _chain() -> list[logging.Logger]:
    """The trainstream logger and the ancestors its records propagate to."""
    out, current = [], logger
    while current is not None:
        out.append(current)
        if not current.propagate:
            break
        current = current.parent
    return out


def _configured() -> bool:
    """Whether the application gave trainstream's records any handler (logging.basicConfig(), a handler of its own)."""
    return any(not isinstance(h, logging.NullHandler) for c in _chain() for h in c.handlers)


def _printed(level: int) -> bool:
    """Whether the application's logging configuration prints a record of `level` to stdout or stderr."""
    return logger.isEnabledFor(level) and any(
        level >= h.level and is_console(h) for c in _chain() for h in c.handlers)


class EventLog:
    """Append-only, thread-safe; each event is also logged (see the module docstring)."""

    def __init__(self, verbose: bool = False):
        self._start = time.perf_counter()
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self.verbose = verbose

    def add(self, kind: str, message: str, level: int | None = None) -> Event:
        """Records an event and logs it: at `level`, by default INFO (WARNING for kind "error"); DEBUG for a
        detail that does not apply to this machine (kept in memory_report(), printed by no default)."""
        if level is None:
            level = logging.WARNING if kind == "error" else logging.INFO
        event = Event(time.perf_counter() - self._start, kind, message, level)
        with self._lock:
            self._events.append(event)
        extra = {"trainstream_event": event}
        if logger.isEnabledFor(level):
            logger.log(level, "%s: %s", kind, message, extra=extra, stacklevel=2)
        show = (self.verbose and level >= logging.INFO) or (level >= logging.WARNING and not _configured())
        if show and not _printed(level):
            _CONSOLE.handle(logger.makeRecord(logger.name, level, __file__, 0, "%s: %s", (kind, message), None,
                                              extra=extra))
        return event

    def __iter__(self):
        with self._lock:
            return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)

    def lines(self) -> list[str]:
        return [str(e) for e in self]
