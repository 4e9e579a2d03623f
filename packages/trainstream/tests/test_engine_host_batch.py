"""Host updates queued together run as one ts_adamw.adamw_steps call (issue 13), and train exactly as one call
per parameter would: fp32 and bf16 moments (stochastic rounding keyed by the parameter), clipping, accumulation."""

from __future__ import annotations

import time

import pytest
import torch
import trainstream
import ts_adamw
import ts_pinned
from engine_testing import REAL_ADAMW_STEPS, same_state, snapshot
from trainstream.engine import updates
from ts_testing import batches, tiny_llama, train

BATCH_MAX_ITEMS = updates.BATCH_MAX_ITEMS  # before any test patches it


def _run(monkeypatch, batch_items: int, **options):
    """Trains tiny_llama three steps with batches of at most `batch_items` updates; the first call of each
    step is slowed so the gradients that arrive meanwhile queue up behind it. Returns (state, call sizes)."""
    monkeypatch.setattr(updates, "BATCH_MAX_ITEMS", batch_items)
    sizes = []

    def recorded(*args, **kwargs):
        sizes.append(len(kwargs["keys"]))
        if sizes[-1] == 1:
            time.sleep(0.002)
        REAL_ADAMW_STEPS(*args, **kwargs)

    monkeypatch.setattr(ts_adamw, "adamw_steps", recorded)
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2, **options)
    train(model, opt, batches(3))
    state = snapshot(model)
    optimizer = trainstream.memory_report(model)["optimizer"]
    assert optimizer["host_calls"] == len(sizes) and optimizer["host_updates"] == sum(sizes)
    trainstream.unwrap(model)
    return state, sizes


@pytest.mark.parametrize("options", [
    {},
    {"moment_dtype": torch.bfloat16},
    {"moment_dtype": torch.bfloat16, "max_grad_norm": 0.5},
    {"accumulation_steps": 2},
])
def test_batched_host_updates_train_bit_for_bit_like_one_call_each(monkeypatch, options):
    alone, alone_sizes = _run(monkeypatch, 1, **options)
    batched, sizes = _run(monkeypatch, BATCH_MAX_ITEMS, **options)
    assert set(alone_sizes) == {1}
    assert max(sizes) > 1, sizes  # some updates did run together
    assert sum(sizes) == sum(alone_sizes)
    assert len(batched) == len(alone) and all(same_state(a, b) for a, b in zip(alone, batched))


def test_large_tensors_and_different_steps_do_not_join(monkeypatch):
    """Only updates of equal step count and hyper-parameters share a call, up to BATCH_MAX_VALUES values in all."""
    from trainstream.engine.slots import ParamSlot

    def slot(numel: int, step: int = 0, lr: float = 1e-3, index: int = 0) -> ParamSlot:
        group = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        s = ParamSlot(torch.nn.Parameter(torch.zeros(numel)), index, group)
        s.allocate("host", torch.float32, ts_pinned.default_arena())
        s.step, s.hyper = step, updates.hyper_of(s, 1.0, 0)
        return s

    small = slot(10)
    limit = updates.BATCH_MAX_VALUES
    assert updates._joins(10, small, slot(10, index=1))
    assert updates._joins(10, small, slot(limit - 10, index=1))  # exactly at the limit
    assert not updates._joins(10, small, slot(limit - 9, index=1))
    assert not updates._joins(limit, small, slot(1, index=1))  # the call is full
    assert not updates._joins(10, small, slot(10, step=1))
    assert not updates._joins(10, small, slot(10, lr=2e-3))
