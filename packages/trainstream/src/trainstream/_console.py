"""Lines for a console that progress bars share: each is written whole, on a line of its own, with tqdm's bars
(when tqdm is in use) cleared before and drawn again after."""

from __future__ import annotations

import contextlib
import logging
import sys

__all__ = ["ConsoleHandler", "is_console", "write_line"]


def write_line(text: str, stream=None) -> None:
    """Writes `text` and a newline to `stream` (default: sys.stderr as it is now). Live tqdm bars on this stream,
    or on stdout / stderr when `stream` is one of them (a terminal shows both), are cleared first and redrawn
    after, so the line never lands beside a bar. The stream is flushed: its line comes before the next redraw."""
    stream = sys.stderr if stream is None else stream
    tqdm = sys.modules.get("tqdm.std")  # only where something imported tqdm: nothing to clear otherwise
    around = tqdm.tqdm.external_write_mode(file=stream) if tqdm is not None else contextlib.nullcontext()
    with around:
        stream.write(text + "\n")
        stream.flush()


class ConsoleHandler(logging.Handler):
    """A logging handler for a console that progress bars share: each record is one line written by write_line().
    ``stream`` None: sys.stderr, looked up at each record (so a redirected or captured stderr is followed)."""

    def __init__(self, stream=None, level: int = logging.NOTSET, fmt: str = "trainstream %(message)s"):
        super().__init__(level)
        self._stream = stream
        self.setFormatter(logging.Formatter(fmt))

    @property
    def stream(self):
        return sys.stderr if self._stream is None else self._stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record), self.stream)
        except Exception:
            self.handleError(record)


def is_console(handler: logging.Handler) -> bool:
    """Whether `handler` prints to a console: a ConsoleHandler, or a StreamHandler on stdout / stderr."""
    if isinstance(handler, ConsoleHandler):
        return True
    stream = getattr(handler, "stream", None) if isinstance(handler, logging.StreamHandler) else None
    return stream is not None and stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
