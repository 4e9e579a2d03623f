"""Fast AdamW for PyTorch: a host engine (threads + SIMD, fp32/bf16 moments), CUDA kernels, and AdamW over
state kept on disk (StateFile, DiskState)."""

import atexit

from . import _core  # type: ignore[attr-defined]  # the native module: no stub, Any to mypy
from ._cuda import CudaAdamWBatch, cuda_adamw_step
from ._disk import DiskIOError, DiskState, StateFile, adamw_step_on_disk, aligned_empty
from ._functional import HostAdamW, StepHandle, adamw_step, adamw_step_async, adamw_steps, sum_of_squares
from ._optimizer import AdamW

# Steps still in flight at exit (handles never waited, or alive until interpreter teardown) finish before
# Python starts freeing objects and the C++ runtime runs static destructors.
atexit.register(_core._drain_async)

built_with_cuda: bool = _core.built_with_cuda
host_isa = _core.host_isa


def host_threads() -> int:
    """Threads of the process-wide host pool that every TrainStream core shares (default: the physical cores
    this process may use)."""
    return int(_core.host_threads())


def usable_cores() -> int:
    """Logical CPUs this process may run on at once: its CPU affinity mask (taskset, cpusets) bounded by its
    cgroup CPU quota (``cpu.max`` in v2, ``cpu.cfs_quota_us`` in v1, rounded up). ``threads=`` arguments and
    ``set_host_threads`` accept up to ``max_host_threads()`` = 4 x this."""
    return int(_core.usable_cores())


def max_host_threads() -> int:
    """The largest thread count ``set_host_threads`` and ``threads=`` accept: 4 x ``usable_cores()``."""
    return int(_core.max_host_threads())


def set_host_threads(threads: int) -> bool:
    """Sizes the process-wide host pool (shared by every TrainStream core), from the next parallel loop on,
    after any running one. ValueError unless ``1 <= threads <= max_host_threads()``. Returns True."""
    return bool(_core.set_host_threads(threads))


def set_streaming_stores(mode: str) -> None:
    """How host steps write ``param_out``, process-wide: ``"auto"`` (default: non-temporal
    stores when one call writes at least 32 MiB of it), ``"on"`` or ``"off"``. Non-temporal
    stores skip the cache and the read-for-ownership of each line; use ``"on"`` when the
    rounded weights are next read by a DMA copy (to the GPU), not by this CPU. Same bits."""
    _core._set_streaming_stores(mode)


def streaming_stores() -> str:
    """The current ``param_out`` store mode: ``"auto"``, ``"on"`` or ``"off"``."""
    return str(_core._streaming_stores())

__all__ = [
    "AdamW",
    "CudaAdamWBatch",
    "DiskIOError",
    "DiskState",
    "HostAdamW",
    "StateFile",
    "StepHandle",
    "adamw_step",
    "adamw_step_async",
    "adamw_step_on_disk",
    "adamw_steps",
    "aligned_empty",
    "built_with_cuda",
    "cuda_adamw_step",
    "host_isa",
    "host_threads",
    "max_host_threads",
    "set_host_threads",
    "set_streaming_stores",
    "streaming_stores",
    "sum_of_squares",
    "usable_cores",
]
__version__ = "0.7.0"
