"""Block quantization for frozen PyTorch weights: int8, NF4, FP8 and NVFP4 (CPU and CUDA kernels)."""

from ._formats import DEFAULT_BLOCK, FORMATS
from ._tensor import QuantizedTensor, quantize

__all__ = ["DEFAULT_BLOCK", "FORMATS", "QuantizedTensor", "quantize"]
__version__ = "0.1.0"
