"""The hyper-parameters of one step's updates that start before step().

Without clipping, an update starts the moment its gradient is complete, during backward; the others of
the same step start later (a bucket at the end of backward, resident state at ``step()``). So that a step
is trained with one set of values, the first read of each param group in the window is kept and used for
the rest of it; at the end of ``step()`` a value the user changed since (between ``backward()`` and
``step()``, where torch would apply it) is refused with each change named, once the step is complete.
"""

from __future__ import annotations

from .slots import ParamSlot
from .updates import Hyper, group_hypers, hyper_of

__all__ = ["WindowHypers"]

_COMPARED = ("lr", "beta1", "beta2", "eps", "weight_decay", "maximize")


class WindowHypers:
    """Per window: id(param group) -> (the slot it was first read for, the Hyper read). Cleared by
    ``late_edits()`` (end of step()) and ``clear()`` (zero_grad()); the engine owns it."""

    def __init__(self, seed: int):
        self.seed = seed
        self._read: dict[int, tuple[ParamSlot, Hyper]] = {}

    def of(self, slots: list[ParamSlot]) -> dict[int, Hyper]:
        """The hyper-parameters of `slots`' groups for updates starting now: those read for this window's first
        update of the group, else read (and checked) now."""
        read = self._read
        fresh = group_hypers([s for s in slots if id(s.group) not in read], 1.0, self.seed)
        for s in slots:
            if id(s.group) in fresh:
                read[id(s.group)] = (s, fresh[id(s.group)])
        return {key: read[key][1] for key in {id(s.group) for s in slots}}

    def get(self, group: dict) -> Hyper | None:
        entry = self._read.get(id(group))
        return None if entry is None else entry[1]

    def clear(self) -> None:
        self._read = {}

    def late_edits(self) -> str | None:
        """Ends the window: a refusal naming each value a param group changed after the window's updates had
        started with the old one, else None."""
        read, self._read = self._read, {}
        changes = []
        for slot, used in read.values():
            try:
                now = hyper_of(slot, 1.0, self.seed)
            except ValueError as error:  # an invalid value: this step is done; the next one refuses it too
                changes.append(str(error))
                continue
            changes += [f"{key} {getattr(used, key)!r} -> {getattr(now, key)!r} (the param group of {slot.label})"
                        for key in _COMPARED if getattr(used, key) != getattr(now, key)]
        if not changes:
            return None
        return (f"hyper-parameters changed between backward() and step(): {'; '.join(changes)}. The updates "
                f"of host- or mapped-placed state start during backward, as the gradients arrive (without "
                f"max_grad_norm), so this step ran with the earlier values and the next uses the new ones. "
                f"Change param_groups before backward() or after step(), as torch's LR schedulers do")
