"""The frozen Plan: every decision wrap() applies, each with its reason, and the priced memory plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._options import WrapOptions
from ..memory.sizing import WrapPlan

__all__ = ["Decision", "Plan", "Transition", "fingerprint"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One automatic decision: the option it settles (wrap()'s name), the value chosen, and why."""

    option: str
    value: Any
    reason: str

    def to_dict(self) -> dict:
        return {"option": self.option, "value": self.value, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class Transition:
    """One run-time adaptation of a plan (``trainstream/_schedule.py`` names them and says when each runs):
    the optimizer step after which it ran, what it changed, each as (what, before, after) in the words of
    ``memory_report()``, and why. A transition that looked and changed nothing has no changes."""

    step: int
    name: str
    reason: str
    changes: tuple[tuple[str, Any, Any], ...] = ()

    def to_dict(self) -> dict:
        return {"step": self.step, "transition": self.name, "reason": self.reason,
                "changes": {what: {"before": before, "after": after} for what, before, after in self.changes}}


def fingerprint(model: torch.nn.Module, optimizer) -> tuple:
    """What a plan depends on in the model and optimizer it was made for: their identities and each
    parameter's name, shape, dtype, device and whether it trains (no reference to either is kept)."""
    params = tuple((name, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad)
                   for name, p in model.named_parameters(remove_duplicate=False))
    return id(model), id(optimizer) if optimizer is not None else None, params


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``trainstream.plan()`` decided for one model, optimizer and set of options; ``wrap(plan=)``
    applies it as it is. ``memory``: the priced plan (bytes by category and place, the lower bound);
    ``decisions``: each automatic choice with its reason; ``notes``: what planning found on the way.

    Invariant: ``resolved`` holds no "auto" for the options a plan settles (param_offload, quantize,
    stream_packing, host_embedding); applying reads them and decides nothing again."""

    device: torch.device
    streamed_blocks: tuple[int, ...]  # blocks whose weights stream from host memory
    quantize: str | None  # the format wrap() stores the blocks' frozen linear weights in (None: as they are)
    moment_dtype: torch.dtype
    memory: WrapPlan
    host_message: str  # the optimizer state's host plan, as the event log says it
    host_state_bytes: int  # host bytes of this process's optimizer state (page-locked; disk tier staging)
    decisions: tuple[Decision, ...]
    notes: tuple[tuple[str, str], ...]  # (event kind, text) for the session's log
    resolved: tuple[tuple[str, Any], ...]  # the options with every "auto" above settled
    made_for: tuple
    disk_state: tuple[int, ...] = ()  # positions in the trained parameters whose master and moments are on disk
    disk_state_bytes: int = 0  # the disk tier's scratch file (nvme_path)
    history: tuple[Transition, ...] = ()  # the run-time transitions since wrap() applied it (adapted())

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def options(self) -> WrapOptions:
        """A fresh WrapOptions of the resolved options (each apply gets its own; the plan never changes)."""
        return WrapOptions(**dict(self.resolved))

    def adapted(self, transition: Transition) -> Plan:
        """The plan after a run-time transition: the same decisions, the transition appended to the history
        (the plan made before training is never changed in place)."""
        return dataclasses.replace(self, history=(*self.history, transition))

    def decision(self, option: str) -> Decision | None:
        return next((d for d in self.decisions if d.option == option), None)

    def to_dict(self) -> dict:
        """The plan as plain JSON types: ``memory_report(model)["plan"]``."""
        return {**self.memory.to_dict(), "device": str(self.device), "moment_dtype": _dtype_name(self.moment_dtype),
                "streamed_block_indices": list(self.streamed_blocks), "host_state_bytes": self.host_state_bytes,
                "disk_state_bytes": self.disk_state_bytes, "disk_state_params": len(self.disk_state),
                "decisions": [d.to_dict() for d in self.decisions],
                "transitions": [t.to_dict() for t in self.history]}

    def explain(self) -> str:
        """The plan as text: the verdict, then each decision and its reason."""
        lines = [("fits" if self.fits else "does not fit") + f": {self.memory.message}", self.host_message]
        lines += [f"  {d.option}={d.value!r}: {d.reason}" for d in self.decisions]
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
