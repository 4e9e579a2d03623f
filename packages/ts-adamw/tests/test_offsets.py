"""Offsets: a tensor updated in pieces, each with the whole tensor's key and its offset (the index of its element 0
in the whole), gets bit for bit the bf16 moments and weights of one update of the whole (host engine: adamw_steps,
adamw_step, adamw_step_async), also across a 2**32-element rounding window; bad offsets are refused."""

from __future__ import annotations

import itertools

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.01}
WINDOW = 1 << 32  # the rounding hash's window: index >> 32 picks the window key


def _state(n, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, seed=0, steps=2):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(steps)]
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    out = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    return param, grads, m, v, out


def _clone(state):
    param, grads, m, v, out = state
    return param.clone(), grads, m.clone(), v.clone(), None if out is None else out.clone()


def _bounds(n, cuts):
    edges = [0, *sorted(set(cuts)), n]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def _pieces(state, bounds, step):
    """The state's pieces as views (lists of param, grad, exp_avg, exp_avg_sq, out) for one step."""
    param, grads, m, v, out = state
    return ([param[lo:hi] for lo, hi in bounds], [grads[step - 1][lo:hi] for lo, hi in bounds],
            [m[lo:hi] for lo, hi in bounds], [v[lo:hi] for lo, hi in bounds],
            None if out is None else [out[lo:hi] for lo, hi in bounds])


def _whole(state, key, base, step, seed):
    param, grads, m, v, out = state
    ts_adamw.adamw_steps([param], [grads[step - 1]], [m], [v], params_out=None if out is None else [out], seed=seed,
                         keys=[key], offsets=[base], step=step, **KW)


def _same(a, b) -> bool:
    return all(x is None or torch.equal(x, y) for x, y in zip((a[0], a[2], a[3], a[4]), (b[0], b[2], b[3], b[4])))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20_000), data=st.data(), key=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**32 - 1),
       base=st.sampled_from([0, 7, WINDOW - 5000, 3 * WINDOW - 1, 2**62 - 20_000]),
       grad_dtype=st.sampled_from([torch.float32, torch.bfloat16]), out_dtype=st.sampled_from([None, torch.bfloat16]),
       one_call=st.booleans())
def test_pieces_with_their_offsets_round_as_the_whole_tensor(n, data, key, seed, base, grad_dtype, out_dtype,
                                                            one_call):
    """Random cut points; the pieces in one adamw_steps call or one call each; the whole tensor itself at offset
    `base` (its pieces at base + lo), some bases putting a 2**32 window boundary inside the tensor."""
    cuts = data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=6)) if n > 1 else []
    bounds = _bounds(n, cuts)
    whole = _state(n, grad_dtype, out_dtype)
    pieces = _clone(whole)
    for step in (1, 2):
        _whole(whole, key, base, step, seed)
        ps, gs, ms, vs, outs = _pieces(pieces, bounds, step)
        offsets = [base + lo for lo, _ in bounds]
        if one_call:
            ts_adamw.adamw_steps(ps, gs, ms, vs, params_out=outs, seed=seed, keys=[key] * len(bounds),
                                 offsets=offsets, step=step, **KW)
        else:
            for i in range(len(bounds)):
                ts_adamw.adamw_steps([ps[i]], [gs[i]], [ms[i]], [vs[i]], params_out=None if outs is None else [outs[i]],
                                     seed=seed, keys=[key], offsets=[offsets[i]], step=step, **KW)
    assert _same(whole, pieces)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 20_000), data=st.data(), key=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**32 - 1))
