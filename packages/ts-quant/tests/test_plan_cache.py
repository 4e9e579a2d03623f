"""quantized_linear's per-weight plans (_plan.py): the cached path gives the bits of the uncached one,
and a plan is rebuilt whenever what it cached can have changed (a re-quantization in place, a new
tensor, a move, another x dtype, new settings)."""

import pytest
import torch
import ts_quant
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_quant import _linear, _plan


def _uncached(x, q, bias=None):
    old = _linear._settings["cache"]
    ts_quant.configure_linear(cache=False)
    try:
        return ts_quant.quantized_linear(x, q, bias)
    finally:
        ts_quant.configure_linear(cache=old)


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


FORMATS = ["int8", "nf4", "fp8", "nvfp4"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(FORMATS), dtype=st.sampled_from(DTYPES), lead=st.sampled_from([(5,), (2, 3), (1, 2, 2)]),
       bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_cached_forward_and_backward_equal_the_uncached(fmt, dtype, lead, bias, strided, seed):
    torch.manual_seed(seed)
    q = ts_quant.quantize(torch.randn(32, 64), fmt)
    base = torch.randn(*lead, 64 * (2 if strided else 1), dtype=dtype)
    view = (lambda t: t[..., ::2]) if strided else (lambda t: t)  # strided: a non-contiguous x
    x = view(base)
    b = torch.randn(32, dtype=dtype) if bias else None
    g = torch.randn(*lead, 32, dtype=dtype)
    # The definition, as quantized_linear computed it before the plans: on 2-D views
    w = q.dequantize(dtype)
    y_ref = torch.nn.functional.linear(x.reshape(-1, 64), w, b).reshape(*lead, 32)
    gx_ref = (g.reshape(-1, 32) @ w).reshape(*lead, 64)
    grads = [(y_ref, gx_ref, None if b is None else g.reshape(-1, 32).sum(0))]
    for cached in (False, True, True):  # the second cached call runs on the plan the first one built
        ts_quant.configure_linear(cache=cached)
        leaf = base.clone().requires_grad_(True)
        xi = view(leaf)
        assert xi.is_contiguous() != strided
        bi = None if b is None else b.clone().requires_grad_(True)
        y = ts_quant.quantized_linear(xi, q, bi)
        y.backward(g)
        grads.append((y.detach(), view(leaf.grad), None if bi is None else bi.grad))
    ts_quant.configure_linear(cache=True)
    for other in grads[1:]:
        for a, c in zip(grads[0], other):
            if a is None:
                assert c is None
            else:
                _equal(a, c)
    assert q._cache, "the cached calls left a plan on the weight"


# Steps that can stale a plan; after each, the cached call must equal an uncached one.
def _requantize_in_place(q, seed):
    torch.manual_seed(seed)
    fresh = ts_quant.quantize(torch.randn(q.shape), q.format, q.block_size, double_quant=q.double_quant)
    q.data.copy_(fresh.data)
    if q.double_quant:
        q.scales.data.copy_(fresh.scales.data)
        q.scales.scales.copy_(fresh.scales.scales)
        q.scale_offset.copy_(fresh.scale_offset)
    else:
        q.scales.copy_(fresh.scales)
    if q.global_scale is not None:
        q.global_scale.copy_(fresh.global_scale)
    return q


def _scales_only_in_place(q, seed):
    s = q.scales.scale_offset if q.double_quant else q.block_scales()
    if q.double_quant:
        q.scale_offset.mul_(1.5)
    elif q.format != "nvfp4":
        s.mul_(0.5)
    else:
        q.global_scale.mul_(2.0)
    return q


def _new_tensors(q, seed):
    torch.manual_seed(seed)
    fresh = ts_quant.quantize(torch.randn(q.shape), q.format, q.block_size, double_quant=q.double_quant)
    q.data, q.scales, q.global_scale, q.scale_offset = fresh.data, fresh.scales, fresh.global_scale, fresh.scale_offset
    return q


def _moved(q, seed):
    return q.pin_memory() if torch.cuda.is_available() else ts_quant.QuantizedTensor.from_state_dict(
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in q.to_state_dict().items()})


def _data_swapped(q, seed):
    q.data.data = q.data.clone()  # .data assignment: no version bump, a new address
    return q


def _settings_changed(q, seed):
    ts_quant.configure_linear(tiles=1 + seed % 2)
    return q


STEPS = [_requantize_in_place, _scales_only_in_place, _new_tensors, _moved, _data_swapped, _settings_changed]


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from([*FORMATS, "nf4dq"]),
       steps=st.lists(st.tuples(st.sampled_from(STEPS), st.sampled_from(DTYPES), st.integers(0, 99)),
                      min_size=1, max_size=5))
