"""quantized_linear (autograd function for frozen quantized weights) and QuantLinear."""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import _compiled, _fused, _plan, _scaled
from ._tensor import QuantizedTensor, quantize
from ._tiled import tiled_linear

__all__ = ["QuantLinear", "configure_linear", "linear_path", "quantized_linear"]

# tiles: off (1), since tiling only added launches and was slower at every tile count (docs/quant.md).
# fused: the Hopper fused kernel where it applies, up to fused_max_rows rows of x. Measured
# (W 13824x5120, docs/quant.md): fused is faster up to 1024 rows, one dequantize plus cuBLAS's
# bf16 matmul from 1536 rows on.
_settings = {"tiles": 1, "fused": True, "fused_max_rows": 1024, "cache": True}
# torch scaled_mm paths this torch build refused (its feature checks fail the same way on every call).
# The fused path is never put here: it says per call, by FusedLinearUnavailable, when it cannot run.
_broken: set[str] = set()
# Bumped whenever _settings or _broken change: per-weight plans (_plan.py) made before are stale.
_generation = [0]


def configure_linear(tiles: int | None = None, fused: bool | None = None, fused_max_rows: int | None = None,
                     cache: bool | None = None) -> dict:
    """Sets the row tiles of the overlapped dequantize+matmul path (default 1: no tiling), whether the
    Hopper fused kernel is used where it applies (default True) and up to how many rows of x (default
    1024), and whether quantized_linear caches per weight what is constant between calls (default True;
    False checks and chooses everything on every call, the slow reference). Returns the settings."""
    _generation[0] += 1
    if fused is not None:
        if not isinstance(fused, bool):
            raise ValueError(f"fused={fused!r} must be True or False")
        _settings["fused"] = fused
    if fused_max_rows is not None:
        if isinstance(fused_max_rows, bool) or not isinstance(fused_max_rows, int) or fused_max_rows < 0:
            raise ValueError(f"fused_max_rows={fused_max_rows!r} must be an int >= 0")
        _settings["fused_max_rows"] = fused_max_rows
    if cache is not None:
        if not isinstance(cache, bool):
            raise ValueError(f"cache={cache!r} must be True or False")
        _settings["cache"] = cache
    if tiles is not None:
        if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
            raise ValueError(f"tiles={tiles!r} must be an int >= 1")
        _settings["tiles"] = tiles
    return dict(_settings)


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def linear_path(x: torch.Tensor, qweight: QuantizedTensor) -> str:
    """The forward path quantized_linear takes for these operands, and why not a faster one.

    "fp8_scaled_mm" (Hopper, fp8 128x128 weights, N and K multiples of 128), "nvfp4_scaled_mm"
    (sm_100+, K a multiple of 32), "fused_sm90" (Hopper, int8/nf4/nvfp4 weights, bf16 x, K a multiple
    of 64, at most fused_max_rows rows: codes decoded in registers into wgmma), "dequantize_tiled" (CUDA: dequantization overlapped
    with bf16 matmuls), "dequantize" (CPU, or tiles=1: dequantize then F.linear).
    """
    n, k = qweight.shape
    if x.device.type != "cuda":
        return "dequantize"
    has_scaled_mm = hasattr(F, "scaled_mm")
    if (qweight.format == "fp8" and has_scaled_mm and "fp8_scaled_mm" not in _broken
            and _capability(x.device) == (9, 0) and qweight.block_size == 128 and n % 128 == 0 and k % 128 == 0):
        return "fp8_scaled_mm"
    if (qweight.format == "nvfp4" and has_scaled_mm and "nvfp4_scaled_mm" not in _broken
            and _capability(x.device)[0] >= 10 and k % 32 == 0 and hasattr(torch, "float4_e2m1fn_x2")):
        return "nvfp4_scaled_mm"
    rows = x.numel() // max(1, x.shape[-1])
    if (_settings["fused"] and rows <= _settings["fused_max_rows"]
            and _fused.fused_linear_reason(x, qweight) is None):
        return "fused_sm90"
    return _unfused_path(qweight)


def _unfused_path(qweight: QuantizedTensor) -> str:
    return "dequantize_tiled" if _settings["tiles"] > 1 and qweight.shape[0] > 1 else "dequantize"


# Out of memory and CUDA errors (a sticky one leaves the context unusable): never a reason to change
# paths, always the caller's to see. torch.AcceleratorError is torch's type for CUDA errors (2.8+).
_TRANSIENT = tuple(t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if t is not None)


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, _TRANSIENT):
        return True
    text = str(error)
    return "CUDA error" in text or "out of memory" in text or "CUBLAS_STATUS_EXECUTION_FAILED" in text


