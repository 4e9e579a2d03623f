"""Wrapped models dropped without ``unwrap()``: found and freed before the next ``wrap()`` plans.

A wrapped model and its session refer to each other (the model's hooks reach the session, the session
holds the model), so ``del model`` alone leaves both to Python's cycle collector, which may not run for a
long time in a large program. Meanwhile the model's weights hold VRAM and its session's optimizer state
holds page-locked host memory, which the next ``wrap()``'s plan does not see as taken (its VRAM budget
is the device's size): the new run would fit on paper and fail at its first step. So ``wrap()`` first
runs a collection when earlier sessions still exist and may hold enough to matter (a collection takes
0.1-0.3 s in a process with transformers loaded), and says what it freed.
"""

from __future__ import annotations

import gc
import weakref

import torch
import ts_pinned

from ._units import fmt_bytes

_sessions: weakref.WeakSet = weakref.WeakSet()  # every session not yet freed, closed or not
MIN_HELD_BYTES = 1 << 30  # what the earlier sessions' models and host state must reach to be worth a collection


def track(session) -> None:
    _sessions.add(session)


def collect_dropped(device: torch.device) -> str | None:
    """Collects garbage when earlier sessions exist and may hold MIN_HELD_BYTES; what that freed (an
    event's text), or None when it did not run or freed no session."""
    before = len(_sessions)
    if before == 0 or sum(_held_bytes(s) for s in list(_sessions)) < MIN_HELD_BYTES:
        return None
    on_gpu = device.type == "cuda"
    vram = torch.cuda.memory_allocated(device) if on_gpu else 0
    host = ts_pinned.default_arena().stats()["arena_used"]
    gc.collect()
    freed = before - len(_sessions)
    if freed == 0:
        return None
    vram_freed = vram - torch.cuda.memory_allocated(device) if on_gpu else 0
    host_freed = host - ts_pinned.default_arena().stats()["arena_used"]
    return (f"{freed} earlier wrapped model(s) no longer referenced but not unwrap()ped were freed before "
            f"planning ({fmt_bytes(vram_freed)} of VRAM, {fmt_bytes(host_freed)} of host "
            f"optimizer state); unwrap() frees a model's session at once")


def _held_bytes(session) -> int:
    """An upper bound of what collecting `session` could free: its model's tensors and its host state."""
    tensors = [*session.model.parameters(), *session.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) + getattr(session, "host_state_bytes", 0)
