"""Hopper's fused dequantize + matmul (csrc/sm90/fused_linear.cu) for int8, NF4 and NVFP4 weights.

The weight codes are decoded in registers straight into wgmma's A operand (y^T = W x^T), so no bf16
copy of the weight is ever written. One persistent thread block per SM takes an equal
share of the (tile, k tile) iterations (stream-K); tiles split between blocks are summed in a fixed
order, so results do not depend on timing. The decoded values are the ones `dequantize` writes,
so the result equals `F.linear(x, q.dequantize(torch.bfloat16), bias)` up to fp32 summation order.

CUDA graphs: the kernel keeps which launch its stream-K flags belong to in device memory and
advances it itself, so a captured call replays correctly (the host passes no per-call counter).
"""

from __future__ import annotations

import torch

from . import _core
from ._formats import FORMAT_IDS
from ._tensor import QuantizedTensor

__all__ = ["FusedLinearUnavailable", "fused_linear", "fused_linear_reason", "fused_weight_reason"]

# Raised (by _core or here) where the fused kernel cannot run: a device other than compute capability
# 9.0, a build without sm_90a, a driver or operands it does not take. The one error on which
# quantized_linear falls back to dequantize + matmul; everything else propagates.
FusedLinearUnavailable = _core.FusedLinearUnavailable
FUSED_FORMATS = ("int8", "nf4", "nvfp4")
SLOT_FLOATS = 256 * 128  # stream-K partial sums of one thread block (csrc/sm90/fused_linear.h)
_available: dict[int, bool] = {}


def _device_available(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _available:
        _available[index] = bool(_core.built_with_cuda and _core.fused_linear_available(index))
    return _available[index]


def fused_linear_reason(x2d: torch.Tensor, q: QuantizedTensor) -> str | None:
    """None when fused_linear can take these operands, else why not (for linear_path's report)."""
    reason = fused_weight_reason(q, x2d.device, x2d.dtype)
    if reason is None and x2d.is_contiguous() and x2d.data_ptr() % 16:  # a strided x is copied (aligned) first
        return "x is not 16-byte aligned"
    return reason


def fused_weight_reason(q: QuantizedTensor, device: torch.device, dtype: torch.dtype) -> str | None:
    """fused_linear_reason for any x on `device` in `dtype` (all but x's alignment)."""
    k = q.shape[1]
    block = q.block_size
    if q.format not in FUSED_FORMATS:
        return f"{q.format} weights are not decoded by the fused kernel"
    if dtype != torch.bfloat16:
        return f"x is {dtype}, the fused kernel takes bfloat16"
    if k % 64:
        return f"in_features={k} is not a multiple of 64"
    if block & (block - 1) or (q.format != "nvfp4" and block < 32):
        return f"block_size={block} is not a power of two >= 32"
    if device.type != "cuda":
        return f"x is on {device}; the fused kernel takes CUDA tensors"
    if not _core.built_with_sm90a:
        return "this build is missing sm_90a (reinstall with 90 in TS_CUDA_ARCHITECTURES and a CUDA toolkit)"
    if not _device_available(device):
        return "needs a compute capability 9.0 GPU (H100/H200)"
    if q.data.data_ptr() % 16 or (not q.double_quant and q.scales.data_ptr() % 16):
        return "the codes or scales are not 16-byte aligned"
    return None


class _StreamKState:
    """Partial-sum slots, ready flags and the launch epoch of one (device, stream): calls on one stream
    run in order, so they can share them. The kernel advances the epoch word itself, so flags never
    need clearing and a CUDA graph that captured a call replays it with a fresh epoch each time.

    Graphs captured on one stream share its state (as they share cuBLAS's per-stream workspace): replay
    them one at a time, and not while fused calls run on that stream. Created inside a capture, the zero
    fill is part of that graph, which is fine: zeroed flags and epoch are a valid state before any launch.
    Created during a warm-up run of torch.compile's CUDA graph trees, it lands in their graph pool (they
    route every allocation of the thread there) and outlives the graph, which they refuse: the likely
    cause of reduce-overhead stopping a training run at its second step (docs/benchmarks.md; allocating on
    a side stream did not help).
    """

    def __init__(self, device: torch.device, slots: int) -> None:
        self.workspace = torch.empty(slots * SLOT_FLOATS, dtype=torch.float32, device=device)
        self.flags = torch.zeros(slots, dtype=torch.int32, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)  # {last token, tickets} (fused_linear.cu)


_states: dict[tuple[int, int], _StreamKState] = {}


def _state(device: torch.device, stream: int) -> _StreamKState:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, stream)
    if key not in _states:
        slots = torch.cuda.get_device_properties(index).multi_processor_count  # one thread block per SM
        _states[key] = _StreamKState(torch.device("cuda", index), slots)
    return _states[key]


def fused_linear(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None, tile_m: int = 0,
                 check: bool = True) -> torch.Tensor:
    """x2d @ q.dequantize(bf16)^T + bias in one kernel; x2d bf16 [m, k] on an sm_90 GPU.

    tile_m: rows of x per thread block (64, 128 or 256); 0 picks the widest one m fills. Raises
    FusedLinearUnavailable, naming why, where the kernel cannot take these operands here (check=False
    skips the Python-side part of that check, for callers that just ran fused_linear_reason).
    """
    if check and (reason := fused_linear_reason(x2d, q)) is not None:
        raise FusedLinearUnavailable(f"fused_linear: {reason}")
    m = x2d.shape[0]
    n = q.shape[0]
    x2d = x2d.contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x2d.device)
    if m == 0:
        return out
    scales = q.block_scales()
    if q.format == "nvfp4":
        scales = scales.view(torch.uint8)
    stream = torch.cuda.current_stream(x2d.device).cuda_stream
    state = _state(x2d.device, stream)
    _core.fused_linear(FORMAT_IDS[q.format], x2d, q.data, scales, q.global_scale, q.block_size, n,
                       None if bias is None else bias.detach(), out, state.workspace, state.flags,
                       state.epoch, stream, tile_m)
    return out
