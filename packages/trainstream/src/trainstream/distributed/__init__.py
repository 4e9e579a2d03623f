"""Data parallel on torch.distributed: each rank owns a share of the trained parameters.

``sharding`` decides who owns what (pure, the same on every rank); ``checks`` makes sure every rank
wraps the same model; ``collectives`` runs the bounded collectives; ``data_parallel`` is the update
engine's step hook that reduces gradients to their owners (``overlap``: started during backward),
lets only the owners keep fp32 master weights and moments and run AdamW, and broadcasts the new
weights. ``setup`` is what the engine
calls at wrap(); ``report`` is memory_report()'s ``"distributed"`` entry. docs/distributed.md
describes the semantics, the timeouts and what is not built yet.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .checkpoint import load_checkpoint, save_checkpoint
from .checks import ModelMismatch, check_same_model, check_same_options, describe_slots
from .collectives import Comm, DistributedError
from .data_parallel import DataParallel
from .sharding import Bucket, Piece, assign_owners, make_buckets, split_evenly

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_TIMEOUT_S", "Bucket", "Comm", "DataParallel", "DistributedError",
           "ModelMismatch", "active_world", "assign_owners", "check_options", "check_same_model", "check_same_options",
           "describe_slots", "load_checkpoint", "make_buckets",
           "report", "save_checkpoint", "setup", "world_of"]

DEFAULT_TIMEOUT_S = 600.0  # each collective's wait; a rank that died or stalled raises after this
# Bytes per bucket: NCCL as DDP's default; gloo on the CPU measured fastest at 2-4 MiB (8.4 M fp32 values
# reduced between 2 ranks on 2 cores: 35 ms in 4 MiB buckets, 53 ms in 8 MiB, 100 ms in one piece).
DEFAULT_BUCKET_BYTES = {"nccl": 25 * 2**20, "gloo": 4 * 2**20}


def active_world(group=None) -> int:
    """The number of ranks of an initialized process group (1 without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def world_of(distributed) -> int:
    """The data-parallel world wrap()'s ``distributed`` option stands for: 1 when False, else the
    initialized process group's size (1 without one)."""
    return 1 if distributed is False else active_world()


def check_options(plan, device: torch.device) -> None:
    """Before wrap() sets anything up: every rank of a data-parallel run passes the same options that
    decide which collectives the set-up runs (collective; nothing when data parallel is off)."""
    opts = plan.options()
    if world_of(opts.distributed) < 2:
        return
    timeout = DEFAULT_TIMEOUT_S if opts.distributed_timeout is None else opts.distributed_timeout
    from .. import _topology

    _topology.check_launcher()  # the plan split this machine's RAM by the launcher's count: it must be right
    check_same_options(Comm(None, device, timeout), {
        "param_offload (streamed blocks)": list(plan.streamed_blocks), "quantize": plan.quantize,
        "stream_packing": opts.stream_packing, "host_embedding": opts.host_embedding, "peer": opts.peer,
        "attention": opts.attention, "distributed": opts.distributed})


def setup(slots: list, device: torch.device, events, *, enabled: bool | None = None, settings: dict | None = None,
          group=None, timeout: float | None = None, bucket_bytes: int | None = None) -> DataParallel | None:
    """Data parallel for the engine's `slots`, or None when off. ``enabled``: None turns it on when an
    initialized process group has more than one rank, True requires a process group, False is off.
    Collective: checks that every rank has the same model (``settings`` included), assigns each
    parameter an owner (``slot.owned``), and gives every rank rank 0's weights of the optimizer's parameters."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"distributed={enabled!r} is not valid; use None (on when a process group of more than "
                         f"one rank exists), True or False")
    if enabled is False:
        return None
    initialized = dist.is_available() and dist.is_initialized()
    if enabled is None and (not initialized or dist.get_world_size(group) < 2):
        return None
    if not initialized:
        raise ValueError("distributed=True needs an initialized process group: call "
                         "torch.distributed.init_process_group() first (torchrun sets the environment it reads)")
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    comm = Comm(group, device, timeout) if group is not None else Comm.dedicated(device, timeout)
    try:
        return _setup(comm, slots, events, settings, bucket_bytes)
    except BaseException:
        comm.close()
        raise


def _setup(comm: Comm, slots: list, events, settings: dict | None, bucket_bytes: int | None) -> DataParallel:
    check_same_model(comm, slots, settings)
    trained = [s for s in slots if s.param.requires_grad]
    frozen = [s for s in slots if not s.param.requires_grad]
    pieces: list[list[Piece]] = [[] for _ in slots]
    for s, mine in zip(trained, split_evenly([s.numel for s in trained], comm.world)):
        pieces[s.index] = [dataclasses.replace(p, item=s.index) for p in mine] or [Piece(s.index, 0, 0, 0)]
    loads = [0] * comm.world
    for s in trained:
        for p in pieces[s.index]:
            loads[p.owner] += p.numel * s.param.element_size()
    # Frozen parameters get owners too (whole), in case they are unfrozen later.
    for s, owner in zip(frozen, assign_owners([s.numel * s.param.element_size() for s in frozen], comm.world, loads)):
        pieces[s.index] = [Piece(s.index, owner, 0, s.numel)]
    if bucket_bytes is None:
        bucket_bytes = DEFAULT_BUCKET_BYTES[comm.transport]
    dp = DataParallel(comm, slots, pieces, bucket_bytes, events=events)
    dp.share_weights(list(slots), source=0)  # frozen ones too: they may be unfrozen later
    mine = [s for s in trained if s.owned]
    share = sum(s.numel for s in mine) / max(1, sum(s.numel for s in trained))
    split = sum(s.span is not None for s in mine)
    events.add("distributed", f"data parallel over {comm.world} ranks ({comm.backend}): rank {comm.rank} owns "
                              f"{share:.1%} of the trained values ({len(mine)} of {len(trained)} trained parameters, "
                              f"{split} of them in part) and keeps their master weights and moments; the "
                              f"optimizer's weights start as rank 0's; "
                              f"gradients are averaged into their owner (each bucket's reduction starts during the backward "
                              f"that completes the accumulation window, from the second step on) and the new "
                              f"weights broadcast at step()")
    return dp


def report(engine) -> dict | None:
    """memory_report(model)["distributed"]: None without data parallel, else DataParallel.report()."""
    dp = getattr(engine, "step_hook", None)
    return dp.report() if isinstance(dp, DataParallel) else None