def _check_operands(x: torch.Tensor, qweight: QuantizedTensor, bias: torch.Tensor | None, outliers: float) -> None:
    if not isinstance(qweight, QuantizedTensor):
        raise TypeError(f"qweight must be a QuantizedTensor, got {type(qweight).__name__}")
    if len(qweight.shape) != 2:
        raise ValueError(f"qweight must be 2-D [out_features, in_features], got shape {tuple(qweight.shape)}")
    if x.shape[-1] != qweight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but qweight expects {qweight.shape[1]}")
    if x.device != qweight.device and not (x.device.type == qweight.device.type == "cuda"
                                           and qweight.device.index is None):
        raise ValueError(f"x is on {x.device} but qweight on {qweight.device}; move one with .to()")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x dtype {x.dtype} is not supported; use float32, bfloat16 or float16")
    if bias is not None and bias.shape != (qweight.shape[0],):
        raise ValueError(f"bias must have shape ({qweight.shape[0]},), got {tuple(bias.shape)}")
    if not 0.0 <= outliers < 1.0:
        raise ValueError(f"outliers={outliers} must be a fraction in [0, 1)")
    if outliers and qweight.format != "nvfp4":
        raise ValueError(f"outliers applies to nvfp4 weights (their 4-bit input), not {qweight.format}")


def _forward(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None, outliers: float) -> torch.Tensor:
    path = linear_path(x2d, q)
    if path == "fused_sm90":
        try:
            return _fused.fused_linear(x2d, q, bias, check=False)  # linear_path just checked the operands
        except _fused.FusedLinearUnavailable as error:  # this call only: the path stays on
            warnings.warn(f"ts_quant: fused_sm90 cannot run here ({error}); this call uses dequantize + matmul",
                          RuntimeWarning, stacklevel=3)
            path = _unfused_path(q)
    elif path in ("fp8_scaled_mm", "nvfp4_scaled_mm"):
        try:
            if path == "fp8_scaled_mm":
                return _scaled.fp8_scaled_mm_linear(x2d, q, bias)
            return _scaled.nvfp4_scaled_mm_linear(x2d, q, bias, outliers)
        except (RuntimeError, NotImplementedError) as error:
            if _is_transient(error):
                raise
            # torch's own checks refused the call: this torch build lacks the path; fall back once, loudly.
            _broken.add(path)
            _generation[0] += 1
            warnings.warn(f"ts_quant: {path} failed ({error}); using dequantize + matmul from now on",
                          RuntimeWarning, stacklevel=3)
            path = linear_path(x2d, q)
    if path == "dequantize_tiled":
        return tiled_linear(x2d, q, bias, _settings["tiles"])
    return F.linear(x2d, q.dequantize(x2d.dtype), bias)


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured: a plan built then would keep tensors (decoded scales) that
    the capture allocated but only a replay writes, so that call runs unplanned."""
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _build_plan(x: torch.Tensor, q: QuantizedTensor) -> _plan.LinearPlan:
    """A plan for x's device and dtype, its paths chosen as linear_path chooses them (operands checked)."""
    generation = _generation[0]
    small = large = "dequantize"
    max_rows = 0
    if x.device.type == "cuda":
        probe = x.new_empty((0, q.shape[1]))  # linear_path's answer for no rows: all but the fused row limit
        large = linear_path(probe, q)
        if large == "fused_sm90":
            large = _unfused_path(q)
        small = large
        if _settings["fused"] and _fused.fused_weight_reason(q, x.device, x.dtype) is None and \
                large == _unfused_path(q):
            small, max_rows = "fused_sm90", _settings["fused_max_rows"]
    plan = _plan.LinearPlan(q, x.device, small, large, max_rows, generation)
    q._cache[(x.device, x.dtype)] = plan
    return plan


def checked_plan(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None,
                 outliers: float) -> _plan.LinearPlan | None:
    """q's plan for x (built on the first call, when caching is on), every operand checked where no valid
    plan vouches for them; None: the unplanned path."""
    plan = None
    if _settings["cache"]:
        plan = _plan.cached_plan(q, x, _generation[0])
    if plan is None or x.shape[-1] != plan.k or outliers or (bias is not None and bias.shape != (plan.n,)):
        _check_operands(x, q, bias, outliers)
        if _settings["cache"] and plan is None and not _capturing(x):
            plan = _build_plan(x, q)
    return plan


def dequantized_like(q: QuantizedTensor, plan: _plan.LinearPlan | None, like: torch.Tensor) -> torch.Tensor:
    """q decoded in like's dtype: through the plan where it still holds (the weight may have been
    written since it was made), else q.dequantize."""
    if plan is not None and plan.generation == _generation[0] and plan.token == _plan.weight_token(q) \
            and like.device == plan.device:
        return plan.dequantize(like)
    return q.dequantize(like.dtype)


