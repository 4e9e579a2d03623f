"""CUDA kernel vs torch.optim.AdamW on the GPU, zero-copy (pinned host) state, bf16 paths. Needs a GPU."""

from __future__ import annotations

import pytest
import torch
import ts_adamw

pytestmark = pytest.mark.cuda

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05}
SIZES = [1, 3, 4096, 4097, 100_003, 1 << 20]


def _kw(step, maximize=False):
    b1, b2 = HYPER["betas"]
    return {"lr": HYPER["lr"], "beta1": b1, "beta2": b2, "eps": HYPER["eps"],
            "weight_decay": HYPER["weight_decay"], "step": step, "maximize": maximize}


def _data(sizes, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(device) for n in sizes]
    grads = [[torch.randn(n, generator=gen).to(device) for n in sizes] for _ in range(20)]
    return params, grads


def _torch_reference(params0, grads, maximize=False, grad_dtype=torch.float32):
    params = [p.clone().requires_grad_(True) for p in params0]
    opt = torch.optim.AdamW(params, maximize=maximize, **HYPER)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(grad_dtype).float()
        opt.step()
    return [p.detach() for p in params], opt


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_torch_adamw_on_gpu(maximize, grad_dtype):
    params0, grads = _data(SIZES, "cuda")
    ref, opt = _torch_reference(params0, grads, maximize, grad_dtype)
    params = [p.clone() for p in params0]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, gs in enumerate(grads, 1):
        ts_adamw.cuda_adamw_step(params, [g.to(grad_dtype) for g in gs], ms, vs, **_kw(step, maximize))
    torch.cuda.synchronize()
    for p, r, m, rp in zip(params, ref, ms, opt.param_groups[0]["params"]):
        assert (p - r).abs().max().item() <= 1e-6
        assert (m - opt.state[rp]["exp_avg"]).abs().max().item() <= 1e-6


def test_unaligned_views_and_many_tensors():
    base = torch.randn(200_000, device="cuda")
    params0 = [base[1 + i * 1001: 1 + i * 1001 + 997].clone() for i in range(70)]  # > one table of 32
    gens = [[torch.randn(997, device="cuda") for _ in params0] for _ in range(5)]
    ref, _ = _torch_reference(params0, gens)
    flat = torch.zeros(70 * 997 + 3, device="cuda")
    params = [flat[3 + i * 997: 3 + (i + 1) * 997] for i in range(70)]  # offset 12 bytes: scalar path
    for p, p0 in zip(params, params0):
        p.copy_(p0)
    ms = [torch.zeros(997, device="cuda") for _ in params]
    vs = [torch.zeros(997, device="cuda") for _ in params]
    for step, gs in enumerate(gens, 1):
        ts_adamw.cuda_adamw_step(params, gs, ms, vs, **_kw(step))
    torch.cuda.synchronize()
    for p, r in zip(params, ref):
        assert (p - r).abs().max().item() <= 1e-6


def test_zero_copy_pinned_state_matches_device_state():
    params0, grads = _data([4096 * 3 + 5, 77], "cpu", seed=1)
    dev = [p.cuda() for p in params0]
    dms, dvs = [torch.zeros_like(p) for p in dev], [torch.zeros_like(p) for p in dev]
    host = [p.pin_memory() for p in params0]
    hms = [torch.zeros(p.shape).pin_memory() for p in host]
    hvs = [torch.zeros(p.shape).pin_memory() for p in host]
    outs = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in host]
    for step, gs in enumerate(grads, 1):
        gpu_grads = [g.cuda() for g in gs]
        ts_adamw.cuda_adamw_step(dev, gpu_grads, dms, dvs, **_kw(step))
        ts_adamw.cuda_adamw_step(host, gpu_grads, hms, hvs, params_out=outs, **_kw(step))
    torch.cuda.synchronize()
    for h, d, o in zip(host, dev, outs):
        assert torch.equal(h, d.cpu())
        assert torch.equal(o.cpu(), h.to(torch.bfloat16))


