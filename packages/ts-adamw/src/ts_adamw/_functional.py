"""Fused AdamW steps on CPU tensors (synchronous and asynchronous) and the fused sum of squares."""

from __future__ import annotations

import torch

from . import _core
from ._args import (
    bump_versions,
    plain,
    plain_list,
    rounding_keys,
    rounding_offsets,
    scalar,
    seed_number,
    step_number,
    thread_count,
)

__all__ = ["HostAdamW", "StepHandle", "adamw_step", "adamw_step_async", "adamw_steps", "sum_of_squares"]

StepHandle = _core.StepHandle


def _piece(key, offset) -> tuple[list[int], list[int]]:
    """The native slots and offsets of a one-tensor call (``key`` None: 0, its position)."""
    if key is not None and (isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**32):
        raise ValueError(f"key={key!r} must be None or an integer in [0, 2**32)")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= 2**62:
        raise ValueError(f"offset={offset!r} must be an integer in [0, 2**62] (the index of the tensor's element 0 "
                         f"in its whole tensor's stochastic-rounding stream)")
    return ([] if key is None else [key]), [offset]


def _native_args(param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps, weight_decay, step,
                 maximize, grad_scale, seed, threads, key=None, offset=0) -> tuple:
    """The arguments of ``_core.step_pieces`` (and, with a keepalive, ``_core.step_async``) for one tensor."""
    out = [] if param_out is None else [plain(param_out, "param_out")]
    return (
        [plain(param, "param")], [plain(grad, "grad")], [plain(exp_avg, "exp_avg")],
        [plain(exp_avg_sq, "exp_avg_sq")], out, *_piece(key, offset),
        scalar(lr, "lr"), scalar(beta1, "beta1"), scalar(beta2, "beta2"), scalar(eps, "eps"),
        scalar(weight_decay, "weight_decay"), step_number(step), bool(maximize), scalar(grad_scale, "grad_scale"),
        seed_number(seed), thread_count(threads),
    )


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
               maximize: bool = False, grad_scale: float = 1.0, param_out: torch.Tensor | None = None,
               seed: int = 0, threads: int | None = None, key: int | None = None, offset: int = 0) -> None:
    """One AdamW step, in place, exactly as ``torch.optim.AdamW`` computes it, in one pass over memory.

    ``param`` fp32; ``grad`` fp32/bf16/fp16; ``exp_avg``/``exp_avg_sq`` both fp32 or both bf16 (stochastic
    rounding keyed by ``seed``, ``step``, the tensor's ``key`` (default 0) and element index, counted from
    ``offset``: the index of this tensor's element 0 in its whole tensor's rounding stream, so a piece of a
    tensor updated with the whole tensor's key and its offset gets the bits of one update of the whole).
    ``grad_scale`` multiplies the gradient first; ``param_out`` (bf16/fp16/fp32) receives the new weights
    rounded to nearest even. All tensors: CPU, contiguous, same element count, no two of them sharing memory
    (``grad`` aside, every one is written; ``param_out=None`` writes no copy). ``step`` counts this step (1 for the first). Runs on the host pool
    (``threads`` caps it) with the GIL released; invalid input raises ValueError before anything changes.
    The version counter of every tensor written is bumped, as torch's in-place ops do, so a backward that
    saved one of them raises instead of reading the new values.
    """
    _core.step_pieces(*_native_args(param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps,
                                    weight_decay, step, maximize, grad_scale, seed, threads, key, offset))
    bump_versions((param, exp_avg, exp_avg_sq, param_out))


