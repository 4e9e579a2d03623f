"""Hooks the engine puts on the user's model and parameters, and what a copy of them becomes.

``copy.deepcopy(model)`` and ``torch.save(model)`` copy a module's hook dictionaries. A copy of a
wrapped model must be a plain model, so each hook copies (and pickles) as ``inert``: a no-op that
holds no reference to the engine, its threads or its locks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

__all__ = ["EngineHook", "inert"]


def inert(*args, **kwargs) -> None:
    """What an engine hook becomes in a copy of the model: nothing."""
    return None


def _inert_factory():
    return inert


class EngineHook:
    """A callable hook that does nothing once disabled and copies as ``inert``.

    ``weak=True`` (a bound method): the hook does not keep the method's object alive, and does nothing
    once it is gone. For hooks that C++ holds (a parameter's post-accumulate-grad hooks, autograd
    callbacks): the cycle collector cannot see through those, so a strong hook back to the engine, which
    holds the parameter, would keep a dropped model's engine, state and worker alive for good.
    """

    __slots__ = ("_fn", "_weak")

    def __init__(self, fn: Callable, weak: bool = False):
        self._weak = weak
        self._fn = weakref.WeakMethod(fn) if weak else fn

    def __call__(self, *args, **kwargs):
        fn = self._fn
        if fn is not None and self._weak:
            fn = fn()
        return None if fn is None else fn(*args, **kwargs)

    def disable(self) -> None:
        self._fn = None

    def __reduce__(self):  # copy.deepcopy and pickle both go through it
        return (_inert_factory, ())
