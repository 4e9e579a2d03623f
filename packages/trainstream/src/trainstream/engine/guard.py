"""The next forward reads updated weights, ordered on the device, without the host waiting.

Each module that owns trained parameters gets a forward pre-hook that orders the compute stream
after those parameters' updates still in flight (with ``guard_params=True`` step() has already
ordered every read, so these find nothing to do). A parameter read functionally (by a module
other than its owner, or outside any forward, e.g. a tied output projection in a loss) is caught
by the guard on the root: parameters whose owners did not run in the previous forward are
ordered before the next one starts. The root guard is also where parameters unfrozen since the
last forward start training.

Under torch.compile the per-module waits do nothing (traced, they would put guards on the engine's
state: a recompile whenever an update is pending or not). Once dynamo has compiled anything in this
process the root guard, which always runs eagerly, orders every pending update before the forward
starts, and the compile itself does too: the moment a region is compiled (dynamo's start callback,
eager, before that region runs) every pending update is ordered, so the first compiled forward after
eager ones reads updated weights as well. The cost: with host AdamW, a compiled forward starts after
the last update is issued instead of overlapping the last ones.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

from .hooks import EngineHook
from .slots import ParamSlot

__all__ = ["ForwardGuard"]

_is_compiling = torch.compiler.is_compiling


def _dynamo_has_compiled() -> bool:
    """Whether dynamo has compiled a frame in this process (code compiled before wrap() can run now)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return dynamo is not None and dynamo.counters["frames"]["ok"] > 0


def _register_compile_start(fn, registered=None):
    """Calls fn at the start of every dynamo compile (eagerly, before the compiled code first runs);
    `registered`: what an earlier call returned, kept when dynamo still holds it."""
    from torch._dynamo.callback import callback_handler

    callbacks = callback_handler.start_callbacks
    if registered is not None and any(c is registered for c in callbacks):
        return registered
    return callback_handler.register_start_callback(fn)


def _remove_compile_start(fn) -> None:
    if fn is None:
        return
    from torch._dynamo.callback import callback_handler

    with contextlib.suppress(ValueError):  # already removed (dynamo's reset clears its callbacks)
        callback_handler.remove_start_callback(fn)


def _compile_callback(guard_ref):
    def compile_started(*_args) -> None:
        guard = guard_ref()
        if guard is not None:
            guard.compiled = True
            guard._order_all()

    return compile_started


class ForwardGuard:
    def __init__(self, model: torch.nn.Module, engine):
        self._engine = engine
        self._owners: dict[int, list[torch.nn.Module]] = {}
        self._ran: set[int] = set()
        self._last_ran: set[int] | None = None
        self._hooks: list[EngineHook] = []
        self._handles = []
        slots = engine.by_param
        sites = []
        for module in model.modules():
            owned = [slots[id(p)] for p in module._parameters.values() if p is not None and id(p) in slots]
            if owned:
                name = next(n for n, p in module._parameters.items() if p is owned[0].param)
                sites.append((module._parameters, name, owned[0].param))
                for slot in owned:
                    self._owners.setdefault(id(slot.param), []).append(module)
                self._register(module, self._waiter(module, owned))
        # Samples of (module._parameters, name, parameter) the optimizer trains, checked at each forward: the
        # first and last owning modules' (fully_shard() replaces every module's; two keep the check O(1)).
        self._sites = [sites[0], sites[-1]] if sites else []
        self._ddp_noted = False
        self._register(model, torch.compiler.disable(self._root_guard), prepend=True)
        # Sticky: after any compile, a forward may skip the per-module waits (module docstring).
        self.compiled = _dynamo_has_compiled()
        self._compile_started = _compile_callback(weakref.ref(self))  # dynamo's list must not keep the engine alive
        self._on_compile = _register_compile_start(self._compile_started)

    def _register(self, module: torch.nn.Module, fn, prepend: bool = False) -> None:
        hook = EngineHook(fn)
        self._hooks.append(hook)
        self._handles.append(module.register_forward_pre_hook(hook, prepend=prepend))

    def _waiter(self, module: torch.nn.Module, owned: list[ParamSlot]):
        key = id(module)
        order_after = self._engine.order_after

        def wait_owned(_module, _args):
            if _is_compiling():  # the root guard and the compile callback ordered these updates
                return
            self._ran.add(key)
            for slot in owned:
                if slot.written is not None:
                    order_after(slot)

        return wait_owned

    def _order_all(self) -> None:
        for slot in self._engine.slots:
            if slot.written is not None:
                self._engine.order_after(slot)

    def _check_parameters(self) -> None:
        """The optimizer's parameters are still the model's: ``fully_shard()`` after ``wrap()``, or a parameter
        assigned anew, would leave the optimizer training tensors the forward no longer reads."""
        for parameters, name, param in self._sites:
            if parameters.get(name) is not param:
                raise RuntimeError(f"parameter {name!r} was replaced after wrap() (by fully_shard(), or an "
                                   f"assignment): the optimizer would go on training the old one, which the forward "
                                   f"no longer reads. Call trainstream.unwrap(model) before replacing parameters, "
                                   f"then wrap() again (to shard with FSDP2, call fully_shard() first, then wrap(): "
                                   f"docs/distributed.md)")

    def _note_ddp(self) -> None:
        """Once: the model runs inside DistributedDataParallel (a Trainer's under torchrun / accelerate launch
        wraps it so): DDP averages the gradients, then data parallel averages the averages, which changes
        nothing but costs a second reduction."""
        if self._ddp_noted or getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None) is None:
            return
        self._ddp_noted = True
        self._engine.events.add("distributed", "the model runs inside DistributedDataParallel (a Trainer's under "
                                               "torchrun or accelerate launch): DDP averages the gradients and "
                                               "trainstream's data parallel then averages those averages, the same "
                                               "values at twice the communication")

    def _root_guard(self, _module, _args) -> None:
        self._check_parameters()
        self._note_ddp()
        self._engine.forward_started()
        self._on_compile = _register_compile_start(self._compile_started, self._on_compile)  # torch._dynamo.reset() drops it
        if self.compiled:
            self._order_all()
            return
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
        _remove_compile_start(self._on_compile)
        self._on_compile = None
        for handle in self._handles:
            handle.remove()
        for hook in self._hooks:
            hook.disable()
        self._handles = []
        self._hooks = []
