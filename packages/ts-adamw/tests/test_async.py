"""adamw_step_async: ordering, many handles in flight, errors on wait, references held until waited."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import ts_adamw
from ts_adamw import _core

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _tensors(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def test_many_handles_in_flight_match_sync():
    sync = [_tensors(10_000 + i, i) for i in range(24)]
    asyn = [tuple(t.clone() for t in ts) for ts in sync]
    for step in (1, 2, 3):
        for p, g, m, v in sync:
            ts_adamw.adamw_step(p, g, m, v, step=step, **KW)
        handles = [ts_adamw.adamw_step_async(p, g, m, v, step=step, **KW) for p, g, m, v in asyn]
        for h in handles:
            assert isinstance(h, ts_adamw.StepHandle)
            h.wait()
            assert h.done()
    for a, b in zip(sync, asyn):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_steps_on_one_tensor_run_in_submission_order():
    p, g, m, v = _tensors(50_000, 7)
    ref = [t.clone() for t in (p, g, m, v)]
    handles = [ts_adamw.adamw_step_async(p, g, m, v, step=s, **KW) for s in range(1, 9)]
    handles[-1].wait()
    assert all(h.done() for h in handles)
    for s in range(1, 9):
        ts_adamw.adamw_step(*ref, step=s, **KW)
    assert torch.equal(p, ref[0]) and torch.equal(m, ref[2])


def test_errors_are_reraised_on_every_wait():
    h = _core._failing_handle("boom in the worker")
    with pytest.raises(ValueError, match="boom in the worker"):
        h.wait()
    assert h.done()
    with pytest.raises(ValueError, match="boom"):
        h.wait()


def test_validation_errors_raise_at_submit():
    p, g, m, v = _tensors(10, 0)
    with pytest.raises(ValueError):
        ts_adamw.adamw_step_async(p, g[:5], m, v, step=1, **KW)


def test_handle_keeps_tensors_alive_until_waited():
    p, g, m, v = _tensors(2_000_000, 1)
    out = torch.empty(2_000_000, dtype=torch.bfloat16)
    refs = [weakref.ref(t) for t in (p, g, m, v, out)]
    h = ts_adamw.adamw_step_async(p, g, m, v, step=1, param_out=out, **KW)
    del p, g, m, v, out
    gc.collect()
    assert all(r() is not None for r in refs)
    h.wait()
    gc.collect()
    assert all(r() is None for r in refs)


def test_dropping_an_unwaited_handle_is_safe():
    p, g, m, v = _tensors(1_000_000, 2)
    expect = [t.clone() for t in (p, g, m, v)]
    ts_adamw.adamw_step(*expect, step=1, **KW)
    h = ts_adamw.adamw_step_async(p, g, m, v, step=1, **KW)
    del h  # waits for the step, then drops the references (with the GIL)
    assert torch.equal(p, expect[0])
