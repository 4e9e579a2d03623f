"""Hooks the engine puts on the user's model and parameters, and what a copy of them becomes.

``copy.deepcopy(model)`` and ``torch.save(model)`` copy a module's hook dictionaries. A copy of a
wrapped model must be a plain model, so each hook copies (and pickles) as ``inert``: a no-op that
holds no reference to the engine, its threads or its locks.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["EngineHook", "inert"]


def inert(*args, **kwargs) -> None:
    """What an engine hook becomes in a copy of the model: nothing."""
    return None


def _inert_factory():
    return inert


class EngineHook:
    """A callable hook that does nothing once disabled and copies as ``inert``."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable):
        self._fn = fn

    def __call__(self, *args, **kwargs):
        fn = self._fn
        return None if fn is None else fn(*args, **kwargs)

    def disable(self) -> None:
        self._fn = None

    def __reduce__(self):  # copy.deepcopy and pickle both go through it
        return (_inert_factory, ())
