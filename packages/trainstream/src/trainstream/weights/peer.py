"""peer=: the frozen blocks every rank streams are pooled in the GPUs' VRAM (ts-peer) and copied
GPU to GPU instead of from host memory.

Set up collectively at step ``SETUP_STEP`` (``trainstream._schedule.PEER_SETUP_STEP``) on every rank of the default process group (the VRAM
each step leaves is known by then and the activation policy has settled), only when weights
stream, the group has more than one rank and all of them are on this machine. Each rank gives
its pool ``peer=`` bytes, or with ``"auto"`` half the room under the VRAM budget after the
measured peak. Every outcome is an event; an unusable setup leaves host streaming as it was.
"""

from __future__ import annotations

import torch

from .. import _topology
from .._schedule import PEER_SETUP_STEP
from .._units import fmt_bytes
from ..memory.sizing import vram_budget

__all__ = ["SETUP_STEP", "check_peer_option", "setup_peer"]

SETUP_STEP = PEER_SETUP_STEP  # trainstream._schedule owns the step; kept here for the pool's users


def check_peer_option(value):
    if value is None or value is False or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"peer={value!r} is not valid; use 'auto', False, None or bytes per GPU (an integer > 0)")


def _why_not(streamer, option) -> str | None:
    """None when a pool may be set up, else why not (for the event)."""
    if option is None or option is False:
        return ""  # off as asked: no event
    if streamer is None:
        return "peer pools hold streamed weights: none stream (param_offload=False)"
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return "peer pools need data parallel ranks (an initialized process group of 2 or more)"
    return None


def _spans_machines() -> str | None:
    """Collective: why not, when the ranks are on more than one machine (``_topology``: hostname, boot id and
    /dev/shm, not a guess from LOCAL_WORLD_SIZE, which Slurm-style launches do not set)."""
    keys = _topology.machine_keys()
    here = sum(k == keys[torch.distributed.get_rank()] for k in keys)
    if here == len(keys):
        return None
    return (f"the group spans machines ({len(keys)} ranks, {here} on this one): peer pools over a machine's own "
            f"group are not built yet")


def _own_budget(option, streamer, device: torch.device, headroom: float) -> int:
    if isinstance(option, int):
        return option
    if device.type != "cuda":
        return streamer.host_bytes()  # the host backend (tests, CPU): room for every block
    room = vram_budget(device, headroom) - torch.cuda.max_memory_allocated(device)
    return max(0, room // 2)


def setup_peer(streamer, option, device: torch.device, headroom: float, events):
    """Collective (every rank, same step). Returns the pool in use, or None."""
    why = _why_not(streamer, option)
    if why is not None:
        if why:
            events.add("peer", f"peer={option!r}: off: {why}")
        return None
    why = _spans_machines()
    if why is not None:
        events.add("peer", f"peer={option!r}: off: {why}")
        return None
    import ts_peer

    dist = torch.distributed
    budgets = [None] * dist.get_world_size()
    dist.all_gather_object(budgets, _own_budget(option, streamer, device, headroom))
    backend = "cuda" if device.type == "cuda" else "host"
    pool, reason = ts_peer.pool_blocks(streamer.host_blocks(), None, device=device, budgets=budgets,
                                       backend=backend)
    if pool is None:
        events.add("peer", f"peer={option!r}: off: {reason}")
        return None
    streamer.use_peer(pool)
    events.add("peer", f"peer={option!r}: {reason}; this rank's pool holds {fmt_bytes(pool.pool_bytes)} "
                       f"({backend} backend)")
    return pool
