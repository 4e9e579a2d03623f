"""Ctrl-C that cannot tear the engine's state: SIGINT is held back inside short critical sections.

A KeyboardInterrupt is raised by Python between any two bytecodes of the main thread. Each state
transition of the engine (a gradient taken, an update queued, a step's clipping applied) is a few
Python statements; an interrupt between them would leave a parameter half-moved (a count bumped
without the work queued, a queue item nobody waits for). Inside ``critical()`` a SIGINT is recorded
and raised when the outermost section ends, so an interrupt lands before or after a transition,
never inside it. Long waits are never inside a critical section, so Ctrl-C stays prompt.

The handler is installed by the first wrapped model (main thread only) and chains to whatever
handler was there before; a handler installed later by the user is taken over (and chained to)
at the next wrap() or step(); the last session to close puts the previous handler back.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["critical", "ensure", "install", "uninstall"]

_state = threading.local()
_lock = threading.Lock()
_users = 0
_previous = None


def _depth() -> int:
    return getattr(_state, "depth", 0)


def _handler(signum, frame):
    if _depth() > 0:
        _state.deferred = (signum, frame)
        return
    _chain(signum, frame)


def _chain(signum, frame):
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL or None (set from C): behave like Python's default
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
            if deferred is not None:
                _state.deferred = None
                if exc[0] is None:  # an exception already leaving wins; the interrupt is dropped then
                    _chain(*deferred)
        return False


_CRITICAL = _Critical()


def critical() -> _Critical:
    """``with critical():`` holds SIGINT back until the block ends."""
    return _CRITICAL


def install() -> bool:
    """Installs the deferring SIGINT handler (counted); False, doing nothing, off the main thread."""
    global _users
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        _users += 1
        _take_over()
    return True


def ensure() -> None:
    """Re-installs the handler if someone replaced it since (theirs is then the one chained to)."""
    if _users and threading.current_thread() is threading.main_thread():
        with _lock:
            _take_over()


def _take_over() -> None:
    global _previous
    current = signal.getsignal(signal.SIGINT)
    if current is not _handler:
        _previous = current
        signal.signal(signal.SIGINT, _handler)


def uninstall() -> None:
    """Undoes one successful install(); the last one restores the previous handler if ours is still
    in place (signal.signal works only on the main thread: elsewhere the handler stays, harmlessly)."""
    global _users, _previous
    with _lock:
        if _users == 0:
            return
        _users -= 1
        on_main = threading.current_thread() is threading.main_thread()
        if _users == 0 and on_main and signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, _previous if _previous is not None else signal.default_int_handler)
            _previous = None
