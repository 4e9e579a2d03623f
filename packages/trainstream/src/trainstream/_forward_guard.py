"""The next forward waits only for the weights it reads.

Each module that owns trained parameters gets a forward pre-hook that orders
the compute stream after those parameters' updates. A parameter read
functionally (by a module other than its owner, or outside any module's
forward, e.g. a tied output projection in a loss) is caught by the guard on
the root: parameters whose owners did not run in the previous forward are
waited for before the next one starts.
"""

from __future__ import annotations

import torch

from ._slots import ParamSlot

__all__ = ["ForwardGuard"]


class ForwardGuard:
    def __init__(self, model: torch.nn.Module, engine):
        self._engine = engine
        self._owners: dict[int, list[torch.nn.Module]] = {}
        self._ran: set[int] = set()
        self._last_ran: set[int] | None = None
        self._handles = []
        slots = engine.by_param
        for module in model.modules():
            owned = [slots[id(p)] for p in module._parameters.values() if p is not None and id(p) in slots]
            if owned:
                for slot in owned:
                    self._owners.setdefault(id(slot.param), []).append(module)
                self._handles.append(module.register_forward_pre_hook(self._waiter(module, owned)))
        self._handles.append(model.register_forward_pre_hook(self._root_guard, prepend=True))

    def _waiter(self, module: torch.nn.Module, owned: list[ParamSlot]):
        key = id(module)
        engine = self._engine

        def wait_owned(_module, _args):
            self._ran.add(key)
            for slot in owned:
                if slot.pending is not None:
                    engine.wait_weight(slot)

        return wait_owned

    def _root_guard(self, _module, _args) -> None:
        self._last_ran, self._ran = (self._ran or self._last_ran), set()
        if self._last_ran is None:
            return
        for slot in self._engine.slots:
            if slot.pending is None:
                continue
            owners = self._owners.get(id(slot.param), ())
            if not any(id(m) in self._last_ran for m in owners):
                self._engine.wait_weight(slot)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
