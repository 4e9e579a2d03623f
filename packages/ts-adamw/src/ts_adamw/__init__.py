"""Fast AdamW for PyTorch: a host engine (threads + SIMD, fp32/bf16 moments) and CUDA kernels."""

import atexit

from . import _core
from ._cuda import cuda_adamw_step
from ._functional import StepHandle, adamw_step, adamw_step_async, sum_of_squares
from ._optimizer import AdamW

# Steps still in flight at exit (handles never waited, or alive until interpreter teardown) finish before
# Python starts freeing objects and the C++ runtime runs static destructors.
atexit.register(_core._drain_async)

built_with_cuda: bool = _core.built_with_cuda
host_isa = _core.host_isa
host_threads = _core.host_threads
set_host_threads = _core.set_host_threads

__all__ = [
    "AdamW",
    "StepHandle",
    "adamw_step",
    "adamw_step_async",
    "built_with_cuda",
    "cuda_adamw_step",
    "host_isa",
    "host_threads",
    "set_host_threads",
    "sum_of_squares",
]
__version__ = "0.1.0"
