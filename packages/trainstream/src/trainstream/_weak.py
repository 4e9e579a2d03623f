"""Callbacks that do not keep their object alive.

A component the session owns and that calls back into the session (a bound method, a lambda over
``self``) makes a reference cycle: refcounting never frees the pair, and what the session holds
(page-locked optimizer state, streamed weights' host copies) stays allocated after ``unwrap()`` until
a full garbage collection happens to run. ``weakly(obj.method)`` is such a callback without the cycle.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

_RAISE = object()


def weakly(method: Callable, gone=_RAISE) -> Callable:
    """A function calling the bound `method` while its object lives; after, it returns `gone` when given,
    else raises ReferenceError."""
    ref = weakref.WeakMethod(method)
    name = method.__qualname__

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            if gone is not _RAISE:
                return gone
            raise ReferenceError(f"{name}: its object no longer exists")
        return bound(*args, **kwargs)

    return call
