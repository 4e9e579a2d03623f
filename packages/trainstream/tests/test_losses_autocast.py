"""chunked_cross_entropy under bf16 autocast: at least as close to fp64 as the dense bf16 path.

Autograd runs a CUDA backward on its own thread, where autocast is off; on the CPU it runs on the
caller's, so calling ``backward()`` after leaving the autocast block reproduces the GPU case here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import trainstream
from hypothesis import example, given, settings
from hypothesis import strategies as st


def _case(seed: int, tokens: int, vocab: int, dim: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, dim, generator=generator)
    w = torch.randn(vocab, dim, generator=generator)
    t = torch.randint(0, vocab, (tokens,), generator=generator)
    return h.to(device), w.to(device), t.to(device)


def _grads(loss_fn, h, w, *, autocast: str | None, backward_inside: bool = False):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    if autocast is None:
        loss = loss_fn(hh, ww)
        loss.backward()
    else:
        with torch.autocast(autocast, torch.bfloat16):
            loss = loss_fn(hh, ww)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    return loss.detach().double().cpu(), hh.grad.double().cpu(), ww.grad.double().cpu()


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


def _fp64(h, w, t):
    return _grads(lambda a, b: F.cross_entropy(F.linear(a, b), t.cpu()), h.double().cpu(), w.double().cpu(),
                  autocast=None)


def _dense(t):
    return lambda a, b: F.cross_entropy(F.linear(a, b).float(), t)


def _ours(t, chunk):
    return lambda a, b: trainstream.chunked_cross_entropy(a, b, t, chunk_size=chunk)


def test_issue_case_on_the_cpu_is_closer_to_fp64_than_dense_bf16():
    h, w, t = _case(0, 512, 4000, 128)
    exact = _fp64(h, w, t)
    dense = _grads(_dense(t), h, w, autocast="cpu")
    ours = _grads(_ours(t, 100), h, w, autocast="cpu")
    for i in (1, 2):  # grad of hidden, grad of weight
        assert _rel(ours[i], exact[i]) <= _rel(dense[i], exact[i])
        assert _rel(ours[i], dense[i]) < 0.01  # was 5 % before backward replayed forward's autocast
    assert abs(float(ours[0] - exact[0])) <= abs(float(dense[0] - exact[0])) + 1e-6


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(8, 96), vocab=st.integers(16, 600),
       dim=st.sampled_from([16, 32, 64]), chunk=st.integers(1, 64), inside=st.booleans())
@example(seed=7689, tokens=8, vocab=343, dim=16, chunk=1, inside=False)  # CI found it: 1.063x, within the slack
def test_never_less_accurate_than_dense_bf16(seed, tokens, vocab, dim, chunk, inside):
    h, w, t = _case(seed, tokens, vocab, dim)
    h = h * 2.0  # logits of a few units, like a trained head's
    exact = _fp64(h, w, t)
    dense = _grads(_dense(t), h, w, autocast="cpu", backward_inside=inside)
    ours = _grads(_ours(t, chunk), h, w, autocast="cpu", backward_inside=inside)
    for i in (1, 2):
        # Same bf16 logits as dense; the gradient matmuls run in fp32: never worse beyond noise. The noise:
        # with a few tokens one rounding of the shared bf16 logits can favour the bf16 matmul by chance
        # (8 tokens: 0.0081 against 0.0076), so the slack is an eighth of a bf16 unit (2**-11) of relative
        # error; the bug this guards against (backward without forward's autocast) was 0.05 off.
        assert _rel(ours[i], exact[i]) <= 1.05 * _rel(dense[i], exact[i]) + 2**-11


@pytest.mark.cuda
def test_issue_case_on_the_gpu_matches_dense_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    h, w, t = _case(0, 512, 4000, 128, "cuda")
    exact = _fp64(h, w, t)
    dense = _grads(_dense(t), h, w, autocast="cuda")
    ours = _grads(_ours(t, 100), h, w, autocast="cuda")
    for i in (1, 2):
        assert _rel(ours[i], dense[i]) < 0.02  # the reference holds 2 %; 5.1 % before the fix
        assert _rel(ours[i], exact[i]) <= 1.02 * _rel(dense[i], exact[i])
