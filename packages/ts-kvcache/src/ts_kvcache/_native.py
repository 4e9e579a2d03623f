"""Calls into the native core: page gathers and scatters between a slot and host pages."""

from __future__ import annotations

import torch

from . import _core

__all__ = ["METHODS", "copy_pages"]

METHODS = {"engine": 0, "kernel": 1}


def copy_pages(
    addresses: torch.Tensor,
    slot: torch.Tensor,
    page_tokens: int,
    first_page: int,
    to_pages: bool,
    *,
    method: str = "engine",
    stream: int = 0,
    offset: int = 0,
    tokens: int | None = None,
) -> None:
    """Copies host pages (int64 ``addresses``, logical pages ``first_page``.. of the layer)
    into ``slot`` ``[2, batch, kv_heads, capacity, head_dim]``, or the slot's pages into them
    when ``to_pages``: tokens ``offset .. offset + tokens`` of each page (default: all of them).
    CUDA slots: enqueued on the stream handle ``stream``, never synchronized."""
    if addresses.numel() == 0:
        return
    _two, batch, heads, capacity, head_dim = slot.shape
    token_width = head_dim * slot.element_size()
    row_pitch = capacity * token_width
    page_width = page_tokens * token_width
    rows = 2 * batch * heads
    column = offset * token_width
    width = page_width - column if tokens is None else tokens * token_width
    if slot.device.type == "cuda":
        with torch.cuda.device(slot.device):
            _core.copy_pages(addresses, slot, rows, row_pitch, page_width, first_page, to_pages, METHODS[method], stream,
                             column, width)
    else:
        _core.copy_pages(addresses, slot, rows, row_pitch, page_width, first_page, to_pages, 0, 0, column, width)
