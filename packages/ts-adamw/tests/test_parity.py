"""Host engine vs torch.optim.AdamW (the plain PyTorch reference), 20 steps."""

from __future__ import annotations

import pytest
import torch
import ts_adamw
from ts_adamw import _core

HYPER = [
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "maximize": False},
    {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1, "maximize": False},
    {"lr": 1e-2, "betas": (0.3, 0.5), "eps": 1e-3, "weight_decay": 0.0, "maximize": True},  # lerp weight >= 0.5
    {"lr": 0.0, "betas": (0.0, 0.0), "eps": 1e-8, "weight_decay": 0.5, "maximize": False},
]


def _torch_run(p0, grads, hyper):
    p = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], **hyper)
    for g in grads:
        p.grad = g.float().clone()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def _ts_run(p0, grads, hyper, **kw):
    p = p0.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    b1, b2 = hyper["betas"]
    for step, g in enumerate(grads, 1):
        ts_adamw.adamw_step(p, g, m, v, lr=hyper["lr"], beta1=b1, beta2=b2, eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"], step=step, maximize=hyper["maximize"], **kw)
    return p, m, v


@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_adamw(hyper, grad_dtype):
    gen = torch.Generator().manual_seed(1)
    n = 4099  # odd: SIMD tails
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(20)]
    ref = _torch_run(p0, grads, hyper)
    out = _ts_run(p0, grads, hyper)
    for a, b in zip(out, ref):
        assert (a - b).abs().max().item() <= 1e-6


@pytest.mark.parametrize("grad_scale", [0.5, 3.0, 1.0 / 7.0])
def test_grad_scale_scales_the_gradient_first(grad_scale):
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(20)]
    hyper = {**HYPER[1], "lr": 1e-2}
    ref = _torch_run(p0, [g * grad_scale for g in grads], hyper)
    out = _ts_run(p0, grads, hyper, grad_scale=grad_scale)
    for a, b in zip(out, ref):
        assert (a - b).abs().max().item() <= 1e-6


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_param_out_is_rounded_to_nearest_even(out_dtype):
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(3, 333, generator=gen) * 100
    p.view(-1)[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-7])
    out = torch.empty(999, dtype=out_dtype)  # shapes may differ, numel must match
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ts_adamw.adamw_step(p, torch.randn(3, 333, generator=gen), m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                        weight_decay=0.0, step=1, param_out=out)
    expect = p.reshape(-1).to(out_dtype)
    assert torch.equal(out.view(torch.int16 if out_dtype != torch.float32 else torch.int32)[3:],
                       expect.view(torch.int16 if out_dtype != torch.float32 else torch.int32)[3:])
    assert torch.isnan(out[2]).item()


def test_fp16_param_out_covers_subnormals_and_overflow():
    vals = torch.tensor([6.0e-8, 3.0e-8, 1.0e-5, 65504.0, 65520.0, 7.0e4, -2.9802322e-08, 0.0, -0.0])
    p = vals.clone()
    out = torch.empty_like(p, dtype=torch.float16)
    z = torch.zeros_like(p)
    ts_adamw.adamw_step(p, z.clone(), z.clone(), z.clone(), lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8,
                        weight_decay=0.0, step=1, param_out=out)
    assert torch.equal(p, vals)
    assert torch.equal(out.view(torch.int16), vals.to(torch.float16).view(torch.int16))


def test_every_simd_variant_gives_identical_bits():
    gen = torch.Generator().manual_seed(4)
    n = 5000
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    variants = ["baseline", "avx2", "avx512"][: ["baseline", "avx2", "avx512"].index(_core.best_host_isa()) + 1]
    results = []
    try:
        for isa in variants:
            _core._set_host_isa(isa)
            assert ts_adamw.host_isa() == isa
            for moments in (torch.float32, torch.bfloat16):
                p, m, v = p0.clone(), torch.full((n,), 0.1, dtype=moments), torch.full((n,), 0.2, dtype=moments)
                out = torch.empty(n, dtype=torch.float16)
                ts_adamw.adamw_step(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                    step=3, param_out=out, seed=7)
                results.append((isa, moments, p, m, v, out))
    finally:
        _core._set_host_isa("auto")
    for isa, moments, *tensors in results:
        base = next(r for r in results if r[1] == moments)
        for a, b in zip(tensors, base[2:]):
            assert torch.equal(a, b), (isa, moments)


def test_empty_tensors_are_a_no_op():
    e = torch.empty(0)
    ts_adamw.adamw_step(e, e, e.clone(), e.clone(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, step=1)
