"""Peer-GPU block pools: when the GPUs of one machine can read each other's memory, frozen
blocks are split among the ranks' GPUs and each rank copies a block from its owner's GPU
(CUDA IPC handles exchanged through torch.distributed) instead of from host RAM."""

from ._auto import pool_blocks
from ._core import DeviceBuffer
from ._handles import IpcHandle
from ._native import cuda_available
from ._plan import assign_blocks, split_free_vram
from ._pool import PeerPool
from ._support import peer_support, pool_budgets

__all__ = ["DeviceBuffer", "IpcHandle", "PeerPool", "assign_blocks", "cuda_available", "peer_support", "pool_blocks",
           "pool_budgets", "split_free_vram"]
__version__ = "0.7.0"
