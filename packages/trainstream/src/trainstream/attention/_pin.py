"""Pinning the scaled-dot-product-attention backends: the process-wide settings while pins are held,
and their exact restoration when the last one leaves.

Why not ``torch.nn.attention.sdpa_kernel``: the SDPA switches (one per backend) and the priority
order live in torch's global context, for every thread (autograd's device threads included), and
``sdpa_kernel(..., set_priority=True)`` restores them only approximately:
- it saves the *enabled* backends in the old order and, on exit, appends the disabled ones in the
  order of the pin being left, so a backend disabled before the pin (``enable_cudnn_sdp(False)``,
  or the overrideable backend inside another pin) comes back in the wrong place;
- contexts that do not end in the reverse order of their start (a pin entered by a backward hook
  and left by autograd's final callback, two models' pins in one backward, a backward that raised)
  each restore what they saw at entry, which is another pin's state;
- on CUDA, torch sets its default order lazily, at the first SDPA call of the process (cuDNN first on
  sm90/sm100 with cuDNN > 9.15: ``priority_order()`` in ``sdp_utils.cpp``). That first call, made
  inside a pin, overwrites the pin's order, and the pin's exit then restores the order from before
  torch's initialisation: the process keeps flash-first for good.

Here every pin is one entry of one process-wide stack: the first entry saves the complete state
(all five switches and the full order), the applied state is always the newest pin still held, and
when the last one leaves the saved state comes back exactly, whatever the order of leaving. On CUDA
torch's lazy order is initialised (one backend choice, no kernel) before the state is saved.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch.nn.attention import SDPBackend

__all__ = ["Pin", "SdpaState", "caller_state", "held", "initialize_order"]

# torch's own switch names (torch._C._get_<name>_sdp_enabled / _set_sdp_use_<name>).
_SWITCHES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "mem_efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
             "overrideable": SDPBackend.OVERRIDEABLE}


def _switches() -> tuple:
    found = []
    for name, backend in _SWITCHES.items():
        getter = getattr(torch._C, f"_get_{name}_sdp_enabled", None)
        setter = getattr(torch._C, f"_set_sdp_use_{name}", None)
        if getter is not None and setter is not None:  # a torch without the overrideable backend
            found.append((backend, getter, setter))
    return tuple(found)


_SWITCH_FNS = _switches()


def _order() -> tuple[int, ...]:
    return tuple(torch._C._get_sdp_priority_order())  # a list of ints


@dataclasses.dataclass(frozen=True)
class SdpaState:
    """The process-wide SDPA settings: which backends are enabled, and torch's priority order."""

    enabled: frozenset
    priority: tuple[int, ...]

    @classmethod
    def current(cls) -> SdpaState:
        return cls(frozenset([backend for backend, getter, _ in _SWITCH_FNS if getter()]), _order())

    def apply(self) -> None:
        for backend, _, setter in _SWITCH_FNS:
            setter(backend in self.enabled)
        if _order() != self.priority:
            torch._C._set_sdp_priority_order(list(self.priority))

    def pinned(self, backends: list[SDPBackend]) -> SdpaState:
        """This state with only ``backends`` enabled, first in the order, in their order."""
        key = (self, tuple(backends))
        state = _PINNED.get(key)
        if state is None:
            first = [int(b) for b in backends]
            state = SdpaState(frozenset(backends), tuple(first + [i for i in self.priority if i not in first]))
            if len(_PINNED) > 256:
                _PINNED.clear()
            _PINNED[key] = state
        return state


_PINNED: dict[tuple, SdpaState] = {}


class _Stack:
    def __init__(self):
        self.lock = threading.RLock()
        self.saved: SdpaState | None = None  # the state before the first pin still held
        self.pins: list[Pin] = []
        self.initialized = False


_STACK = _Stack()


def initialize_order(device: torch.device | str | None = None) -> None:
    """Makes torch set its lazy default SDPA order now (CUDA only; once per process): asks it which
    backend it would pick for a tiny call, which runs no kernel."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or _STACK.initialized:
        return
    with _STACK.lock:
        if _STACK.initialized:
            return
        _STACK.initialized = True
        before = _order()
        applied = SdpaState.current()
        try:
            q = torch.empty(1, 1, 1, 8, device=device, dtype=torch.float16)  # no kernel (graph capture)
            torch._fused_sdp_choice(q, q, q)
        except Exception:  # no viable backend under the caller's switches: the order is set all the same
            pass
        after = _order()
        if after != before and _STACK.pins:  # pins held: keep them applied, and restore torch's new default
            _STACK.saved = dataclasses.replace(_STACK.saved, priority=after)
            applied.apply()


def caller_state() -> SdpaState:
    """The settings outside every pin (what the caller chose): saved by the first pin still held,
    else the current ones."""
    with _STACK.lock:
        return _STACK.saved if _STACK.saved is not None else SdpaState.current()


def held() -> int:
    """How many pins are held now (tests; 0 when the caller's settings are in force)."""
    return len(_STACK.pins)


class Pin:
    """One hold of ``backends`` (in priority order) on the process-wide SDPA settings.

    ``enter()`` and ``exit()`` may be called from any thread and in any order relative to other
    pins; each is idempotent. ``device_type="cuda"`` initialises torch's lazy order first.
    """

    __slots__ = ("_held", "backends", "device_type")

    def __init__(self, backends: list[SDPBackend], device_type: str = "cpu"):
        self.backends = list(dict.fromkeys(backends))
        self.device_type = device_type
        self._held = False

    @property
    def is_held(self) -> bool:
        return self._held

    def enter(self) -> Pin:
        if self.device_type == "cuda":
            initialize_order("cuda")
        with _STACK.lock:
            if self._held:
                return self
            if not _STACK.pins:
                _STACK.saved = SdpaState.current()
            _STACK.pins.append(self)
            self._held = True
            _STACK.saved.pinned(self.backends).apply()
        return self

    def exit(self) -> None:
        with _STACK.lock:
            if not self._held:
                return
            self._held = False
            _STACK.pins.remove(self)
            if _STACK.pins:
                _STACK.saved.pinned(_STACK.pins[-1].backends).apply()
            else:
                saved, _STACK.saved = _STACK.saved, None
                saved.apply()

    def __enter__(self) -> Pin:
        return self.enter()

    def __exit__(self, *exc) -> None:
        self.exit()
