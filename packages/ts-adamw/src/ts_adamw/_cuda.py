"""cuda_adamw_step: the multi-tensor AdamW kernel on a CUDA stream, device or zero-copy (pinned host) state."""

from __future__ import annotations

import torch

from . import _core
from ._args import (
    bump_versions,
    increment_versions,
    plain_list,
    rounding_keys,
    rounding_offsets,
    scalar,
    seed_number,
    step_number,
)

__all__ = ["CudaAdamWBatch", "cuda_adamw_step"]

_GRAD_KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # the native Kind codes


def _device_of(tensors: list[torch.Tensor]) -> torch.device | None:
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return None


def _require_cuda(what: str) -> None:
    if not _core.built_with_cuda:
        raise RuntimeError(f"{what} needs CUDA, but ts_adamw was built without it; reinstall with a "
                           "CUDA toolkit on PATH (or TS_ENABLE_CUDA=ON)")
    if not torch.cuda.is_available() or not _core.cuda_device_present():
        raise RuntimeError(f"{what} needs a CUDA GPU and driver; none is available here")


def cuda_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, maximize: bool = False, grad_scale: float = 1.0,
                    params_out: list[torch.Tensor] | None = None, stream: int | torch.cuda.Stream | None = None,
                    seed: int = 0, keys: list[int] | None = None, offsets: list[int] | None = None) -> None:
    """Fused AdamW over lists of tensors, enqueued on ``stream`` (default: the current stream); never syncs.

    Same math and dtypes as ``adamw_step``. Each tensor is a CUDA tensor (all on one GPU) or a page-locked
    CPU tensor (``pin_memory()``): the kernel then reads and writes host memory over the link ("zero copy",
    useful when moments and fp32 master weights live in host RAM). ``params_out`` (e.g. bf16 weights on the
    GPU) gets the new weights rounded to nearest even in the same pass. No two buffers may share memory
    (gradients aside); the written tensors' version counters are bumped. RuntimeError without CUDA.
    ``keys``: one integer per tensor naming its stochastic-rounding stream (default: its position),
    so a tensor rounds the same whether it is updated alone or in a batch. ``offsets``: one integer >= 0
    per tensor (default all 0), the index of its element 0 in its whole tensor's rounding stream, so a
    tensor updated in pieces (each with the whole tensor's key and its offset) gets exactly the bits of one
    update of the whole; the same bits as ``adamw_steps`` with the same ``seed``, keys and offsets.
    """
    _require_cuda("cuda_adamw_step")
    lists = [plain_list(x, name) for x, name in ((params, "params"), (grads, "grads"), (exp_avgs, "exp_avgs"),
                                                 (exp_avg_sqs, "exp_avg_sqs"))]
    outs = [] if params_out is None else plain_list(params_out, "params_out")
    count = len(lists[0])
    slots, firsts = rounding_keys(keys, count), rounding_offsets(offsets, count)
    device = _device_of([t for group in (*lists, outs) for t in group]) or torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        if stream is None:
            stream = torch.cuda.current_stream(device)
        handle = _stream_handle(stream)
        _core.cuda_step(*lists, outs, slots, firsts, scalar(lr, "lr"), scalar(beta1, "beta1"), scalar(beta2, "beta2"),
                        scalar(eps, "eps"), scalar(weight_decay, "weight_decay"), step_number(step), bool(maximize),
                        scalar(grad_scale, "grad_scale"), seed_number(seed), handle)
    # The writes are queued on the stream; autograd's bookkeeping is by program order, so bump now.
    bump_versions((*params, *exp_avgs, *exp_avg_sqs, *(params_out or ())))


def _stream_handle(stream) -> int:
    return stream if isinstance(stream, int) else stream.cuda_stream


