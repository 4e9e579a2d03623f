"""Signals that cannot tear the engine's state: their Python handlers are held back inside short critical
sections.

A KeyboardInterrupt (Ctrl-C), or any exception a Python signal handler raises (a SIGALRM time limit,
pytest-timeout's signal method, a scheduler's SIGTERM handler that raises SystemExit), is raised between any
two bytecodes of the main thread. Each state transition of the engine (a gradient taken, an update queued, a
step's clipping applied) is a few Python statements; an exception between them would leave a parameter
half-moved (a slot QUEUED with no update queued, which its next wait would wait on forever). Inside
``critical()`` such a signal is recorded and its handler runs when the outermost section ends, so the
exception lands before or after a transition, never inside it. Long waits are never inside a critical
section, so Ctrl-C stays prompt.

Which signals: SIGINT always, and every other signal that has a Python handler (a callable, not SIG_DFL or
SIG_IGN) when a model is wrapped or steps. The handlers are installed by the first wrapped model (main thread
only) and chain to the handler that was there before; a handler installed later by the user is taken over
(and chained to) at the next wrap() or step(); the last session to close puts the previous handlers back.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["critical", "ensure", "install", "uninstall"]

_state = threading.local()
_lock = threading.Lock()
_users = 0
_previous: dict[int, object] = {}  # signal number -> the handler ours replaced (and chains to)


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _handler(signum, frame):
    if _depth() > 0:
        deferred = getattr(_state, "deferred", None)
        if deferred is None:
            deferred = _state.deferred = []
        if all(d[0] != signum for d in deferred):  # a signal pending twice is delivered once, as the OS does
            deferred.append((signum, frame))
        return
    _chain(signum, frame)


def _chain(signum, frame):
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    elif signum == signal.SIGINT:  # SIG_DFL or None (set from C): behave like Python's default
        signal.default_int_handler(signum, frame)


class _Critical:
    """Context manager; re-entrant; costs a thread-local read and two integer updates."""

    __slots__ = ()

    def __enter__(self):
        _state.depth = _depth() + 1

    def __exit__(self, *exc):
        _state.depth -= 1
        if _state.depth == 0:
            deferred = getattr(_state, "deferred", None)
            if deferred:
                _state.deferred = None
                if exc[0] is None:  # an exception already leaving wins; the held signals are dropped then
                    for signum, frame in deferred:  # the first handler that raises ends the delivery
                        _chain(signum, frame)
        return False


_CRITICAL = _Critical()


def critical() -> _Critical:
    """``with critical():`` holds the handled signals back until the block ends."""
    return _CRITICAL


def install() -> bool:
    """Installs the deferring handlers (counted); False, doing nothing, off the main thread."""
    global _users
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        _users += 1
        _take_over()
    return True


def ensure() -> None:
    """Called where no critical section can be open (the start of step()). Re-installs the handlers if someone
    replaced one since (theirs is then the one chained to), and takes over the signals given a Python handler
    since. A section still counted open is one whose exit never ran: a handler that was not ours yet raised as
    the exit began (Python runs handlers on entering a function, before its first statement); it is closed
    here, delivering what it held, so signals are held back for at most one step, never for good."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _users:
        with _lock:
            _take_over()
    if _depth() > 0:
        _state.depth = 1
        _CRITICAL.__exit__(None, None, None)


def _take_over() -> None:
    for signum in _handled_signals():
        current = signal.getsignal(signum)
        if current is not _handler:
            _previous[signum] = current
            signal.signal(signum, _handler)


def _handled_signals() -> list[int]:
    """SIGINT, and the signals whose handler is a Python function now (ours included)."""
    found = [signal.SIGINT]
    for signum in signal.valid_signals():
        if signum != signal.SIGINT and callable(signal.getsignal(signum)):
            found.append(signum)
    return found


def uninstall() -> None:
    """Undoes one successful install(); the last one restores the previous handlers where ours is still in
    place (signal.signal works only on the main thread: elsewhere the handlers stay, harmlessly)."""
    global _users
    with _lock:
        if _users == 0:
            return
        _users -= 1
        on_main = threading.current_thread() is threading.main_thread()
        if _users == 0 and on_main:
            for signum, previous in list(_previous.items()):
                if signal.getsignal(signum) is _handler:
                    if previous is None:  # set from C: Python cannot put that back; its own default is closest
                        previous = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
                    signal.signal(signum, previous)
            _previous.clear()