def adamw_steps(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, maximize: bool = False, grad_scale: float = 1.0,
                params_out: list[torch.Tensor] | None = None, seed: int = 0, keys: list[int] | None = None,
                offsets: list[int] | None = None, threads: int | None = None) -> None:
    """``adamw_step`` over lists of tensors in one call (one plan, one pass of the host pool): the host
    counterpart of ``cuda_adamw_step``, for many small tensors whose per-call cost would dominate.

    Every list has one entry per tensor (``params_out``: all or none). ``keys``: one integer per tensor
    naming its stochastic-rounding stream (default: its position), so a tensor rounds the same whether it
    is updated alone or in a batch, and the same as ``cuda_adamw_step`` with the same ``seed`` and keys.
    ``offsets``: one integer >= 0 per tensor (default all 0), the index of its element 0 in its whole
    tensor's rounding stream: a tensor updated in pieces, each with the whole tensor's key and its offset
    (its first element's index in the whole), gets exactly the bits of one update of the whole.
    Invalid input raises ValueError before anything changes.
    """
    lists = [plain_list(x, name) for x, name in ((params, "params"), (grads, "grads"), (exp_avgs, "exp_avgs"),
                                                 (exp_avg_sqs, "exp_avg_sqs"))]
    outs = [] if params_out is None else plain_list(params_out, "params_out")
    count = len(lists[0])
    if any(len(x) != count for x in lists) or (outs and len(outs) != count):
        raise ValueError(f"adamw_steps: params, grads, exp_avgs, exp_avg_sqs (and params_out, when given) need one "
                         f"entry per tensor; got {[len(x) for x in lists]}" + (f" and {len(outs)}" if outs else ""))
    _core.step_pieces(*lists, outs, rounding_keys(keys, count), rounding_offsets(offsets, count), scalar(lr, "lr"),
                      scalar(beta1, "beta1"), scalar(beta2, "beta2"), scalar(eps, "eps"),
                      scalar(weight_decay, "weight_decay"), step_number(step), bool(maximize),
                      scalar(grad_scale, "grad_scale"), seed_number(seed), thread_count(threads))
    bump_versions((*params, *exp_avgs, *exp_avg_sqs, *(params_out or ())))


def adamw_step_async(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                     maximize: bool = False, grad_scale: float = 1.0, param_out: torch.Tensor | None = None,
                     seed: int = 0, threads: int | None = None, key: int | None = None,
                     offset: int = 0) -> StepHandle:
    """``adamw_step`` queued on a background lane (steps run in submission order); returns a ``StepHandle``.
    ``key`` and ``offset`` name the rounding stream and the first index in it, as ``adamw_step``'s do.

    Validation happens now (ValueError here); ``h.wait()`` blocks with the GIL released and re-raises a
    failure, ``h.done()`` polls. The handle keeps the tensors alive until it is waited on or deleted. The
    written tensors' version counters are bumped now, when the write is queued.
    """
    args = _native_args(param, grad, exp_avg, exp_avg_sq, param_out, lr, beta1, beta2, eps, weight_decay,
                        step, maximize, grad_scale, seed, threads, key, offset)
    keepalive = (param, grad, exp_avg, exp_avg_sq, param_out)
    handle = _core.step_async(*args, keepalive)
    bump_versions((param, exp_avg, exp_avg_sq, param_out))
    return handle


def sum_of_squares(tensors: list[torch.Tensor], *, threads: int | None = None) -> float:
    """Sum of ``x*x`` over every element of CPU fp32/bf16/fp16 tensors, in one threaded pass.

    fp32 SIMD lanes per 1024 elements, fp64 above; the result does not depend on the thread count.
    ``math.sqrt`` of it is the global L2 norm used for gradient clipping.
    """
    return _core.sum_of_squares(plain_list(tensors, "tensors"), thread_count(threads))


class HostAdamW:
    """The host engine with fixed hyper-parameters: ``.step(...)`` / ``.step_async(...)`` update one
    flat buffer set in place (as ``adamw_step`` / ``adamw_step_async``), ``.grad_norm(grads)`` is the
    fused global L2 norm. ``threads`` caps the host threads (default: all physical cores). Per-call
    keyword arguments override the stored ones (a scheduler's new ``lr``, say)."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, seed: int = 0, threads: int | None = None):
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
        self.defaults = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay,
                         "maximize": maximize, "seed": seed, "threads": threads}
        # Validate now with the checks every step applies: one step on scratch tensors.
        _core.step_pieces(*_native_args(*(torch.zeros(1) for _ in range(4)), None, lr, betas[0], betas[1], eps,
                                        weight_decay, 1, maximize, 1.0, seed, threads))

    def _kwargs(self, overrides: dict) -> dict:
        unknown = set(overrides) - {*self.defaults, "grad_scale", "param_out", "step"}
        if unknown:
            raise ValueError(f"unknown HostAdamW step argument(s): {', '.join(sorted(unknown))}")
        return {**self.defaults, **overrides}

    def step(self, param, grad, exp_avg, exp_avg_sq, *, step: int, **overrides) -> None:
        """One synchronous update (GIL released); see ``adamw_step``."""
        adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, **self._kwargs(overrides))

    def step_async(self, param, grad, exp_avg, exp_avg_sq, *, step: int, **overrides) -> StepHandle:
        """The same update queued on the background lane; returns a ``StepHandle``."""
        return adamw_step_async(param, grad, exp_avg, exp_avg_sq, step=step, **self._kwargs(overrides))

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm over host gradients (fp32 / bf16 / fp16), in one threaded pass."""
        return sum_of_squares(grads, threads=self.defaults["threads"]) ** 0.5
