"""OffloadAdamW: a torch optimizer whose state lives wherever the engine put it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["OffloadAdamW"]


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments outside the model's memory.

    Construct it directly or let ``wrap()`` convert a ``torch.optim.AdamW`` /
    ``Adam``; either way ``wrap()`` attaches the engine that owns the state.
    ``param_groups`` stay editable (schedulers work): each update reads its
    group's hyper-parameters when its gradient arrives. ``state_dict()`` is in
    ``torch.optim.AdamW``'s format plus ``master_param`` (fp32) per parameter.

    ``mode`` (``"cpu"``, ``"gpu"``, ``"auto"``), ``max_grad_norm``, ``accumulation_steps`` and
    ``moment_dtype`` are the engine settings ``wrap()`` uses for this optimizer unless its own
    options say otherwise.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 mode: str | None = None, max_grad_norm: float | None = None,
                 accumulation_steps: int | None = None, moment_dtype: str | torch.dtype | None = None):
        if not lr >= 0.0:
            raise ValueError(f"lr={lr!r} is not valid; use a number >= 0")
        if not eps >= 0.0:
            raise ValueError(f"eps={eps!r} is not valid; use a number >= 0")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas={betas!r} is not valid; use two numbers in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay={weight_decay!r} is not valid; use a number >= 0")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults)
        self._session = None  # set by wrap()
        # Engine settings given here are wrap()'s defaults for this optimizer (wrap() validates them).
        given = {"optimizer_mode": mode, "max_grad_norm": max_grad_norm,
                 "accumulation_steps": accumulation_steps, "moment_dtype": moment_dtype}
        self.wrap_options = {k: v for k, v in given.items() if v is not None}

    def _engine_or_raise(self):
        if self._session is None:
            raise RuntimeError("this OffloadAdamW is not attached to a model; call trainstream.wrap(model, optimizer) first")
        return self._session

    @torch.no_grad()
    def step(self, closure=None):
        """Queues the updates whose gradients have arrived; returns without waiting for them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine_or_raise().optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients already left the GPU; this drops any that wait for a step that never came."""
        session = self._session
        if session is not None:
            session.engine.discard_arrived()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        session = self._engine_or_raise()
        session.synchronize()
        state = {}
        for slot in session.engine.slots:
            shape = slot.param.shape
            state[slot.index] = {
                "step": torch.tensor(float(slot.step)),
                "exp_avg": slot.exp_avg.detach().to("cpu", copy=True).view(shape),
                "exp_avg_sq": slot.exp_avg_sq.detach().to("cpu", copy=True).view(shape),
                "master_param": slot.master.detach().to("cpu", copy=True).view(shape),
            }
        groups = []
        index = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict from OffloadAdamW or torch.optim.AdamW (fp32 masters then come
        from the current weights). The weights are rewritten from the masters."""
        session = self._engine_or_raise()
        groups = state_dict.get("param_groups")
        if groups is None or len(groups) != len(self.param_groups):
            raise ValueError("state_dict has a different number of param groups than this optimizer")
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError("state_dict's param groups hold different numbers of parameters")
        session.synchronize()
        by_index = {s.index: s for s in session.engine.slots}
        saved = state_dict.get("state", {})
        for key, value in saved.items():
            slot = by_index.get(int(key))
            if slot is None:
                raise ValueError(f"state_dict has state for parameter {key}, which this optimizer does not train")
            for name in ("exp_avg", "exp_avg_sq"):
                if value[name].numel() != slot.numel:
                    raise ValueError(f"state_dict's {name} for parameter {key} has {value[name].numel()} values, "
                                     f"the parameter has {slot.numel}")
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v
        for key, value in saved.items():
            slot = by_index[int(key)]
            slot.step = int(float(value["step"]))
            slot.exp_avg.copy_(value["exp_avg"].reshape(-1))
            slot.exp_avg_sq.copy_(value["exp_avg_sq"].reshape(-1))
            master = value.get("master_param")
            slot.master.copy_((master if master is not None else slot.param.detach()).reshape(-1))
            slot.param.data.copy_(slot.master.view(slot.param.shape))
        session.synchronize()
