"""Chunked losses against plain PyTorch on materialized logits; DPO against its formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import trainstream
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream._losses import token_nll


def _inputs(n=37, d=16, v=29, seed=0, dtype=torch.float64, bias=True, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    return hidden, weight, b, targets


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [1, 4, 37, 1024])
def test_matches_cross_entropy_and_its_gradients(reduction, chunk_size):
    hidden, weight, bias, targets = _inputs()
    ours = trainstream.chunked_cross_entropy(hidden, weight, targets, bias, chunk_size=chunk_size, reduction=reduction)
    ref = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction=reduction)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    for a, b in zip(_grads(ours, hidden, weight, bias), _grads(ref, hidden, weight, bias)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_num_items_divides_like_hugging_face():
    hidden, weight, bias, targets = _inputs()
    summed = trainstream.chunked_cross_entropy(hidden, weight, targets, bias, reduction="sum")
    ours = trainstream.chunked_cross_entropy(hidden, weight, targets, bias, num_items=100)
    assert ours.item() == pytest.approx(summed.item() / 100)


def test_causal_lm_loss_shifts_labels_like_hugging_face():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 9), generator=g)
    labels[0, :3] = -100  # a prompt that does not count
    ours = trainstream.causal_lm_loss(hidden, weight, labels, chunk_size=5)
    logits = hidden @ weight.t()
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)


def test_bf16_matches_the_materialized_bf16_path():
    hidden, weight, _, targets = _inputs(n=64, d=32, v=50, dtype=torch.float32, bias=False)
    h16 = hidden.detach().to(torch.bfloat16).requires_grad_()
    w16 = weight.detach().to(torch.bfloat16).requires_grad_()
    ours = trainstream.chunked_cross_entropy(h16, w16, targets, chunk_size=16)
    ref = F.cross_entropy((h16 @ w16.t()).float(), targets)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    for a, b in zip(_grads(ours, h16, w16), _grads(ref, h16, w16)):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), chunk=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_result_does_not_depend_on_chunk_size(n, chunk, seed):
    hidden, weight, bias, targets = _inputs(n=n, seed=seed, ignore_every=3)
    whole = token_nll(hidden, weight, targets, bias, chunk_size=10_000)
    chunked = token_nll(hidden, weight, targets, bias, chunk_size=chunk)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    assert torch.all(chunked[targets == -100] == 0)


def test_sequence_logprobs_sum_and_average():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 13, (3, 7), generator=g)
    labels[1, :4] = -100
    logp = torch.log_softmax(hidden @ weight.t(), -1)[:, :-1]
    target = labels[:, 1:]
    picked = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1) * (target != -100)
    ref = picked.sum(1)
    ours = trainstream.sequence_logprobs(hidden, weight, labels, chunk_size=4)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    avg = trainstream.sequence_logprobs(hidden, weight, labels, average=True)
    torch.testing.assert_close(avg, ref / (target != -100).sum(1), rtol=1e-12, atol=1e-12)
    unshifted = trainstream.sequence_logprobs(hidden, weight, labels, shift=False)
    assert unshifted.shape == (3,)
    ours.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_dpo_loss_formula_and_rewards():
    pc, pr = torch.tensor([-10.0, -3.0], requires_grad=True), torch.tensor([-12.0, -2.0], requires_grad=True)
    rc, rr = torch.tensor([-11.0, -3.5]), torch.tensor([-11.0, -2.5])
    loss, chosen, rejected = trainstream.dpo_loss(pc, pr, rc, rr, beta=0.5)
    margin = 0.5 * ((pc - rc) - (pr - rr))
    assert loss.item() == pytest.approx((-F.logsigmoid(margin)).mean().item())
    torch.testing.assert_close(chosen, 0.5 * (pc - rc).detach())
    torch.testing.assert_close(rejected, 0.5 * (pr - rr).detach())
    assert not chosen.requires_grad
    loss.backward()
    assert pc.grad[0] < 0  # raising the chosen log-prob lowers the loss
    # policy == reference: the margin is 0 and the loss log 2, with or without smoothing
    same, _, _ = trainstream.dpo_loss(rc, rr, rc, rr, label_smoothing=0.2)
    assert same.item() == pytest.approx(math.log(2))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda h, w, t: trainstream.chunked_cross_entropy(h, w, t, chunk_size=0), "chunk_size=0"),
        (lambda h, w, t: trainstream.chunked_cross_entropy(h, w, t, reduction="none"), "reduction='none'"),
        (lambda h, w, t: trainstream.chunked_cross_entropy(h, w[:, :3], t), "must share D"),
        (lambda h, w, t: trainstream.chunked_cross_entropy(h, w, t[:5]), "leading shape"),
        (lambda h, w, t: trainstream.dpo_loss(t.float(), t.float(), t.float(), t.float(), beta=0), "beta=0"),
    ],
)
def test_bad_input(call, message):
    hidden, weight, _, targets = _inputs(bias=False)
    with pytest.raises(ValueError, match=message):
        call(hidden, weight, targets)
