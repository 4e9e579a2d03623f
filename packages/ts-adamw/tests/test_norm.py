"""sum_of_squares vs torch, for mixed dtypes and any thread count."""

from __future__ import annotations

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st


def _reference(tensors):
    return sum(float((t.double() ** 2).sum()) for t in tensors)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 200_000), min_size=0, max_size=5),
       dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), min_size=5, max_size=5),
       scale=st.floats(1e-3, 1e3))
def test_matches_torch(sizes, dtypes, scale):
    gen = torch.Generator().manual_seed(len(sizes))
    tensors = [(torch.randn(n, generator=gen) * scale).to(d) for n, d in zip(sizes, dtypes)]
    ref = _reference(tensors)
    got = ts_adamw.sum_of_squares(tensors)
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-30)


def test_deterministic_across_thread_counts_and_shapes():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300_001, generator=gen), torch.randn(7, 11, generator=gen).bfloat16(),
               torch.randn(65536 * 3, generator=gen).half()]
    results = {ts_adamw.sum_of_squares(tensors, threads=t) for t in (1, 2, None)}
    assert len(results) == 1


def test_rejects_bad_tensors():
    with pytest.raises(ValueError):
        ts_adamw.sum_of_squares([torch.randn(10).double()])
    with pytest.raises(ValueError):
        ts_adamw.sum_of_squares([torch.randn(10)[::2]])
    with pytest.raises(ValueError):
        ts_adamw.sum_of_squares(torch.randn(10))
    assert ts_adamw.sum_of_squares([]) == 0.0


def test_matches_torch_clip_grad_norm():
    params = [torch.nn.Parameter(torch.randn(s)) for s in (10, 1000, 33)]
    for p in params:
        p.grad = torch.randn_like(p)
    norm = ts_adamw.sum_of_squares([p.grad for p in params]) ** 0.5
    ref = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9).item()
    assert norm == pytest.approx(ref, rel=1e-6)
