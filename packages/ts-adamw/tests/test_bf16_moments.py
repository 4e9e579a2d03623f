"""bf16 moments: stochastic rounding is unbiased, seeded and thread-count independent; training tracks fp32."""

from __future__ import annotations

import math

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st

N = 20000


def _round_many(x: float, n: int, seed: int, step: int) -> torch.Tensor:
    """exp_avg after one step with beta1=0, lr=0: exactly SR(grad) for n copies of x (one per index)."""
    p = torch.zeros(n)
    g = torch.full((n,), x, dtype=torch.float32)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    ts_adamw.adamw_step(p, g, m, v, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, step=step, seed=seed)
    assert torch.equal(p, torch.zeros(n))
    return m


def _neighbours(x: float) -> tuple[float, float]:
    t = torch.tensor([x])
    down = (t.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((t.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    return down.item(), up.item()


finite = st.floats(min_value=2.0**-100, max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=30, deadline=None)
@given(magnitude=finite, negative=st.booleans(), seed=st.integers(0, 2**64 - 1), step=st.integers(1, 10**6))
def test_stochastic_rounding_is_unbiased(magnitude, negative, seed, step):
    x = -magnitude if negative else magnitude
    m = _round_many(x, N, seed, step).double()
    lo, hi = sorted(_neighbours(abs(x)))
    lo, hi = (-hi, -lo) if negative else (lo, hi)
    assert bool(((m == lo) | (m == hi)).all())  # only the two neighbours ever appear
    gap = hi - lo
    frac = (x - lo) / gap
    stderr = gap * math.sqrt(max(frac * (1 - frac), 1e-12) / N)
    assert abs(m.mean().item() - x) <= 5 * stderr + 1e-12 * abs(x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32), step=st.integers(1, 1000), n=st.integers(1, 70000))
def test_results_do_not_depend_on_thread_count(seed, step, n):
    gen = torch.Generator().manual_seed(seed % 1000)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    runs = []
    for threads in (1, 2, None):
        p = p0.clone()
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        ts_adamw.adamw_step(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=step,
                            seed=seed, threads=threads)
        runs.append((p, m, v))
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)


def test_seed_and_step_change_the_rounding():
    x = 1.0 + 2.0**-10  # halfway-ish between bf16 neighbours: rounding is random
    a = _round_many(x, 4096, seed=1, step=1)
    assert torch.equal(a, _round_many(x, 4096, seed=1, step=1))
    assert not torch.equal(a, _round_many(x, 4096, seed=2, step=1))
    assert not torch.equal(a, _round_many(x, 4096, seed=1, step=2))


def test_exact_values_and_specials_round_to_themselves():
    vals = torch.tensor([0.0, 1.0, -2.5, 3.0e38, -1.5e-38, 2.0**-130])  # exact bf16 values (incl. subnormal)
    p, m, v = torch.zeros(6), torch.zeros(6, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.bfloat16)
    ts_adamw.adamw_step(p, vals, m, v, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, step=1)
    assert torch.equal(m.float(), vals.bfloat16().float())
    nan = torch.tensor([float("nan")] * 3)
    m2 = torch.zeros(3, dtype=torch.bfloat16)
    ts_adamw.adamw_step(torch.zeros(3), nan, m2, torch.zeros(3, dtype=torch.bfloat16), lr=0.0, beta1=0.0,
                        beta2=0.0, eps=1e-8, weight_decay=0.0, step=1)
    assert bool(torch.isnan(m2).all())


def _train(moment_dtype: torch.dtype, steps: int = 150) -> list[float]:
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = torch.sin(x @ torch.randn(16, 1)) + 0.1 * torch.randn(512, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = ts_adamw.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, moment_dtype=moment_dtype, seed=5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_bf16_moment_training_tracks_fp32():
    fp32, bf16 = _train(torch.float32), _train(torch.bfloat16)
    assert fp32[-1] < 0.5 * fp32[0]
    assert bf16[-1] < 0.5 * bf16[0]
    for a, b in zip(fp32[10::10], bf16[10::10]):
        assert abs(a - b) <= 0.05 * a + 1e-3
