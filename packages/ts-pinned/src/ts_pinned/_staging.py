"""copy_to_device: pageable host tensors to the GPU through pinned slots."""

from __future__ import annotations

import torch

from . import _core

__all__ = ["copy_to_device", "staging_stats"]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def copy_to_device(src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream | int | None = None) -> torch.Tensor:
    """Copies CPU tensor ``src`` into ``dst`` (same shape and dtype) through a ring of
    page-locked slots that all cores fill while the previous one crosses the link.

    Returns once ``src`` has been read; a CUDA ``dst`` is complete in the order of
    ``stream`` (default: the current stream of ``dst``'s device). A CPU ``dst`` runs
    the same staging path with memory copies. Returns ``dst``.
    """
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        raise ValueError("copy_to_device takes two tensors")
    if src.device.type != "cpu":
        raise ValueError(f"src must be a CPU tensor, got one on {src.device}")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(
            f"src and dst must match: src is {tuple(src.shape)} {src.dtype}, dst is {tuple(dst.shape)} {dst.dtype}"
        )
    if not dst.is_contiguous():
        raise ValueError("dst must be contiguous (the copy writes its memory directly)")
    if dst.is_conj() or dst.is_neg():
        raise ValueError("dst must not be a conjugate or negative view; pass the tensor it views")
    if dst.device.type not in ("cuda", "cpu"):
        raise ValueError(f"dst must be a CUDA or CPU tensor, got {dst.device}")
    if src.numel() == 0:
        return dst
    # Raw bytes are copied: materialize lazy conjugate / negative views and strides first.
    plain_src = src.detach().resolve_conj().resolve_neg().contiguous()
    handle = 0
    if dst.device.type == "cuda":
        if stream is None:
            stream = torch.cuda.current_stream(dst.device)
        if isinstance(stream, torch.cuda.Stream) and stream.device != dst.device:
            raise ValueError(f"stream is on {stream.device} but dst is on {dst.device}; pass a stream of dst's device")
        handle = stream if isinstance(stream, int) else stream.cuda_stream
        with torch.cuda.device(dst.device):
            _core.copy_to_device(_as_bytes(plain_src), _as_bytes(dst), handle)
    else:
        _core.copy_to_device(_as_bytes(plain_src), _as_bytes(dst), handle)
    return dst


def staging_stats() -> dict:
    """Counters of the staging ring: copies, bytes, slot waits, slot size and count."""
    return _core.staging_stats()