def test_plans_follow_every_change_to_the_weight(fmt, steps):
    torch.manual_seed(1)
    double = fmt == "nf4dq"
    q = ts_quant.quantize(torch.randn(32, 512), "nf4" if double else fmt, double_quant=double)
    x = torch.randn(3, 512)
    try:
        _equal(ts_quant.quantized_linear(x, q), _uncached(x, q))
        for step, dtype, seed in steps:
            q = step(q, seed)
            xd = x.to(dtype)
            cached = ts_quant.quantized_linear(xd, q)
            _equal(cached, _uncached(xd, q))
            _equal(ts_quant.quantized_linear(xd, q), cached)  # and again on the plan just made
    finally:
        ts_quant.configure_linear(tiles=1)


def test_backward_after_an_in_place_requantize_uses_the_new_codes():
    torch.manual_seed(2)
    q = ts_quant.quantize(torch.randn(16, 64), "nf4", double_quant=True)
    x = torch.randn(4, 64, requires_grad=True)
    y = ts_quant.quantized_linear(x, q)
    _requantize_in_place(q, 7)  # between forward and backward: backward decodes the weight as it is now
    y.backward(torch.ones_like(y))
    expected = torch.ones(4, 16) @ q.dequantize(torch.float32)
    _equal(x.grad, expected)


def test_attribute_assignment_clears_the_cache_and_pickling_drops_it():
    q = ts_quant.quantize(torch.randn(16, 64), "int8")
    ts_quant.quantized_linear(torch.randn(2, 64), q)
    assert q._cache
    q.dtype = torch.float16
    assert not q._cache
    ts_quant.quantized_linear(torch.randn(2, 64), q)
    assert q.__getstate__()["_cache"] == {}


def test_errors_are_still_checked_on_the_cached_path():
    q = ts_quant.quantize(torch.randn(16, 64), "nf4")
    ts_quant.quantized_linear(torch.randn(2, 64), q)
    with pytest.raises(ValueError, match="x has 32 features but qweight expects 64"):
        ts_quant.quantized_linear(torch.randn(2, 32), q)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        ts_quant.quantized_linear(torch.randn(2, 64), q, torch.randn(8))
    with pytest.raises(ValueError, match="outliers applies to nvfp4"):
        ts_quant.quantized_linear(torch.randn(2, 64), q, None, 0.1)
    with pytest.raises(ValueError, match=r"x dtype torch\.float64 is not supported"):
        ts_quant.quantized_linear(torch.randn(2, 64, dtype=torch.float64), q)
    with pytest.raises(TypeError, match="qweight must be a QuantizedTensor"):
        ts_quant.quantized_linear(torch.randn(2, 64), torch.randn(16, 64))


def test_a_planned_fused_call_that_cannot_run_falls_back_for_that_call(monkeypatch):
    """The plan's fused path on the CPU, with the native call replaced: FusedLinearUnavailable falls back
    to dequantize + matmul with a warning, and the next call tries the fused path again."""
    q = ts_quant.quantize(torch.randn(16, 64), "nf4")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = _uncached(x, q)  # before the plan is installed: configure_linear makes plans stale
    plan = _plan.LinearPlan(q, x.device, "dequantize", "dequantize", 0, _linear._generation[0])
    plan.small, plan.max_rows = "fused_sm90", 8
    q._cache[(x.device, x.dtype)] = plan
    calls = []

    def refuse(self, x, bias, m):
        calls.append(m)
        raise ts_quant.FusedLinearUnavailable("fused_linear: stand-in refusal")

    monkeypatch.setattr(_plan.LinearPlan, "fused", refuse)
    with pytest.warns(RuntimeWarning, match="stand-in refusal.*this call uses dequantize"):
        y = ts_quant.quantized_linear(x, q)
    _equal(y, expected)
    with pytest.warns(RuntimeWarning):
        ts_quant.quantized_linear(x, q)
    assert calls == [3, 3]
    ts_quant.quantized_linear(torch.randn(9, 64, dtype=torch.bfloat16), q)  # past max_rows: not tried
    assert calls == [3, 3] and q._cache[(x.device, x.dtype)] is plan


@pytest.mark.parametrize("step", STEPS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("fmt", [*FORMATS, "nf4dq"])
def test_each_change_alone_rebuilds_or_keeps_a_correct_plan(fmt, step):
    torch.manual_seed(3)
    double = fmt == "nf4dq"
    q = ts_quant.quantize(torch.randn(32, 512), "nf4" if double else fmt, double_quant=double)
    x = torch.randn(3, 512)
    ts_quant.quantized_linear(x, q)
    before = q._cache.get((x.device, x.dtype))
    try:
        q = step(q, 5)
        _equal(ts_quant.quantized_linear(x, q), _uncached(x, q))
    finally:
        ts_quant.configure_linear(tiles=1)
    if step is not _moved:
        ts_quant.quantized_linear(x, q)
        assert q._cache[(x.device, x.dtype)] is not before, "every one of these steps makes the old plan stale"
