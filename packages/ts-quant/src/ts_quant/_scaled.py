"""Tensor-core paths through torch's scaled matmul, and their CPU emulations.

FP8 (Hopper, sm_90): activations quantized on the fly to e4m3 in 1x128 blocks,
weights in 128x128 tiles; torch.nn.functional.scaled_mm with BlockWise1x128 x
BlockWise128x128. torch wants the 1x128 scales outer-dim-major ([M, K/128]
with stride (1, M)) and the 128x128 scales as the transpose of a contiguous
[N/128, K/128 padded to 4] matrix (torch test_scaled_matmul_cuda.py).

NVFP4 (Blackwell, sm_100+): activations quantized to NVFP4 by our kernel,
scaled_mm with [BlockWise1x16, TensorWise] recipes and SWIZZLE_32_4_4 scales.
Optional outliers: the input channels with the largest |x| are zeroed before
the 4-bit quantization and multiplied in the input dtype against the same
weight columns. The emulations compute the same quantized operands and
multiply them in fp32: that is what the CPU tests check, since Hopper GPUs have no
FP4 tensor cores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _core
from ._tensor import QuantizedTensor, quantize
from .reference import E2M1_VALUES

__all__ = [
    "fp8_act_quant",
    "fp8_linear_emulated",
    "fp8_scaled_mm",
    "fp8_scaled_mm_linear",
    "fp8_weight_operands",
    "nvfp4_columns",
    "nvfp4_linear_emulated",
    "nvfp4_scaled_mm_linear",
    "outlier_channels",
    "quantize_activation_1x128",
]


def quantize_activation_1x128(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], fp32 scales [M, K/128]) of x2d, amax / 448 per 1x128 block (K % 128 == 0).

    The plain-PyTorch reference of the fused CUDA kernel (fp8_act_quant): both divisions are by tensors,
    so they are IEEE quotients on every device (torch's CUDA division by a Python number multiplies by
    the reciprocal instead).
    """
    m, k = x2d.shape
    blocks = x2d.float().view(m, k // 128, 128)
    amax = blocks.abs().amax(-1)
    scale = (amax / amax.new_full((), 448.0)).clamp(min=1e-30)  # all-zero blocks: codes 0, any scale
    codes = (blocks / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.view(m, k), scale


def fp8_act_quant(x2d: torch.Tensor, padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One CUDA kernel: (e4m3 codes [Mp, K], scales [Mp, K/128] outer-dim-major) for BlockWise1x128.

    Mp = padded_rows (default M); rows M..Mp-1 are zero codes. Bit-identical to quantize_activation_1x128
    for finite inputs. Needs x2d contiguous on CUDA and K % 128 == 0.
    """
    m, k = x2d.shape
    mp = m if padded_rows is None else padded_rows
    x2d = x2d.contiguous()
    codes = torch.empty(mp, k, dtype=torch.uint8, device=x2d.device)
    scales = torch.empty(k // 128, mp, dtype=torch.float32, device=x2d.device)
    with torch.cuda.device(x2d.device):
        _core.fp8_act_quant(x2d.detach().reshape(-1), codes.view(-1), scales.view(-1), m, mp, k,
                            torch.cuda.current_stream(x2d.device).cuda_stream)
    return codes.view(torch.float8_e4m3fn), scales.t()


def _fp8_weight_scales(q: QuantizedTensor) -> torch.Tensor:
    if "fp8_b_scales" not in q._cache:
        s = q.scales
        pad = (-s.shape[1]) % 4
        q._cache["fp8_b_scales"] = F.pad(s, (0, pad)).contiguous().t()
    return q._cache["fp8_b_scales"]


def fp8_weight_operands(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W^T as an e4m3 [K, N] column-major view, 128x128 scales in scaled_mm's layout), built once and cached."""
    if "fp8_b" not in q._cache:
        n, k = q.shape
        q._cache["fp8_b"] = q.data.view(torch.float8_e4m3fn).view(n, k).t()
    return q._cache["fp8_b"], _fp8_weight_scales(q)


def fp8_scaled_mm(codes: torch.Tensor, scales: torch.Tensor, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """The scaled_mm call alone: quantized activations (fp8_act_quant's output) times W^T, in `dtype`."""
    w, w_scales = fp8_weight_operands(q)
    return F.scaled_mm(codes, w, scales, F.ScalingType.BlockWise1x128, w_scales, F.ScalingType.BlockWise128x128,
                       output_dtype=dtype)


def fp8_scaled_mm_linear(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2d @ W^T on Hopper's FP8 blockwise tensor cores (see module docstring for the layouts).

    Per call: one activation-quantization kernel (M padded to a multiple of 4 inside it) and the scaled_mm;
    the weight operands are cached on q.
    """
    m = x2d.shape[0]
    mp = m + (-m) % 4
    if _core.built_with_cuda:
        codes, scales = fp8_act_quant(x2d, mp)
    else:  # pragma: no cover - a CUDA tensor with a CPU-only build never reaches this path
        xp = F.pad(x2d, (0, 0, 0, mp - m)) if mp != m else x2d
        codes, scale = quantize_activation_1x128(xp)
        scales = scale.t().contiguous().t()
    out = fp8_scaled_mm(codes, scales, q, x2d.dtype)
    out = out[:m] if mp != m else out
    return out if bias is None else out + bias


def fp8_linear_emulated(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What fp8_scaled_mm_linear computes, in fp32 on any device."""
    codes, scale = quantize_activation_1x128(x2d)
    m, k = x2d.shape
    xa = (codes.float().view(m, k // 128, 128) * scale[..., None]).view(m, k)
    out = xa @ q.dequantize(torch.float32).t()
    return (out if bias is None else out + bias.float()).to(x2d.dtype)


def outlier_channels(x2d: torch.Tensor, outliers: float) -> torch.Tensor | None:
    """Indices of the round(outliers * K) input channels with the largest max |x| (on x's device, no sync)."""
    k = x2d.shape[1]
    count = min(k, max(1, round(outliers * k))) if outliers > 0 else 0
    if count == 0:
        return None
    return x2d.abs().amax(0).topk(count).indices


def nvfp4_columns(q: QuantizedTensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Columns `index` of 2-D NVFP4 `q`, decoded ([N, len(index)] in dtype), without decoding the rest."""
    n, k = q.shape
    data = q.data.view(n, k // 2)[:, index // 2].long()
    codes = torch.where((index % 2 == 0)[None, :], data & 0x0F, data >> 4)
    magnitude = E2M1_VALUES.to(q.device)[codes & 7]
    values = torch.where((codes & 8) > 0, -magnitude, magnitude)
    scales = q.scales.view(n, k // 16)[:, index // 16].float() * q.global_scale
    return (values * scales).to(dtype)


def _split_outliers(x2d: torch.Tensor, outliers: float):
    index = outlier_channels(x2d, outliers)
    if index is None:
        return x2d, None, None
    return x2d.index_fill(1, index, 0), x2d[:, index], index


def nvfp4_scaled_mm_linear(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None,
                           outliers: float) -> torch.Tensor:
    """x2d @ W^T on Blackwell's FP4 tensor cores, with optional bf16 outlier channels."""
    main, side, index = _split_outliers(x2d, outliers)
    xq = quantize(main, "nvfp4")
    m, k = x2d.shape
    n = q.shape[0]
    recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzle = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    out = F.scaled_mm(xq.data.view(m, k // 2).view(torch.float4_e2m1fn_x2),
                      q.data.view(n, k // 2).view(torch.float4_e2m1fn_x2).t(),
                      [xq.swizzled_scales(), xq.global_scale], recipe,
                      [q.swizzled_scales(), q.global_scale], recipe,
                      swizzle_a=swizzle, swizzle_b=swizzle, output_dtype=x2d.dtype)
    if index is not None:
        out = out + side @ nvfp4_columns(q, index, x2d.dtype).t()
    return out if bias is None else out + bias


def nvfp4_linear_emulated(x2d: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None,
                          outliers: float = 0.0) -> torch.Tensor:
    """What nvfp4_scaled_mm_linear computes (same 4-bit operands, same outlier split), in fp32."""
    main, side, index = _split_outliers(x2d, outliers)
    xq = quantize(main, "nvfp4")
    out = xq.dequantize(torch.float32) @ q.dequantize(torch.float32).t()
    if index is not None:
        out = out + side.float() @ nvfp4_columns(q, index, torch.float32).t()
    return (out if bias is None else out + bias.float()).to(x2d.dtype)
