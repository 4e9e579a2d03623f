"""Per-weight plans of quantized_linear: what stays constant between calls, worked out once.

A plan belongs to one QuantizedTensor and one (x device, x dtype). It holds the path choice (up to how
many rows the fused kernel runs), the decoded block scales, the native addresses of codes and scales,
the codes' TMA descriptor (fused path) and the stream-K state per stream, so a call costs a few
attribute reads and one native call with integer arguments (no DLPack export, about 2 us a tensor).

A plan is valid while the weight's tensors sit at the same addresses with the same version counters
(every in-place write bumps one) and the linear settings have not changed (configure_linear, a path
found broken: `generation`). Assigning an attribute of a QuantizedTensor clears its cache. Anything
else (a new x dtype or device) is another key. The first call per key runs every check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _core, _fused
from ._formats import FORMAT_IDS, fp8_grid
from ._tensor import QuantizedTensor

__all__ = ["LinearPlan", "cached_plan", "raw_stream", "weight_token"]

OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/bindings.cpp out_kind_of

# torch's C-level current-stream query (CUDA builds): about 0.2 us against 2-3 us for
# torch.cuda.current_stream(), which builds a Stream object.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def raw_stream(index: int) -> int:
    """The current CUDA stream of device `index`, as the integer handle the native calls take."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def weight_token(q: QuantizedTensor) -> tuple:
    """(address, version) of every tensor a plan reads: equal tokens mean the plan's derived values hold."""
    d, s, g = q.data, q.scales, q.global_scale
    if type(s) is QuantizedTensor:  # double quantization: the plan holds decoded scales
        o = q.scale_offset
        return (d.data_ptr(), d._version, s.data.data_ptr(), s.data._version, s.scales.data_ptr(),
                s.scales._version, o.data_ptr(), o._version)
    if g is None:
        return (d.data_ptr(), d._version, s.data_ptr(), s._version)
    return (d.data_ptr(), d._version, s.data_ptr(), s._version, g.data_ptr(), g._version)


class LinearPlan:
    """What quantized_linear needs of `q` for x on `device` in `dtype`; built after the full checks passed.

    `small`: the path up to `max_rows` rows of x, `large`: past them (the two differ only where the fused
    kernel applies). Paths are linear_path's names.
    """

    __slots__ = ("block", "code_map", "data_ptr", "device", "fmt", "format_id", "generation", "geometry",
                 "global_ptr", "global_scale", "index", "k", "large", "max_rows", "n", "numel", "scales",
                 "scales_ptr", "shape", "small", "streams", "token")

    def __init__(self, q: QuantizedTensor, device: torch.device, small: str, large: str, max_rows: int,
                 generation: int) -> None:
        self.generation = generation
        self.token = weight_token(q)
        self.device = q.device
        self.index = -1 if q.device.type == "cpu" else (q.device.index if q.device.index is not None
                                                        else torch.cuda.current_device())
        self.fmt = q.format
        self.format_id = FORMAT_IDS[q.format]
        self.shape = q.shape
        self.n, self.k = q.shape
        self.numel = self.n * self.k
        self.block = q.block_size
        scales = q.block_scales()  # undoes double quantization once, not per call
        if q.format == "nvfp4":
            scales = scales.view(torch.uint8)
        self.scales = scales  # kept: its address is what the native calls read
        self.scales_ptr = scales.data_ptr()
        self.global_scale = q.global_scale
        self.global_ptr = 0 if q.global_scale is None else q.global_scale.data_ptr()
        self.data_ptr = q.data.data_ptr()
        self.geometry = fp8_grid(q.shape) if q.format == "fp8" else (0, 0)
        self.small, self.large, self.max_rows = small, large, max_rows
        self.code_map = None
        if small == "fused_sm90":
            with torch.cuda.device(q.device):  # DLPack exports CUDA tensors of the current device only
                self.code_map = _core.fused_code_map(self.format_id, q.data, self.n, self.k)
        self.streams: dict[int, tuple[int, int, int, int]] = {}

    def dequantize(self, like: torch.Tensor) -> torch.Tensor:
        """q.dequantize(like.dtype), by addresses; `like` is on this plan's device (the plan must be valid
        for q). new_empty: about 2 us less than torch.empty with dtype and device keywords."""
        dtype = like.dtype
        out = like.new_empty(self.shape)
        if self.numel:
            rows, cols = self.geometry
            index = self.index
            _core.dequantize_at(self.format_id, self.data_ptr, self.scales_ptr, self.global_ptr, out.data_ptr(),
                                OUT_KINDS[dtype], self.numel, self.block, rows, cols, index,
                                0 if index < 0 else raw_stream(index))
        return out

    def fused(self, x: torch.Tensor, bias: torch.Tensor | None, m: int) -> torch.Tensor:
        """_fused.fused_linear by addresses: x contiguous bf16, 16-byte aligned, [..., k] with m rows;
        bias None or contiguous bf16 [n] on x's device. The output has x's leading dims."""
        out = x.new_empty((*x.shape[:-1], self.n))  # bf16 like x
        if m == 0:
            return out
        index = self.index
        stream = raw_stream(index)
        state = self.streams.get(stream)
        if state is None:
            s = _fused._state(x.device, stream)  # lives as long as the process: its addresses stay valid
            state = self.streams[stream] = (s.workspace.data_ptr(), s.flags.data_ptr(), s.flags.numel(),
                                            s.epoch.data_ptr())
        _core.fused_linear_at(self.format_id, x.data_ptr(), m, self.k, self.code_map, self.scales_ptr,
                              self.global_ptr, self.block, self.n, 0 if bias is None else bias.data_ptr(),
                              out.data_ptr(), state[0], state[1], state[2], state[3], index, stream, 0)
        return out


def cached_plan(q: QuantizedTensor, x: torch.Tensor, generation: int) -> LinearPlan | None:
    """q's valid plan for x's device and dtype, or None (then the caller checks everything and builds one)."""
    cache = getattr(q, "_cache", None)
    if cache is None:
        return None
    plan = cache.get((x.device, x.dtype))
    if plan is None or plan.generation != generation or plan.token != weight_token(q):
        return None
    return plan


def dequantize_linear(x: torch.Tensor, plan: LinearPlan, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x2d, q.dequantize(x.dtype), bias) reshaped to x's leading dims, without reshapes where
    F.linear gives the same bits (2-D x, or contiguous x: it folds the leading dims itself)."""
    w = plan.dequantize(x)
    dim = x.dim()
    if dim == 2 or (dim > 2 and x.is_contiguous()):
        return F.linear(x, w, bias)
    return F.linear(x.reshape(-1, plan.k), w, bias).reshape(*x.shape[:-1], plan.n)
