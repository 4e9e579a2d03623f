"""adamw_steps: many tensors in one host call update exactly as one call per tensor under the same keys."""

from __future__ import annotations

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.01}


def _state(sizes, moment_dtype, out_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    ms = [torch.zeros(n, dtype=moment_dtype) for n in sizes]
    vs = [torch.zeros(n, dtype=moment_dtype) for n in sizes]
    outs = None if out_dtype is None else [torch.empty(n, dtype=out_dtype) for n in sizes]
    return params, grads, ms, vs, outs


def _clone(state):
    params, grads, ms, vs, outs = state
    return ([t.clone() for t in params], grads, [t.clone() for t in ms], [t.clone() for t in vs],
            None if outs is None else [t.clone() for t in outs])


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6),
       moments=st.sampled_from([torch.float32, torch.bfloat16]), out=st.sampled_from([None, torch.bfloat16]),
       seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 3))
def test_one_call_over_a_list_equals_one_call_per_tensor(sizes, moments, out, seed, steps):
    batched = _state(sizes, moments, out, 0)
    single = _clone(batched)
    keys = [(i * 7919 + 3) & 0xFFFFFFFF for i in range(len(sizes))]
    for step in range(1, steps + 1):
        ts_adamw.adamw_steps(*batched[:4], params_out=batched[4], seed=seed, keys=keys, step=step, **KW)
        for i in range(len(sizes)):
            ts_adamw.adamw_steps([single[0][i]], [single[1][i]], [single[2][i]], [single[3][i]],
                                 params_out=None if out is None else [single[4][i]], seed=seed, keys=[keys[i]],
                                 step=step, **KW)
    for a, b in zip(batched, single):
        if a is not None:
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_without_keys_each_tensor_rounds_as_adamw_step_at_its_position_zero():
    """The default key of a one-tensor list is 0, as adamw_step's: the two give the same bits."""
    a = _state([3000], torch.bfloat16, torch.bfloat16, 1)
    b = _clone(a)
    ts_adamw.adamw_steps(*a[:4], params_out=a[4], seed=9, step=1, **KW)
    ts_adamw.adamw_step(b[0][0], b[1][0], b[2][0], b[3][0], param_out=b[4][0], seed=9, step=1, **KW)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b) if x is not None)


@pytest.mark.parametrize("bad", [
    {"keys": [1]},  # one key for two tensors
    {"keys": [1, -1]},
    {"params_out": [torch.empty(4, dtype=torch.bfloat16)]},  # one out for two tensors
    {"lr": float("nan")},
])
def test_bad_input_is_refused_before_anything_changes(bad):
    state = _state([4, 4], torch.float32, None, 2)
    before = _clone(state)
    with pytest.raises(ValueError):
        ts_adamw.adamw_steps(*state[:4], **{"step": 1, **KW, **bad})
    assert all(torch.equal(x, y) for x, y in zip(state[0] + state[2] + state[3], before[0] + before[2] + before[3]))


def test_lists_of_different_lengths_are_refused():
    params, grads, ms, vs, _ = _state([4, 4], torch.float32, None, 3)
    with pytest.raises(ValueError, match="one entry per tensor"):
        ts_adamw.adamw_steps(params, grads[:1], ms, vs, step=1, **KW)
