"""Memory-light losses: cross-entropy and per-sequence log-probabilities of
``hidden @ weight.T`` computed chunk by chunk, so the [tokens, vocab] logits
never exist at once (151,936 x 2,048 fp32 logits are 1.2 GB), and DPO from
per-sequence log-probabilities.

Forward keeps only one float32 per token (the log-sum-exp); backward recomputes
each chunk's logits once to form its gradient.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["causal_lm_loss", "chunked_cross_entropy", "dpo_loss", "sequence_logprobs", "token_nll"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for 16-bit inputs, the input's own for float32/float64."""
    return torch.promote_types(dtype, torch.float32)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(h, weight, bias).to(_acc(h.dtype))


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """(enabled, dtype) of autocast for `device_type` on this thread."""
    if device_type not in ("cuda", "cpu", "xpu", "mps", "hpu", "xla"):
        return False, None
    if not torch.is_autocast_enabled(device_type):
        return False, None
    return True, torch.get_autocast_dtype(device_type)


def _recompute_logits(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The chunk's logits exactly as forward computed them. Backward runs on autograd's own thread
    for CUDA, where autocast is off: recomputing in fp32 there would pair fp32 logits with forward's
    bf16 log-sum-exp, and the softmax would no longer sum to one (5 % gradient error measured)."""
    enabled, dtype = ctx.autocast
    with torch.autocast(h.device.type, dtype=dtype, enabled=enabled) if enabled else contextlib.nullcontext():
        return _logits(h, weight, bias)


class _TokenNLL(torch.autograd.Function):
    """Per-token negative log-likelihood [N] (float32; 0 where ignored)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index):
        n = hidden.shape[0]
        nll = torch.zeros(n, dtype=_acc(hidden.dtype), device=hidden.device)
        lse = torch.zeros_like(nll)
        for start in range(0, n, chunk_size):
            stop = min(n, start + chunk_size)
            logits = _logits(hidden[start:stop], weight, bias)
            t = targets[start:stop]
            valid = t != ignore_index
            chunk_lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
            nll[start:stop] = torch.where(valid, chunk_lse - picked, 0.0)
            lse[start:stop] = chunk_lse
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        ctx.autocast = _autocast_state(hidden.device.type)
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = lse.dtype
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk_size):
            stop = min(n, start + ctx.chunk_size)
            h = hidden[start:stop]
            t = targets[start:stop]
            valid = t != ctx.ignore_index
            # d nll / d logits = softmax - onehot(target), scaled by the incoming gradient.
            probs = torch.exp(_recompute_logits(ctx, h, weight, bias) - lse[start:stop, None])
            probs.scatter_add_(1, torch.where(valid, t, 0)[:, None],
                               torch.full((stop - start, 1), -1.0, dtype=acc, device=probs.device))
            probs *= torch.where(valid, grad_nll[start:stop].to(acc), 0.0)[:, None]
            if need_h:
                grad_h[start:stop] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(probs.t(), h.to(acc))
            if need_b:
                grad_b += probs.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias, chunk_size: int) -> None:
    if hidden.shape[-1] != weight.shape[-1] or weight.ndim != 2:
        raise ValueError(f"hidden [..., D] and weight [V, D] must share D; got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is not valid; use an integer >= 1 (tokens per chunk)")


def token_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
              *, chunk_size: int = 1024, ignore_index: int = -100) -> torch.Tensor:
    """Per-position negative log-likelihood of ``targets`` under ``hidden @ weight.T (+ bias)``,
    shaped like ``targets``, 0 where ``targets == ignore_index``; differentiable. float32 for
    16-bit inputs (float64 for float64)."""
    _check(hidden, weight, targets, bias, chunk_size)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    nll = _TokenNLL.apply(flat_h, weight, bias, targets.reshape(-1), chunk_size, ignore_index)
    return nll.view(targets.shape)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: torch.Tensor | None = None, *, chunk_size: int = 1024, ignore_index: int = -100,
                          reduction: str = "mean", num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against class indices, without the logits.

    ``reduction``: ``"mean"`` over counted positions (or divided by ``num_items``, as Hugging Face
    does under gradient accumulation) or ``"sum"``. Returns a float32 scalar (float64 for float64).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} is not valid; use 'mean' or 'sum'")
    nll = token_nll(hidden, weight, targets, bias, chunk_size=chunk_size, ignore_index=ignore_index)
    total = nll.sum()
    if reduction == "sum":
        return total
    count = num_items if num_items is not None else (targets != ignore_index).sum()
    return total / count


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   bias: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """The next-token loss as Hugging Face computes it: position t predicts ``labels[..., t + 1]``."""
    return chunked_cross_entropy(hidden[..., :-1, :], weight, labels[..., 1:], bias, **kwargs)


def sequence_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      bias: torch.Tensor | None = None, *, chunk_size: int = 1024, ignore_index: int = -100,
                      shift: bool = True, average: bool = False) -> torch.Tensor:
    """Log-probability of each sequence's labels, ``[B]`` (float32; float64 for float64 input),
    without the logits; differentiable.

    ``hidden`` [B, T, D], ``labels`` [B, T]. ``shift=True``: position t predicts label t + 1 (labels
    are the input ids, as Hugging Face passes them). ``average``: mean per counted token, not the sum.
    """
    if hidden.ndim != 3 or labels.ndim != 2:
        raise ValueError(f"hidden must be [B, T, D] and labels [B, T]; got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if shift:
        hidden, labels = hidden[:, :-1, :], labels[:, 1:]
    nll = token_nll(hidden, weight, labels, bias, chunk_size=chunk_size, ignore_index=ignore_index)
    logp = -nll.sum(dim=1)
    if average:
        logp = logp / (labels != ignore_index).sum(dim=1).clamp(min=1)
    return logp


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, *, beta: float = 0.1,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct Preference Optimization from per-sequence log-probabilities (``[B]`` each).

    Returns ``(loss, chosen_rewards, rejected_rewards)``: the mean loss and the implicit rewards
    ``beta * (policy - reference)`` (detached). ``label_smoothing`` > 0 is the conservative variant
    for noisy preference labels.
    """
    if not beta > 0:
        raise ValueError(f"beta={beta!r} is not valid; use a number > 0")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing={label_smoothing!r} is not valid; use a number in [0, 0.5)")
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, reference_chosen, reference_rejected)}
    if len(shapes) != 1:
        raise ValueError(f"the four log-probability tensors must have one shape, got {sorted(shapes)}")
    chosen = policy_chosen - reference_chosen.detach()
    rejected = policy_rejected - reference_rejected.detach()
    margin = beta * (chosen - rejected)
    loss = -(1.0 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    return loss.mean(), (beta * chosen).detach(), (beta * rejected).detach()
