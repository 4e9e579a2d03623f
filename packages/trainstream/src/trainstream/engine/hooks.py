"""Hooks the engine puts on the user's model and parameters, and what a copy of them becomes.

``copy.deepcopy(model)`` and ``torch.save(model)`` copy a module's hook dictionaries. A copy of a
wrapped model must be a plain model, so each hook copies (and pickles) as ``inert``: a no-op that
holds no reference to the engine, its threads or its locks. ``PlainDeepcopy`` then removes those
entries from a deep copy, so it carries no hooks at all (a pickle keeps the no-ops: the loading side
runs no code of ours to remove them).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch

__all__ = ["EngineHook", "PlainDeepcopy", "inert", "remove_inert_hooks"]


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


def _is_inert(hook) -> bool:
    return hook is inert or getattr(hook, "hook", None) is inert  # torch wraps some hooks (_WrappedHook)


def remove_inert_hooks(model: torch.nn.Module) -> int:
    """Deletes every ``inert`` hook from `model`'s modules (and their handles' side tables); returns how many."""
    removed = 0
    for module in model.modules():
        state = vars(module)
        gone: set[int] = set()
        for name, hooks in state.items():
            if name.endswith("hooks") and isinstance(hooks, dict):
                ids = [key for key, hook in hooks.items() if _is_inert(hook)]
                for key in ids:
                    del hooks[key]
                gone.update(ids)
        for name in ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            table = state.get(name)
            if isinstance(table, dict):
                for key in gone & table.keys():
                    del table[key]
        removed += len(gone)
    return removed


class PlainDeepcopy:
    """``copy.deepcopy`` of a wrapped model (set as the model's ``__deepcopy__`` by wrap(), removed by
    unwrap()): the default copy of everything but this attribute and the session, then the inert hooks
    removed, so the copy is a plain model with the current weights. Holds the model weakly."""

    __slots__ = ("_model", "_skip")

    def __init__(self, model: torch.nn.Module, skip: tuple[str, ...]):
        self._model = weakref.ref(model)
        self._skip = ("__deepcopy__", *skip)

    def __call__(self, memo: dict) -> torch.nn.Module:
        model = self._model()
        cls = type(model)
        new = cls.__new__(cls)
        memo[id(model)] = new
        # The class's own __getstate__ (Module's drops a compiled call of the original) without ours.
        state = {k: v for k, v in model.__getstate__().items() if k not in self._skip}
        new.__setstate__(copy.deepcopy(state, memo))  # as copy's own reconstruction of a Module
        remove_inert_hooks(new)
        return new

    def __reduce__(self):  # a pickle of the model (torch.save) carries no copier
        return (_no_copier, ())


def _no_copier():
    return None