class CudaAdamWBatch:
    """``cuda_adamw_step`` over a fixed list of parameters, prepared once: the master weights, moments,
    ``params_out``, ``keys`` and ``offsets`` are checked and placed at construction, and each
    ``step(grads, ...)`` passes only the gradients' addresses (about 0.5 us per tensor in Python, against
    some 12 us for the DLPack import of every tensor that ``cuda_adamw_step`` does per call). Same math,
    rounding streams (``keys``, ``offsets``: as ``cuda_adamw_step``'s, fixed for the batch's life) and
    placement rules as ``cuda_adamw_step``; the launch is enqueued on ``stream`` and never syncs.

    The state tensors stay referenced by the batch and must keep their storage: after ``.data`` is
    replaced (or a tensor is resized) build a new batch. Gradients must be contiguous CUDA tensors on
    the batch's GPU with the parameter's element count and ``grad_dtypes[i]`` (default: the dtype of
    ``params_out[i]``, or float32 without ``params_out``); any other gradient raises ValueError before
    anything is written, as does one sharing memory with a written buffer.
    """

    def __init__(self, params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                 params_out: list[torch.Tensor] | None = None, keys: list[int] | None = None,
                 offsets: list[int] | None = None, grad_dtypes: list[torch.dtype] | None = None):
        _require_cuda("CudaAdamWBatch")
        lists = [plain_list(x, name) for x, name in ((params, "params"), (exp_avgs, "exp_avgs"),
                                                     (exp_avg_sqs, "exp_avg_sqs"))]
        outs = [] if params_out is None else plain_list(params_out, "params_out")
        count = len(lists[0])
        if grad_dtypes is None:
            grad_dtypes = [o.dtype for o in outs] if len(outs) == count else [torch.float32] * count
        grad_dtypes = list(grad_dtypes)
        if len(grad_dtypes) != count or not all(d in _GRAD_KINDS for d in grad_dtypes):
            raise ValueError(f"grad_dtypes must be {count} dtypes among float32, bfloat16 and float16; "
                             f"got {grad_dtypes!r}")
        slots, firsts = rounding_keys(keys, count), rounding_offsets(offsets, count)
        device = _device_of([t for group in (*lists, outs) for t in group]) or torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            self._core = _core.prepare_cuda_step(*lists, outs, slots, firsts, [_GRAD_KINDS[d] for d in grad_dtypes])
        self.device = device
        self._index = device.index
        self._grad_dtypes = grad_dtypes
        self._numels = [t.numel() for t in lists[0]]
        # What each launch writes, for the version bumps (inference tensors have no counter).
        self._written = [t for t in (*params, *exp_avgs, *exp_avg_sqs, *(params_out or ())) if not t.is_inference()]

    def __len__(self) -> int:
        return len(self._numels)

    def step(self, grads: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
             weight_decay: float, step: int, maximize: bool = False, grad_scale: float = 1.0,
             stream: int | torch.cuda.Stream | None = None, seed: int = 0) -> None:
        """One AdamW step with these gradients (see the class docstring for what they must be)."""
        if len(grads) != len(self._numels):
            raise ValueError(f"CudaAdamWBatch.step: got {len(grads)} gradients for {len(self._numels)} parameters")
        index, strided = self._index, torch.strided
        ptrs = []
        for i, (g, dtype, n) in enumerate(zip(grads, self._grad_dtypes, self._numels)):
            if (g.dtype is not dtype or g.get_device() != index or g.layout is not strided or g.numel() != n
                    or not g.is_contiguous()):
                raise ValueError(f"CudaAdamWBatch.step: grads[{i}] must be a contiguous {dtype} tensor on "
                                 f"{self.device} with {n} elements; got {g.layout} {g.dtype} on {g.device} "
                                 f"with {g.numel()} elements{'' if g.is_contiguous() else ', not contiguous'}")
            ptrs.append(g.data_ptr())
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        self._core.launch(ptrs, scalar(lr, "lr"), scalar(beta1, "beta1"), scalar(beta2, "beta2"), scalar(eps, "eps"),
                          scalar(weight_decay, "weight_decay"), step_number(step), bool(maximize),
                          scalar(grad_scale, "grad_scale"), seed_number(seed), _stream_handle(stream))
        increment_versions(self._written)