def test_pageable_host_tensor_is_refused():
    p = torch.zeros(10)
    g = torch.zeros(10, device="cuda")
    with pytest.raises(ValueError, match="page-locked"):
        ts_adamw.cuda_adamw_step([p], [g], [torch.zeros(10, device="cuda")], [torch.zeros(10, device="cuda")],
                                 **_kw(1))


def test_bad_input_raises_before_any_change():
    p = torch.randn(10, device="cuda")
    before = p.clone()
    with pytest.raises(ValueError):
        ts_adamw.cuda_adamw_step([p], [torch.zeros(9, device="cuda")], [torch.zeros_like(p)], [torch.zeros_like(p)],
                                 **_kw(1))
    with pytest.raises(ValueError):
        ts_adamw.cuda_adamw_step([p], [torch.zeros_like(p)], [torch.zeros_like(p)], [torch.zeros_like(p)],
                                 **{**_kw(1), "lr": -1.0})
    torch.cuda.synchronize()
    assert torch.equal(p, before)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_params_out_and_bf16_moments_track_the_host_engine(out_dtype):
    params0, grads = _data([100_000, 4097], "cpu", seed=2)
    host = [p.clone() for p in params0]
    hm = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in host]
    hv = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in host]
    dev = [p.cuda() for p in params0]
    dm, dv = [m.cuda() for m in hm], [v.cuda() for v in hv]
    outs = [torch.empty(p.shape, dtype=out_dtype, device="cuda") for p in dev]
    for step, gs in enumerate(grads[:10], 1):
        for p, g, m, v in zip(host, gs, hm, hv):
            ts_adamw.adamw_step(p, g, m, v, seed=11, **_kw(step))
        for p, g, m, v, o in zip(dev, gs, dm, dv, outs):  # one tensor per call: same rounding keys as the host
            ts_adamw.cuda_adamw_step([p], [g.cuda()], [m], [v], params_out=[o], seed=11, **_kw(step))
    torch.cuda.synchronize()
    for h, d, o, m, mh in zip(host, dev, outs, dm, hm):
        assert (h - d.cpu()).abs().max().item() <= 1e-6
        assert (m.cpu().float() - mh.float()).abs().max().item() <= 1e-6
        assert torch.equal(o, d.to(out_dtype))


def test_runs_on_the_given_stream():
    params0, grads = _data([1 << 20], "cuda", seed=3)
    p, m, v = params0[0].clone(), torch.zeros(1 << 20, device="cuda"), torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ts_adamw.cuda_adamw_step([p], [grads[0][0]], [m], [v], **_kw(1))  # current stream = side
    ts_adamw.cuda_adamw_step([p], [grads[1][0]], [m], [v], stream=side.cuda_stream, **_kw(2))
    side.synchronize()
    ref, _ = _torch_reference(params0, grads[:2])
    assert (p - ref[0]).abs().max().item() <= 1e-6


def test_keyed_batch_rounds_exactly_as_single_updates():
    """bf16 moments round stochastically: with keys, one fused launch over several tensors writes
    the same bits as one launch per tensor under the same keys (the engine's resident path)."""
    params0, grads = _data([100_000, 4097, 3], "cuda", seed=4)
    runs = []
    for batched in (False, True):
        ps = [p.clone() for p in params0]
        ms = [torch.zeros(p.shape, dtype=torch.bfloat16, device="cuda") for p in ps]
        vs = [torch.zeros(p.shape, dtype=torch.bfloat16, device="cuda") for p in ps]
        outs = [torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for p in ps]
        keys = [7, 70, 700]
        for step, gs in enumerate(grads[:6], 1):
            if batched:
                ts_adamw.cuda_adamw_step(ps, gs, ms, vs, params_out=outs, seed=5, keys=keys, **_kw(step))
            else:
                for i in range(3):
                    ts_adamw.cuda_adamw_step([ps[i]], [gs[i]], [ms[i]], [vs[i]], params_out=[outs[i]], seed=5,
                                             keys=[keys[i]], **_kw(step))
        torch.cuda.synchronize()
        runs.append((ps, ms, vs, outs))
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