def input_grad(grad_out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The input gradient of x @ w^T: grad_out @ w (matmul folds leading dims into one mm: the same bits)."""
    if grad_out.dim() >= 2:
        return grad_out @ w
    return (grad_out.reshape(1, -1) @ w).reshape(w.shape[1])


def _run(x: torch.Tensor, q: QuantizedTensor, plan: _plan.LinearPlan | None, bias: torch.Tensor | None,
         outliers: float) -> torch.Tensor:
    """The forward for x of any rank; `plan` None: the unplanned path (every choice made again)."""
    if plan is None:
        return _unplanned(x, q, bias, outliers)
    if plan.small == "fused_sm90":
        k = plan.k
        m = x.numel() // k if k else 0
        if m <= plan.max_rows:
            contiguous = x.is_contiguous()
            if contiguous and x.data_ptr() % 16:
                pass  # linear_path: a contiguous misaligned x takes the unfused path (a strided one is copied)
            elif bias is not None and not (bias.dtype is torch.bfloat16 and bias.is_contiguous()
                                           and bias.device == x.device):
                return _unplanned(x, q, bias, outliers)  # the checked call says what is wrong with bias
            else:
                try:
                    return plan.fused(x if contiguous else x.contiguous(), bias, m)
                except _fused.FusedLinearUnavailable as error:  # this call only: the path stays on
                    warnings.warn(f"ts_quant: fused_sm90 cannot run here ({error}); this call uses dequantize + "
                                  "matmul", RuntimeWarning, stacklevel=4)
    if plan.large == "dequantize":
        return _plan.dequantize_linear(x, plan, bias)
    if plan.large == "dequantize_tiled":
        x2d = x.reshape(-1, x.shape[-1])
        return tiled_linear(x2d, q, bias, _settings["tiles"]).reshape(*x.shape[:-1], q.shape[0])
    return _unplanned(x, q, bias, outliers)  # the scaled_mm paths choose (and fall back) per call


def _unplanned(x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None, outliers: float) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    return _forward(x2d, q, bias, outliers).reshape(*x.shape[:-1], q.shape[0])


class _QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qweight, bias, outliers, plan):
        ctx.qweight = qweight
        ctx.plan = plan
        return _run(x, qweight, plan, bias, outliers)

    @staticmethod
    def backward(ctx, grad_out):
        qweight = ctx.qweight
        plan = ctx.plan
        grad_x = grad_bias = None
        needs = ctx.needs_input_grad
        if needs[0]:
            grad_x = input_grad(grad_out, dequantized_like(qweight, plan, grad_out))
        if needs[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None, None


# Function.apply's Python wrapper costs about 4 us a call (argument binding for setup_context, functorch
# checks): outside functorch transforms and torch.compile tracing, call the C++ apply it ends in.
_c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _QuantizedLinearFn)
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_is_compiling = torch.compiler.is_compiling


def quantized_linear(x: torch.Tensor, qweight: QuantizedTensor, bias: torch.Tensor | None = None,
                     outliers: float = 0.0) -> torch.Tensor:
    """y = x @ dequantize(qweight)^T + bias on the fastest correct path (see linear_path).

    The weight is frozen: backward gives the input (and bias) gradient through the dequantized weight,
    never a weight gradient. outliers (nvfp4 on FP4 tensor cores only; ignored by the dequantize paths,
    whose input is not quantized): the fraction of input channels kept in the input dtype.
    What is constant per weight (path, scales, addresses, descriptors) is cached on it after the
    first call (``configure_linear(cache=False)`` turns that off); every argument is checked then.
    """
    if _is_compiling():  # one traceable op per call: no graph break, no Python guards on addresses
        return _compiled.traced_linear(x, qweight, bias, float(outliers))
    plan = checked_plan(x, qweight, bias, outliers)
    if not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))):
        return _run(x, qweight, plan, bias, float(outliers))  # no graph to record
    if _functorch_active():
        return _QuantizedLinearFn.apply(x, qweight, bias, float(outliers), plan)
    return _c_apply(_unwrap_if_dead(x), qweight, None if bias is None else _unwrap_if_dead(bias),
                    float(outliers), plan)


MERGE_ROUNDING_WARNING = (
    "a new weight assigned to a quantized layer (PEFT's merge_adapter / merge_and_unload do this) is stored "
    "quantized again: the merged model's outputs differ from the unmerged adapter's by that rounding (each layer's "
    "largest error is its rounding_error). For outputs equal to the adapter's, keep it unmerged, or merge it into "
    "a 16-bit copy of the base weights")


class _DecodedWeight(torch.Tensor):
    """What ``QuantLinear.weight`` returns: the decoded weight, a fresh copy, except for ``.data`` assignment.

    PEFT merges an adapter into its base layer by assigning ``base_layer.weight.data`` (``weight.data +=
    delta`` and ``weight.data = merged``; unmerging likewise). On a plain copy that assignment would change
    the copy alone and the merge would be lost without a word, so here it stores the new values in the
    layer, quantized again. In-place arithmetic on the copy itself (``weight.add_(...)``) still changes the
    copy alone, as on any decoded value. Every operation on it gives a plain tensor.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # behaves as a plain tensor in every op

    @staticmethod
    def of(layer: QuantLinear) -> _DecodedWeight:
        decoded = layer.qweight.dequantize(layer.qweight.dtype).as_subclass(_DecodedWeight)
        decoded._layer = weakref.ref(layer)
        return decoded

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self).as_subclass(torch.Tensor)

    @data.setter
    def data(self, values: torch.Tensor) -> None:
        layer = self._layer()
        if layer is None:
            raise RuntimeError("this decoded weight's QuantLinear no longer exists: there is nothing to assign to")
        layer.assign_weight(values)
        torch.Tensor.data.__set__(self, layer.qweight.dequantize(layer.qweight.dtype))

    def __deepcopy__(self, memo) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()

    def __reduce_ex__(self, protocol):  # saved as the plain decoded values
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


