"""The disk tier: the fp32 master weights and AdamW moments of the slots the plan put on disk (``nvme_path``).

One ``ts_adamw.DiskState`` (one scratch file, no name on disk, gone when closed or when the process ends)
holds them all, each slot under its index, rounding with its index as key, as the in-RAM update does, so a
slot trains bit for bit whichever tier holds its state. Host RAM keeps each slot's gradient landing buffer
and upload buffer (``ParamSlot.allocate``); an update reads the slot's segments, runs ts-adamw's host
kernel and writes them back (read ahead, write behind, inside ``DiskState.step``), and reads ahead the first
segments of the bucket that came next the step before; its writes may still be in flight when it returns.

Ownership: the engine creates and closes the tier. Only the host worker steps it (updates run one at a
time on that thread); the main thread reads or writes a slot's state only while the slot is not QUEUED
(export, load, a user's edit of the weight), as it does the buffers in RAM (slots.py, invariant 4).
"""

from __future__ import annotations

import os

import torch
import ts_adamw

__all__ = ["DiskTier"]

_STAT_KEYS = ("read_wait_s", "write_wait_s", "update_s", "step_s")


class DiskTier:
    """The state of ``slots`` in one scratch file in ``directory``; ``values``: each slot's initial weight
    (flat, in its memory order), which becomes its master; the moments start at zero. ``segment_values``:
    values per transfer (the plan's, which priced the staging buffers)."""

    def __init__(self, slots: list, values: list[torch.Tensor], directory: str | os.PathLike,
                 moment_dtype: torch.dtype, segment_values: int):
        self.state = ts_adamw.DiskState([(str(s.index), v) for s, v in zip(slots, values)], directory,
                                        moment_dtype=moment_dtype, keys=[s.index & 0xFFFFFFFF for s in slots],
                                        segment_values=segment_values)  # default depth: the plan priced it
        self.directory = os.fspath(directory)
        self.moment_dtype = moment_dtype
        self.updates = 0  # DiskState.step calls (each a bucket of slots)
        # The bucket that followed each bucket last time: buckets update in the same order every step
        # (backward's, or slot order at step() with clipping), so while one updates the next one's first
        # segments are read ahead; the last bucket of a step reads ahead the first of the next.
        self._next: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._last: tuple[str, ...] | None = None
        self.seconds = dict.fromkeys(_STAT_KEYS, 0.0)  # summed over every step: where the worker's time went

    # ---- the host worker ------------------------------------------------------------------------------

    def step(self, slots: list, kwargs: dict) -> None:
        """One AdamW step of ``slots`` (their gradients in ``grad_host``; the rounded weights written to
        ``out_host``). A failure before the first segment's update changes nothing; a later one leaves the
        tier unusable (``DiskState.step``), and every later step says so."""
        names = tuple(str(s.index) for s in slots)
        if self._last is not None:
            self._next[self._last] = names
        self._last = names
        ahead = self._next.get(names)
        # Writes stay in flight when the step returns: the last buckets' write-back overlaps the next forward;
        # each lands before its segment is read again (DiskState.step, wait_writes).
        self.state.step([s.grad_host for s in slots], names=list(names), params_out=[s.out_host for s in slots],
                        prefetch=None if ahead is None else list(ahead), wait_writes=False, **kwargs)
        self.updates += 1
        for key, value in self.state.stats.items():
            self.seconds[key] += value

    # ---- the main thread (slot not QUEUED) --------------------------------------------------------------

    def read(self, slot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of the slot, as new flat CPU tensors in its memory order."""
        got = self.state.read_state(str(slot.index))
        return got["param"], got["exp_avg"], got["exp_avg_sq"]

    def write(self, slot, master: torch.Tensor | None = None, exp_avg: torch.Tensor | None = None,
              exp_avg_sq: torch.Tensor | None = None) -> None:
        """Replaces the given parts of the slot's state (flat, in its memory order)."""
        self.state.write_state(str(slot.index), param=master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    # ---- the engine --------------------------------------------------------------------------------------

    def wait_seconds(self) -> float:
        """Seconds the worker has waited on this tier's reads and writes, in all (the stall clock's disk)."""
        return self.seconds["read_wait_s"] + self.seconds["write_wait_s"]

    def report(self) -> dict:
        """What ``memory_report(model)["optimizer"]["disk"]`` shows."""
        return {"path": self.directory, "file_bytes": self.state.nbytes, "params": len(self.state.names),
                "direct_io": self.state.direct, "staging_sets": self.state.depth, "updates": self.updates,
                **{key: round(value, 6) for key, value in self.seconds.items()},
                "failed": None if self.state.failed is None else repr(self.state.failed)}

    def close(self) -> None:
        """Frees the file (idempotent)."""
        if not self.state.closed:
            self.state.close()
