"""TrainStream: train models whose training state does not fit in GPU memory.

``model, optimizer = trainstream.wrap(model, optimizer)``
"""

import sys as _sys
import warnings as _warnings

import torch.distributed as _dist

# Checked before the imports below pull in torch._dynamo (docs/distributed.md: import order).
if "torch._dynamo" not in _sys.modules and _dist.is_available() and _dist.is_initialized():
    _warnings.warn(
        "trainstream was imported after init_process_group(): it imports torch._dynamo, which then keeps the "
        "default process group referenced after destroy_process_group(), and with gloo the group's threads "
        "can abort the process at exit. Import trainstream before init_process_group().",
        RuntimeWarning, stacklevel=2)

from ts_kvcache import PagedKVCache  # the reference's trainstream.PagedKVCache; ts-kvcache owns it
from ts_pinned import reserve_pinned

from . import prototype
from ._compile import compile_blocks
from ._config import ActivationsConfig, Config, OptimizerConfig, PrototypeConfig, RuntimeConfig, WeightsConfig
from ._hardware import HardwareProfile, profile_hardware
from ._losses import causal_lm_loss, chunked_cross_entropy, dpo_loss, sequence_logprobs
from ._optimizer import OffloadAdamW
from ._plot import plot_memory
from ._report import memory_report, pinned_stats
from ._session import TrainStreamSession
from ._wrap import unwrap, wrap
from .activations import ActivationOffloader
from .engine import transfer_stats
from .memory import find_blocks
from .planning import Decision, Plan, PlanRefused, plan
from .weights import quantize_model

__all__ = [
    "ActivationOffloader",
    "ActivationsConfig",
    "Config",
    "Decision",
    "HardwareProfile",
    "OffloadAdamW",
    "OptimizerConfig",
    "PagedKVCache",
    "Plan",
    "PlanRefused",
    "PrototypeConfig",
    "RuntimeConfig",
    "TrainStreamSession",
    "WeightsConfig",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "compile_blocks",
    "dpo_loss",
    "find_blocks",
    "memory_report",
    "pinned_stats",
    "plan",
    "plot_memory",
    "profile_hardware",
    "prototype",
    "quantize_model",
    "reserve_pinned",
    "sequence_logprobs",
    "transfer_stats",
    "unwrap",
    "wrap",
]
__version__ = "0.7.0"
