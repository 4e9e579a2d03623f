"""CudaAdamWBatch (the prepared fused CUDA step) against cuda_adamw_step: the same bits for every
dtype combination and placement, and every bad gradient refused before anything is written."""

from __future__ import annotations

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05}
cuda = pytest.mark.skipif(not (ts_adamw.built_with_cuda and torch.cuda.is_available()),
                          reason="needs ts_adamw built with CUDA and a GPU")


def _state(sizes, moment_dtype, out_dtype, device, pinned=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    if pinned:
        ps = [p.pin_memory() for p in ps]
    else:
        ps = [p.to(device) for p in ps]
    ms = [torch.zeros(p.shape, dtype=moment_dtype, device=p.device) for p in ps]
    vs = [torch.zeros(p.shape, dtype=moment_dtype, device=p.device) for p in ps]
    if pinned:  # the kernel reaches them over the link (zero copy)
        ms, vs = [m.pin_memory() for m in ms], [v.pin_memory() for v in vs]
    outs = None if out_dtype is None else [torch.empty(n, dtype=out_dtype, device=device) for n in sizes]
    return ps, ms, vs, outs


def test_without_cuda_the_batch_is_refused_clearly():
    if ts_adamw.built_with_cuda and torch.cuda.is_available():
        pytest.skip("CUDA is here")
    p = torch.zeros(4)
    with pytest.raises(RuntimeError, match="CudaAdamWBatch needs"):
        ts_adamw.CudaAdamWBatch([p], [torch.zeros(4)], [torch.zeros(4)])


@cuda
@pytest.mark.cuda
@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 70_000), min_size=1, max_size=40),
       grad_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       moment_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       out_dtype=st.sampled_from([None, torch.bfloat16, torch.float32]),
       pinned=st.booleans(), keyed=st.booleans())
def test_a_prepared_batch_writes_the_bits_of_cuda_adamw_step(sizes, grad_dtype, moment_dtype, out_dtype, pinned,
                                                              keyed):
    """Same masters, moments and outs as the per-call API over 3 steps (40 tensors: two launches)."""
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(n, generator=gen).to("cuda", grad_dtype) for n in sizes] for _ in range(3)]
    keys = [(i * 7919) & 0xFFFFFFFF for i in range(len(sizes))] if keyed else None
    ref = _state(sizes, moment_dtype, out_dtype, "cuda", pinned)
    ours = _state(sizes, moment_dtype, out_dtype, "cuda", pinned)
    batch = ts_adamw.CudaAdamWBatch(*ours[:3], params_out=ours[3], keys=keys,
                                    grad_dtypes=[grad_dtype] * len(sizes))
    for step, gs in enumerate(grads, 1):
        ts_adamw.cuda_adamw_step(ref[0], gs, ref[1], ref[2], params_out=ref[3], keys=keys, seed=3, step=step, **KW)
        batch.step(gs, seed=3, step=step, **KW)
    torch.cuda.synchronize()
    for a, b in zip(ref, ours):
        if a is not None:
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@cuda
@pytest.mark.cuda
def test_a_batch_launch_bumps_the_written_tensors_versions():
    ps, ms, vs, outs = _state([10, 20], torch.float32, torch.bfloat16, "cuda")
    batch = ts_adamw.CudaAdamWBatch(ps, ms, vs, params_out=outs)
    before = [t._version for t in (*ps, *ms, *vs, *outs)]
    batch.step([torch.ones(10, device="cuda", dtype=torch.bfloat16),
                torch.ones(20, device="cuda", dtype=torch.bfloat16)], step=1, **KW)
    assert all(t._version == v + 1 for t, v in zip((*ps, *ms, *vs, *outs), before))


@cuda
@pytest.mark.cuda
def test_bad_gradients_are_refused_before_anything_is_written():
    ps, ms, vs, outs = _state([16, 8], torch.float32, torch.bfloat16, "cuda")
    batch = ts_adamw.CudaAdamWBatch(ps, ms, vs, params_out=outs)
    snapshot = [t.clone() for t in (*ps, *ms, *vs)]
    good = [torch.ones(16, device="cuda", dtype=torch.bfloat16), torch.ones(8, device="cuda", dtype=torch.bfloat16)]
    cases = {
        "count": [good[0]],
        "dtype": [good[0], torch.ones(8, device="cuda")],
        "numel": [good[0], torch.ones(9, device="cuda", dtype=torch.bfloat16)],
        "device": [good[0], torch.ones(8, dtype=torch.bfloat16)],
        "strided": [good[0], torch.ones(16, device="cuda", dtype=torch.bfloat16)[::2]],
        # a gradient inside a written buffer (the bf16 weight copy itself)
        "alias": [good[0], outs[1]],
    }
    for what, grads in cases.items():
        with pytest.raises(ValueError, match=r"gradient|grads"):
            batch.step(grads, step=1, **KW)
            pytest.fail(f"a bad gradient ({what}) was accepted")
    with pytest.raises(ValueError, match="lr"):
        batch.step(good, step=1, **{**KW, "lr": float("nan")})
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (*ps, *ms, *vs)))


@cuda
@pytest.mark.cuda
def test_a_batch_refuses_state_that_cuda_adamw_step_refuses():
    ps, ms, vs, _ = _state([16], torch.float32, None, "cuda")
    with pytest.raises(ValueError, match="share memory"):
        ts_adamw.CudaAdamWBatch(ps, ps, vs)
    with pytest.raises(ValueError, match=r"pageable|page-locked"):
        ts_adamw.CudaAdamWBatch([torch.zeros(16)], [torch.zeros(16)], [torch.zeros(16)])
    with pytest.raises(ValueError, match="grad_dtypes"):
        ts_adamw.CudaAdamWBatch(ps, ms, vs, grad_dtypes=[torch.int32])
