"""Aliased buffers are refused before anything is written; every tensor written gets its version bumped,
so autograd refuses a backward that saved one of them."""

from __future__ import annotations

import itertools

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_adamw import _core

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
N = 64
NAMES = ("param", "grad", "exp_avg", "exp_avg_sq", "param_out")
WRITTEN = ("param", "exp_avg", "exp_avg_sq", "param_out")


def fresh() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"param": torch.randn(N), "grad": torch.randn(N), "exp_avg": torch.zeros(N),
            "exp_avg_sq": torch.zeros(N), "param_out": torch.zeros(N)}


def call(t: dict, fn=ts_adamw.adamw_step):
    return fn(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], param_out=t["param_out"], **HYPER)


PAIRS = [(a, b) for a, b in itertools.combinations(NAMES, 2) if a in WRITTEN or b in WRITTEN]


@pytest.mark.parametrize("fn", [ts_adamw.adamw_step, ts_adamw.adamw_step_async], ids=["sync", "async"])
@pytest.mark.parametrize("a, b", PAIRS)
def test_same_tensor_twice_is_refused(a, b, fn):
    t = fresh()
    t[b] = t[a]
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match=f"{a} and {b} share memory"):
        call(t, fn)
    for k, v in t.items():
        assert torch.equal(v, before[k]), f"{k} changed although the call was refused"


@pytest.mark.parametrize("a, b", PAIRS)
def test_partial_overlap_is_refused(a, b):
    t = fresh()
    base = torch.zeros(2 * N)
    t[a], t[b] = base[:N], base[N // 2: N // 2 + N]  # half of each overlaps
    with pytest.raises(ValueError, match="share memory"):
        call(t)


def test_an_overlap_of_one_byte_is_refused():
    t = fresh()
    raw = torch.zeros(8 * N + 8, dtype=torch.uint8)
    t["exp_avg"] = raw[: 4 * N].view(torch.float32)
    t["exp_avg_sq"] = raw[4 * N: 8 * N].view(torch.float32)
    call(t)  # adjacent: fine
    t["param_out"] = raw[4 * N - 2: 6 * N - 2].view(torch.bfloat16)  # its first byte is exp_avg's last
    with pytest.raises(ValueError, match="exp_avg and param_out share memory \\(2 bytes"):
        call(t)


def test_bf16_copy_inside_the_master_is_refused():
    t = fresh()
    t["param_out"] = t["param"].view(torch.bfloat16)[N:]  # the upper half of the fp32 master's bytes
    with pytest.raises(ValueError, match="param and param_out share memory"):
        call(t)


def test_no_param_out_and_shared_gradients_stay_legal():
    t = fresh()
    t["param_out"] = None  # trainstream passes None when the output is the master itself
    call(t)
    shared = torch.randn(N)
    params = [torch.randn(N), torch.randn(N)]
    ms, vs = [torch.zeros(N) for _ in params], [torch.zeros(N) for _ in params]
    _core.step(params, [shared, shared], ms, vs, [], [], 1e-2, 0.9, 0.999, 1e-8, 0.0, 1, False, 1.0, 0, 0)
    assert torch.equal(ms[0], ms[1])


def test_overlap_across_list_entries_is_refused_with_both_names():
    base = torch.zeros(3 * N)
    params = [base[:N], base[N: 2 * N]]
    grads = [torch.randn(N), torch.randn(N)]
    ms = [torch.zeros(N), base[2 * N - 1: 3 * N - 1]]  # exp_avgs[1] starts on params[1]'s last element
    vs = [torch.zeros(N), torch.zeros(N)]
    with pytest.raises(ValueError, match=r"params\[1\] and exp_avgs\[1\] share memory"):
        _core.step(params, grads, ms, vs, [], [], 1e-2, 0.9, 0.999, 1e-8, 0.0, 1, False, 1.0, 0, 0)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3 * N), st.integers(0, 3 * N))
def test_refused_exactly_when_the_byte_ranges_meet(start_m, start_v):
    base = torch.zeros(4 * N + 1)
    m, v = base[start_m: start_m + N], base[start_v: start_v + N]
    p, g = torch.randn(N), torch.randn(N)
    overlap = start_m < start_v + N and start_v < start_m + N
    try:
        ts_adamw.adamw_step(p, g, m, v, **HYPER)
    except ValueError as error:
        assert overlap and "share memory" in str(error)
    else:
        assert not overlap


# ---- version counters ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [ts_adamw.adamw_step, ts_adamw.adamw_step_async], ids=["sync", "async"])
@pytest.mark.parametrize("name", WRITTEN)
def test_backward_refuses_a_saved_tensor_the_step_wrote(name, fn):
    t = fresh()
    if name == "param_out":
        t["param_out"] = torch.zeros(N, dtype=torch.bfloat16)
    loss = (torch.randn(N, requires_grad=True) * t[name]).sum()
    handle = call(t, fn)
    if handle is not None:
        handle.wait()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_parameter_that_requires_grad_is_bumped_too():
    p = torch.randn(N, requires_grad=True)
    loss = (p * p).sum()
    version = p._version
    ts_adamw.adamw_step(p, torch.randn(N), torch.zeros(N), torch.zeros(N), **HYPER)
    assert p._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_gradient_is_read_not_bumped():
    t = fresh()
    loss = (torch.randn(N, requires_grad=True) * t["grad"]).sum()
    version = t["grad"]._version
    call(t)
    assert t["grad"]._version == version
    loss.backward()  # the gradient was only read


def test_a_refused_call_bumps_nothing():
    t = fresh()
    t["exp_avg_sq"] = t["exp_avg"]
    versions = {k: v._version for k, v in t.items()}
    with pytest.raises(ValueError):
        call(t)
    assert {k: v._version for k, v in t.items()} == versions


def test_optimizer_bumps_parameters_and_moments():
    p = torch.nn.Parameter(torch.randn(N))
    opt = ts_adamw.AdamW([p], lr=1e-2)
    p.grad = torch.randn(N)
    opt.step()
    loss = (p * p).sum() + (torch.randn(N, requires_grad=True) * opt.state[p]["exp_avg"]).sum()
    versions = (p._version, opt.state[p]["exp_avg"]._version, opt.state[p]["exp_avg_sq"]._version)
    p.grad = torch.randn(N)
    opt.step()
    assert p._version > versions[0]
    assert opt.state[p]["exp_avg"]._version > versions[1] and opt.state[p]["exp_avg_sq"]._version > versions[2]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inference_tensors_are_accepted():
    with torch.inference_mode():
        t = fresh()
    call(t)  # no version counter to bump, and no error for it
