"""cuda_adamw_step: the multi-tensor AdamW kernel on a CUDA stream, device or zero-copy (pinned host) state."""

from __future__ import annotations

import torch

from . import _core
from ._args import bump_versions, plain_list, scalar, seed_number, step_number

__all__ = ["cuda_adamw_step"]


def _device_of(tensors: list[torch.Tensor]) -> torch.device | None:
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return None


def cuda_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, maximize: bool = False, grad_scale: float = 1.0,
                    params_out: list[torch.Tensor] | None = None, stream: int | torch.cuda.Stream | None = None,
                    seed: int = 0, keys: list[int] | None = None) -> None:
    """Fused AdamW over lists of tensors, enqueued on ``stream`` (default: the current stream); never syncs.

    Same math and dtypes as ``adamw_step``. Each tensor is a CUDA tensor (all on one GPU) or a page-locked
    CPU tensor (``pin_memory()``): the kernel then reads and writes host memory over the link ("zero copy",
    useful when moments and fp32 master weights live in host RAM). ``params_out`` (e.g. bf16 weights on the
    GPU) gets the new weights rounded to nearest even in the same pass. No two buffers may share memory
    (gradients aside); the written tensors' version counters are bumped. RuntimeError without CUDA.
    ``keys``: one integer per tensor naming its stochastic-rounding stream (default: its position),
    so a tensor rounds the same whether it is updated alone or in a batch.
    """
    if not _core.built_with_cuda:
        raise RuntimeError("cuda_adamw_step needs CUDA, but ts_adamw was built without it; reinstall with a "
                           "CUDA toolkit on PATH (or TS_ENABLE_CUDA=ON)")
    if not torch.cuda.is_available() or not _core.cuda_device_present():
        raise RuntimeError("cuda_adamw_step needs a CUDA GPU and driver; none is available here")
    lists = [plain_list(x, name) for x, name in ((params, "params"), (grads, "grads"), (exp_avgs, "exp_avgs"),
                                                 (exp_avg_sqs, "exp_avg_sqs"))]
    outs = [] if params_out is None else plain_list(params_out, "params_out")
    device = _device_of([t for group in (*lists, outs) for t in group]) or torch.device("cuda", torch.cuda.current_device())
    with torch.cuda.device(device):
        if stream is None:
            stream = torch.cuda.current_stream(device)
        handle = stream if isinstance(stream, int) else stream.cuda_stream
        _core.cuda_step(*lists, outs, _keys(keys, len(lists[0])), scalar(lr, "lr"), scalar(beta1, "beta1"), scalar(beta2, "beta2"),
                        scalar(eps, "eps"), scalar(weight_decay, "weight_decay"), step_number(step), bool(maximize),
                        scalar(grad_scale, "grad_scale"), seed_number(seed), handle)
    # The writes are queued on the stream; autograd's bookkeeping is by program order, so bump now.
    bump_versions((*params, *exp_avgs, *exp_avg_sqs, *(params_out or ())))


def _keys(keys, count: int) -> list[int]:
    if keys is None:
        return []
    keys = list(keys)
    if len(keys) != count or not all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in keys):
        raise ValueError(f"keys must be {count} integers in [0, 2**32), one per tensor; got {keys!r}")
    return keys
