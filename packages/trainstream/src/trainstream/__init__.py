"""TrainStream: train models whose training state does not fit in GPU memory.

``model, optimizer = trainstream.wrap(model, optimizer)``
"""

from ts_kvcache import PagedKVCache  # the reference's trainstream.PagedKVCache; ts-kvcache owns it
from ts_pinned import reserve_pinned

from ._compile import compile_blocks
from ._hardware import HardwareProfile, profile_hardware
from ._losses import causal_lm_loss, chunked_cross_entropy, dpo_loss, sequence_logprobs
from ._optimizer import OffloadAdamW
from ._plot import plot_memory
from ._report import memory_report, pinned_stats
from ._session import TrainStreamSession
from ._wrap import unwrap, wrap
from .engine import transfer_stats
from .memory import ActivationOffloader, find_blocks, quantize_model
from .memory.plan import PlanRefused

__all__ = [
    "ActivationOffloader",
    "HardwareProfile",
    "OffloadAdamW",
    "PagedKVCache",
    "PlanRefused",
    "TrainStreamSession",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "compile_blocks",
    "dpo_loss",
    "find_blocks",
    "memory_report",
    "pinned_stats",
    "plot_memory",
    "profile_hardware",
    "quantize_model",
    "reserve_pinned",
    "sequence_logprobs",
    "transfer_stats",
    "unwrap",
    "wrap",
]
__version__ = "0.1.0"