class QuantLinear(nn.Linear):
    """nn.Linear with a frozen quantized weight; state_dict holds the codes, scales and bias.

    A subclass of ``nn.Linear`` (with ``in_features`` / ``out_features``) so that code which accepts linear
    layers, PEFT's LoRA among them, takes it. ``weight`` is not a parameter: it is a property that decodes
    ``qweight`` on every access (PEFT reads its device and dtype once per adapter), never used by
    ``forward``. Assigning ``weight.data`` (how PEFT merges an adapter) stores the values quantized again,
    with a warning about the rounding; see ``assign_weight``.
    """

    # Why assigning a new weight is refused now, or None: set by whoever holds copies of the codes that
    # would not see new values (a weight streamer between its fetches), cleared when it lets go.
    assign_refusal: str | None = None
    # The largest absolute error of the last assigned weight's quantization (None: never assigned).
    rounding_error: float | None = None

    def __init__(self, qweight: QuantizedTensor, bias: torch.Tensor | None = None, outliers: float = 0.0) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: there is no dense weight to allocate
        self._is_hf_initialized = True  # transformers' weight init must not reach for a .weight
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.outliers = float(outliers)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=bias.requires_grad)

    @property
    def weight(self) -> torch.Tensor:
        """The decoded weight, freshly computed (a copy in ``qweight.dtype``, not trainable); assigning its
        ``.data`` calls ``assign_weight``."""
        return _DecodedWeight.of(self)

    def assign_weight(self, values: torch.Tensor) -> None:
        """Stores `values` as this layer's weight, quantized in the same format and block size, in place in
        ``qweight``'s tensors. Sets ``rounding_error`` (the largest absolute difference between `values` and
        what is stored) and warns once per place it is called from. Refused, with nothing changed, for values
        of another shape or not finite, and while ``assign_refusal`` says why."""
        if self.assign_refusal is not None:
            raise RuntimeError(self.assign_refusal)
        if tuple(values.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a weight of shape {tuple(values.shape)} cannot replace this layer's "
                             f"({self.out_features}, {self.in_features})")
        if not bool(torch.isfinite(values).all()):
            raise ValueError("the new weight has values that are not finite; the layer keeps its weight")
        self.qweight.requantize_(values)
        stored = self.qweight.dequantize(torch.float32)
        self.rounding_error = float((stored - values.detach().to(stored.device, torch.float32)).abs().max())
        warnings.warn(MERGE_ROUNDING_WARNING, UserWarning, stacklevel=3)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str, block_size: int | None = None, *,
                    double_quant: bool = False, outliers: float = 0.0) -> QuantLinear:
        """Quantizes linear.weight (on its device); the bias is kept as is, trainable if it was."""
        q = quantize(linear.weight.detach(), format, block_size, double_quant=double_quant)
        bias = None
        if linear.bias is not None:
            bias = linear.bias.detach().clone().requires_grad_(linear.bias.requires_grad)
        return cls(q, bias, outliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.qweight, self.bias, self.outliers)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # Follow device moves only: codes and scales keep their dtypes under .half() / .to(dtype).
        probe = fn(torch.empty(0, device=self.qweight.device))
        self.qweight = self.qweight.to(probe.device)
        return self

    def get_extra_state(self) -> dict:
        return self.qweight.to_state_dict()

    def set_extra_state(self, state: dict) -> None:
        self.qweight = QuantizedTensor.from_state_dict(state)
        self.out_features, self.in_features = self.qweight.shape

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.qweight.format}, "
                f"bias={self.bias is not None}")
