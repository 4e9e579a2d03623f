"""Block quantization for frozen PyTorch weights: int8, NF4, FP8 and NVFP4 (CPU and CUDA kernels),
QuantizedTensor, a quantized linear layer for LoRA-style training, and a lossless 12-bit packing of
bf16 tensors for the host-to-device link."""

from ._formats import DEFAULT_BLOCK, FORMATS
from ._fused import FusedLinearUnavailable
from ._linear import QuantLinear, configure_linear, linear_path, quantized_linear
from ._packed import PackedBf16, pack_bf16, plan_bf16_packing, unpack_bf16
from ._scaled import fp8_linear_emulated, nvfp4_columns, nvfp4_linear_emulated
from ._swizzle import swizzle_block_scales
from ._tensor import QuantizedTensor, quantize
from .reference import dequantize_reference, quantize_reference

__all__ = [
    "DEFAULT_BLOCK",
    "FORMATS",
    "FusedLinearUnavailable",
    "PackedBf16",
    "QuantLinear",
    "QuantizedTensor",
    "configure_linear",
    "dequantize_reference",
    "fp8_linear_emulated",
    "linear_path",
    "nvfp4_columns",
    "nvfp4_linear_emulated",
    "pack_bf16",
    "plan_bf16_packing",
    "quantize",
    "quantize_reference",
    "quantized_linear",
    "swizzle_block_scales",
    "unpack_bf16",
]
__version__ = "0.7.0"
