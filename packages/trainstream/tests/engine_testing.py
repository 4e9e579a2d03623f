"""Helpers for the engine's tests: a host update that is slow or fails on demand, and a
consistency check of every slot."""

from __future__ import annotations

import time

import torch
import ts_adamw
from trainstream.engine import SlotState

REAL_ADAMW_STEPS = ts_adamw.adamw_steps  # what the host worker calls (one call per batch of updates)


def slow_updates(monkeypatch, seconds: float = 0.01) -> None:
    """Every host update takes at least `seconds`: reads that do not wait for it see the old weight."""

    def slow(*args, **kwargs):
        time.sleep(seconds)
        REAL_ADAMW_STEPS(*args, **kwargs)

    monkeypatch.setattr(ts_adamw, "adamw_steps", slow)


def failing_update(monkeypatch, index: int, times: int = 1) -> dict:
    """The host update of parameter `index` raises `times` times, before changing anything (as ts-adamw's
    own validation does). A batched call holding it raises too (uncounted): the worker then retries that
    batch's updates one by one, and only the update of `index` fails."""
    calls = {"failed": 0}

    def maybe_fail(*args, **kwargs):
        keys = kwargs["keys"]
        if index in keys and calls["failed"] < times:
            if len(keys) == 1:
                calls["failed"] += 1
            raise RuntimeError("injected host update failure")
        REAL_ADAMW_STEPS(*args, **kwargs)

    monkeypatch.setattr(ts_adamw, "adamw_steps", maybe_fail)
    return calls


def snapshot(model) -> list[dict]:
    """Every active slot's state after synchronize(): step, master, moments and the weight."""
    session = model._trainstream_session
    session.synchronize()
    return [{"step": s.step, "master": s.master.clone(), "exp_avg": s.exp_avg.clone(),
             "exp_avg_sq": s.exp_avg_sq.clone(), "weight": s.param.detach().clone()} for s in session.engine.active]


def assert_consistent(model) -> None:
    """Each slot is at rest, and its weight is its master rounded (fp32 models: equal)."""
    session = model._trainstream_session
    session.synchronize()
    for s in session.engine.active:
        assert s.state in (SlotState.IDLE, SlotState.ACCUMULATING, SlotState.ARRIVED), (s.label, s.state)
        assert torch.equal(s.param.detach().reshape(-1).to(torch.float32),
                           s.master.to(s.param.dtype).to(torch.float32)), s.label


def same_state(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("master", "exp_avg", "exp_avg_sq", "weight"))


def drop_leaked_saved_tensor_hooks() -> int:
    """Pops saved-tensor hooks left on autograd's global stack (how many): an interrupt that lands inside
    torch's own checkpoint or ``saved_tensors_hooks`` context, between its push and its ``try``, leaves its hook
    installed, and every later forward then saves into it. That is torch's state, not trainstream's (which
    pops its own paging hooks itself); the test fixture drops them once a test is over."""
    dropped = 0
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        dropped += 1
    return dropped