def test_async_and_one_tensor_calls_take_the_key_and_offset(n, data, key, seed):
    """adamw_step_async (queued on the lane) and adamw_step over the pieces, with key= and offset=, write the bits
    of adamw_steps over the whole tensor with that key."""
    bounds = _bounds(n, data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=5)))
    whole = _state(n)
    queued, direct = _clone(whole), _clone(whole)
    for step in (1, 2):
        _whole(whole, key, 0, step, seed)
        handles = [ts_adamw.adamw_step_async(p, g, m, v, param_out=o, seed=seed, key=key, offset=lo, step=step, **KW)
                   for (lo, _), p, g, m, v, o in zip(bounds, *_pieces(queued, bounds, step))]
        for (lo, _), p, g, m, v, o in zip(bounds, *_pieces(direct, bounds, step)):
            ts_adamw.adamw_step(p, g, m, v, param_out=o, seed=seed, key=key, offset=lo, step=step, **KW)
        for h in handles:
            h.wait()
    assert _same(whole, queued)
    assert _same(whole, direct)


def test_without_offsets_the_pieces_round_differently():
    """The property above is not vacuous: pieces updated without their offsets draw other random bits."""
    whole = _state(10_000, steps=1)
    pieces = _clone(whole)
    bounds = [(0, 4000), (4000, 10_000)]
    _whole(whole, 3, 0, 1, 5)
    ts_adamw.adamw_steps(*_pieces(pieces, bounds, 1)[:4], seed=5, keys=[3, 3], step=1, **KW)
    assert torch.equal(whole[0], pieces[0])  # the fp32 master does not depend on the rounding bits
    assert not torch.equal(whole[2][4000:], pieces[2][4000:])
    assert torch.equal(whole[2][:4000], pieces[2][:4000])  # the piece at offset 0 is right either way


def test_default_offsets_are_zero():
    a = _state(3000, steps=1)
    b = _clone(a)
    ts_adamw.adamw_steps([a[0]], [a[1][0]], [a[2]], [a[3]], seed=9, keys=[4], step=1, **KW)
    ts_adamw.adamw_steps([b[0]], [b[1][0]], [b[2]], [b[3]], seed=9, keys=[4], offsets=[0], step=1, **KW)
    assert _same(a, b)


@pytest.mark.parametrize("offsets", [
    [0],  # one offset for two tensors
    [0, 1, 2],
    [0, -1],
    [0, 2**62 + 1],
    [0, 1.0],
    [0, True],
    [0, "1"],
    7,
    "01",
    torch.tensor([0, 1]),
])
def test_bad_offsets_are_refused_before_anything_changes(offsets):
    a = _state(8, steps=1)
    b = _clone(a)
    bounds = [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="offsets"):
        ts_adamw.adamw_steps(*_pieces(a, bounds, 1)[:4], keys=[1, 1], offsets=offsets, step=1, **KW)
    assert _same(a, b)


@pytest.mark.parametrize("bad", [{"offset": -1}, {"offset": 2**62 + 1}, {"offset": 1.5}, {"offset": None},
                                 {"key": -1}, {"key": 2**32}, {"key": True}])
def test_bad_key_or_offset_of_one_tensor_calls_are_refused(bad):
    a = _state(8, steps=1)
    b = _clone(a)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        ts_adamw.adamw_step(a[0], a[1][0], a[2], a[3], step=1, **KW, **bad)
    with pytest.raises(ValueError, match=name):
        ts_adamw.adamw_step_async(a[0], a[1][0], a[2], a[3], step=1, **KW, **bad)
    assert _same(a, b)


def test_the_native_call_checks_offsets_too():
    """Below the Python checks: the core refuses a wrong count or a negative offset itself."""
    a = _state(8, steps=1)
    args = ([a[0]], [a[1][0]], [a[2]], [a[3]], [], [])
    hyper = (1e-2, 0.9, 0.99, 1e-8, 0.0, 1, False, 1.0, 0, 0)
    with pytest.raises(ValueError, match=r"offsets has 2 entries for 1 tensors"):
        ts_adamw._core.step_pieces(*args, [0, 0], *hyper)
    with pytest.raises(ValueError, match=r"offsets\[0\]=-1 must be from 0 to 2\*\*62"):
        ts_adamw._core.step_pieces(*args, [-1], *hyper)
