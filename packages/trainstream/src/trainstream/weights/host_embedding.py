"""host_embedding: a frozen input embedding lives in page-locked host memory; each lookup is a kernel
that reads the looked-up rows over the link (ts_pinned.gather_rows), so the table never takes VRAM
and no lookup waits for the host. A 14B-shaped model's 152,064 x 5,120 bf16 table is 1.45 GiB: room
for two or three more resident blocks; 2,048 tokens read 20 MiB.

Invariants:
  1. While installed, the embedding's weight is a CPU view of the page-locked table (reads, state_dict,
     deepcopy and load_state_dict see and write it there); the table is the only copy.
  2. A lookup enqueues on the current stream of the ids' device and never synchronizes. An id outside
     [0, rows) makes a zero row and sets a flag in host memory, raised as IndexError by the next lookup
     (a GPU gather cannot raise where it runs; PyTorch's own embedding asserts on the device instead).
  3. ``remove()`` puts the weight back on the device as an ordinary tensor and the module's forward back.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
import ts_pinned
from torch import nn

__all__ = ["HostEmbedding", "host_embedding_candidate"]


def host_embedding_candidate(model: nn.Module) -> tuple[nn.Embedding | None, str]:
    """(the model's input embedding, "") when its table can live in host memory, else (None, why not)."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if type(embedding) is not nn.Embedding:
        return None, "the model has no plain nn.Embedding input embedding"
    weight = embedding.weight
    if weight.requires_grad:
        return None, "the input embedding is trained"
    if embedding.max_norm is not None or embedding.sparse:
        return None, "the input embedding renormalizes rows (max_norm) or has sparse gradients"
    owners = sum(1 for _n, p in model.named_parameters(remove_duplicate=False) if p is weight)
    output = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if owners > 1 or (output is not None and getattr(output, "weight", None) is weight):
        return None, "the input embedding's weight is shared (tied to the output layer)"
    return embedding, ""


def forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """The installed forward. Named ``forward``: a pickled model's bound method unpickles as the class's own."""
    state = self.__dict__.get("_trainstream_host_embedding")
    if state is None or state.weight is not self.weight:  # a copy of the model (deepcopy): a plain embedding
        return nn.Embedding.forward(self, ids)
    return state.lookup(ids)


class HostEmbedding:
    """Moves ``embedding``'s table into page-locked host memory of ``arena`` (``install``); its forward
    then gathers rows on ``device``. Raises RuntimeError when the page-lock budget cannot hold the table."""

    def __init__(self, embedding: nn.Embedding, device: torch.device, arena: ts_pinned.PinnedArena):
        self.module, self.device, self.arena = embedding, torch.device(device), arena
        self.weight = embedding.weight
        self.table: torch.Tensor | None = None
        self.bad: torch.Tensor | None = None
        self.lookups = 0
        self.rows_read = 0
        self.installed = False

    def __reduce__(self):  # a copy of the model (deepcopy, pickle) gets a plain embedding
        return (type(None), ())

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def install(self) -> HostEmbedding:
        raw = self.arena.empty(self.nbytes, torch.uint8, tag="embedding", allow_pageable=True)
        if not self.arena.is_pinned(raw):
            raise RuntimeError("the page-lock budget cannot hold the input embedding")
        flag = self.arena.empty(16, torch.uint8, tag="embedding", allow_pageable=True)
        if not self.arena.is_pinned(flag):
            raise RuntimeError("the page-lock budget cannot hold the input embedding's flag")
        self.table = raw.view(self.weight.dtype).view(self.weight.shape)
        self.table.copy_(self.weight.detach())
        self.bad = flag[:4].view(torch.int32)
        self.bad.zero_()
        self.weight.data = self.table  # invariant 1: the old device storage is freed
        self.installed = True
        self.module._trainstream_host_embedding = self
        self.module.forward = types.MethodType(forward, self.module)
        return self

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if int(self.bad.item()):  # invariant 2: an earlier lookup on the GPU met an id out of range
            self.bad.zero_()
            raise IndexError(f"an earlier forward looked up an id outside [0, {self.table.shape[0]}) in the input "
                             f"embedding (its rows came out as zeros)")
        self.lookups += 1
        self.rows_read += ids.numel()
        if ids.device.type != "cuda":  # ids on the CPU: look up there, upload the rows
            return F.embedding(ids, self.table).to(self.device)
        out = torch.empty((*ids.shape, self.table.shape[1]), dtype=self.table.dtype, device=ids.device)
        return ts_pinned.gather_rows(self.table, ids, out, self.bad)

    def remove(self) -> None:
        """Invariant 3 (also after a failed install)."""
        self.module.__dict__.pop("forward", None)
        self.module.__dict__.pop("_trainstream_host_embedding", None)
        if self.installed:
            torch.cuda.synchronize(self.device)  # no gather still reads the table
            self.weight.data = self.table.to(self.device)
            self.installed = False
        self.table = self.bad = None

    def report(self) -> dict:
        return {"bytes": self.nbytes, "lookups": self.lookups, "rows_read": self.rows_read,
                "link_bytes": self.rows_read * self.weight[0].numel() * self.weight.element_size()}
