"""The next forward reads updated weights, ordered on the device, without the host waiting.

Each module that owns trained parameters gets a forward pre-hook that orders the compute stream
after those parameters' updates still in flight (with ``guard_params=True`` step() has already
ordered every read, so these find nothing to do). A parameter read functionally (by a module
other than its owner, or outside any forward, e.g. a tied output projection in a loss) is caught
by the guard on the root: parameters whose owners did not run in the previous forward are
ordered before the next one starts. The root guard is also where parameters unfrozen since the
last forward start training.
"""

from __future__ import annotations

import torch

from .hooks import EngineHook
from .slots import ParamSlot

__all__ = ["ForwardGuard"]


class ForwardGuard:
    def __init__(self, model: torch.nn.Module, engine):
        self._engine = engine
        self._owners: dict[int, list[torch.nn.Module]] = {}
        self._ran: set[int] = set()
        self._last_ran: set[int] | None = None
        self._hooks: list[EngineHook] = []
        self._handles = []
        slots = engine.by_param
        for module in model.modules():
            owned = [slots[id(p)] for p in module._parameters.values() if p is not None and id(p) in slots]
            if owned:
                for slot in owned:
                    self._owners.setdefault(id(slot.param), []).append(module)
                self._register(module, self._waiter(module, owned))
        self._register(model, self._root_guard, prepend=True)

    def _register(self, module: torch.nn.Module, fn, prepend: bool = False) -> None:
        hook = EngineHook(fn)
        self._hooks.append(hook)
        self._handles.append(module.register_forward_pre_hook(hook, prepend=prepend))

    def _waiter(self, module: torch.nn.Module, owned: list[ParamSlot]):
        key = id(module)
        order_after = self._engine.order_after

        def wait_owned(_module, _args):
            self._ran.add(key)
            for slot in owned:
                if slot.written is not None:
                    order_after(slot)

        return wait_owned

    def _root_guard(self, _module, _args) -> None:
        self._engine.forward_started()
        self._last_ran, self._ran = (self._ran or self._last_ran), set()
        if self._last_ran is None:
            return
        for slot in self._engine.slots:
            if slot.written is None:
                continue
            owners = self._owners.get(id(slot.param), ())
            if not any(id(m) in self._last_ran for m in owners):
                self._engine.order_after(slot)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for hook in self._hooks:
            hook.disable()
        self._handles = []
        self._hooks = []
