"""Thin Python side of the native core: availability, stream handles, process-group helpers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _core

__all__ = ["cuda_available", "gather", "rank_and_world", "stream_handle", "unavailable_reason"]


def cuda_available() -> bool:
    """True when this build has CUDA and a device and driver are present (and torch sees CUDA)."""
    return bool(_core.cuda_available()) and torch.cuda.is_available()


def unavailable_reason() -> str:
    """Why cuda_available() is False, in words ('' when it is True)."""
    if not _core.built_with_cuda:
        return ("ts-peer was built without CUDA; reinstall it with a CUDA toolkit on PATH "
                "(TS_ENABLE_CUDA=ON) to use peer pools")
    if not _core.cuda_available():
        return "no CUDA device or driver is present in this process"
    if not torch.cuda.is_available():
        return "this torch build has no CUDA (torch.cuda.is_available() is False)"
    return ""


def stream_handle(stream, device: torch.device) -> int:
    """The cudaStream_t (as an int) of ``stream``: None means the current stream of ``device``."""
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(stream, torch.cuda.Stream):
        if stream.device != device:
            raise ValueError(f"stream is on {stream.device}, the copy's destination on {device}; pass a stream "
                             "of the destination's device")
        return stream.cuda_stream
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
        return stream
    raise ValueError(f"stream={stream!r} must be None, a torch.cuda.Stream or a cudaStream_t handle (int >= 0)")


def rank_and_world(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise ValueError("a process group was given but torch.distributed is not initialized; call "
                         "torch.distributed.init_process_group first")
    return 0, 1


def gather(obj, group, world: int) -> list:
    """Every rank's ``obj``, indexed by rank in ``group`` (all_gather_object; a collective)."""
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
