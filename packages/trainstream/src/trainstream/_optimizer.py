"""OffloadAdamW: a torch optimizer whose state lives in host memory, on its own or run by the engine."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch

from ._options import _MAX_INT32
from ._standalone import HostSteps
from .engine import SlotState, interrupts, transfer_stats

__all__ = ["OffloadAdamW"]

_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize")


def check_hyper(values: dict, where: str) -> None:
    """ValueError naming `where` and the valid range for any bad AdamW hyper-parameter in `values`."""
    for key in ("lr", "eps", "weight_decay"):
        if key in values:
            v = values[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{where}{key}={v!r} is not valid; use a finite number >= 0")
    if "betas" in values:
        b = values["betas"]
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x < 1.0 for x in b)):
            raise ValueError(f"{where}betas={b!r} is not valid; use two numbers in [0, 1)")
    if "maximize" in values and not isinstance(values["maximize"], bool):
        raise ValueError(f"{where}maximize={values['maximize']!r} is not valid; use True or False")
    if values.get("amsgrad"):
        raise ValueError(f"{where}amsgrad=True is not supported by OffloadAdamW; use amsgrad=False")


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory.

    On its own it is a complete ``torch.optim.Optimizer``: ``step()`` copies the gradients to host
    memory, runs AdamW on host threads (ts-adamw) and writes the new weights back on the current
    stream; ``state_dict()`` is ``torch.optim.AdamW``'s format plus ``master_param`` (fp32) per
    parameter; schedulers, ``add_param_group`` and any trainer's ``optimizers=`` work.
    ``attach(model)`` (or ``trainstream.wrap(model, optimizer)``) adds the engine: gradients then
    stream to host memory during backward and updates overlap it. ``unwrap()`` detaches it again,
    leaving the state in ``.state``; either way training continues from the same state.

    ``mode`` (``"cpu"``, ``"gpu"``, ``"auto"``: ``wrap()``'s ``optimizer_mode``), ``max_grad_norm``,
    ``accumulation_steps`` and ``moment_dtype`` are the engine settings ``wrap()`` uses for this optimizer
    unless its own options say otherwise; ``config`` (a ``trainstream.OptimizerConfig``) gives any of the
    optimizer group's settings at once (the keywords above win over it). Without a model attached, updates run on host threads whatever ``mode``
    says, ``max_grad_norm`` clips at ``step()``, gradients accumulate in ``.grad`` as torch's do
    (``accumulation_steps`` is for the engine), and ``moment_dtype="bfloat16"`` keeps bf16 moments
    (``"auto"``: float32).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 mode: str | None = None, max_grad_norm: float | None = None,
                 accumulation_steps: int | None = None, moment_dtype: str | torch.dtype | None = None,
                 config=None):
        check_hyper({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}, "")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        self._session = None  # set by wrap()
        self._host = HostSteps()
        # Engine settings given here are wrap()'s defaults for this optimizer, checked now.
        given = {"optimizer_mode": mode, "max_grad_norm": max_grad_norm,
                 "accumulation_steps": accumulation_steps, "moment_dtype": moment_dtype}
        self.wrap_options = {**_config_settings(config, lr), **{k: v for k, v in given.items() if v is not None}}
        _check_engine_settings(self.wrap_options)
        super().__init__(params, defaults)

    # copy.deepcopy / pickle: the settings travel, the engine does not (a copy is never attached).
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["wrap_options"] = dict(getattr(self, "wrap_options", {}))
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        wrap_options = state.pop("wrap_options", {})
        super().__setstate__(state)
        self.wrap_options = wrap_options
        self._session = None
        self._host = HostSteps()

    @property
    def attached(self) -> bool:
        """True while a model's engine runs this optimizer's updates (after attach() / wrap())."""
        return self._session is not None

    def _steps(self) -> HostSteps:
        host = getattr(self, "_host", None)  # absent after copy.deepcopy / pickling
        if host is None:
            host = self._host = HostSteps()
        return host

    def attach(self, model: torch.nn.Module, **options) -> torch.nn.Module:
        """Adds the streaming engine for ``model`` (``trainstream.wrap(model, self, **options)``),
        continuing from the state built so far; returns the model."""
        from . import wrap  # the package's entry point (trainstream._wrap imports this module)

        if self._session is not None:
            raise ValueError("this OffloadAdamW is already attached to a model; trainstream.unwrap(model) first")
        self._steps().synchronize()
        model, _ = wrap(model, self, **options)
        self._steps().forget()
        return model

    def synchronize(self) -> None:
        """Waits until every update is applied and every new weight is in place."""
        if self._session is not None:
            self._session.synchronize()
        else:
            self._steps().synchronize()

    def stats(self) -> dict:
        """Counters for logging: ``attached``, ``steps``, ``step_seconds`` (inside ``step()``),
        ``host_update_seconds`` (host AdamW; None while attached until the engine reports it),
        ``d2h_bytes`` / ``h2d_bytes`` moved (while attached: the device's TrainStream streams),
        ``last_grad_norm`` and ``placement`` (values whose state is on ``host``, ``device``, ``mapped``)."""
        host = self._steps()
        out = host.stats()
        out["attached"] = self._session is not None
        out["step_seconds"] = host.step_seconds + getattr(self, "_attached_seconds", 0.0)
        if self._session is None:
            values = sum(p.numel() for p in self.state if self.state[p])
            out["placement"] = {"host": values} if values else {}
            return out
        session = self._session
        out["steps"] = host.steps + session.steps
        engine_seconds = getattr(session.engine.host, "busy_seconds", None)
        out["host_update_seconds"] = None if engine_seconds is None else host.host_seconds + engine_seconds
        moved = transfer_stats(session.device)
        out["d2h_bytes"] = host.d2h_bytes + moved["d2h_bytes"]
        out["h2d_bytes"] = host.h2d_bytes + moved["h2d_bytes"]
        out["last_grad_norm"] = session.engine.last_grad_norm
        placement: dict[str, int] = {}
        for slot in session.engine.active:
            placement[slot.placement] = placement.get(slot.placement, 0) + slot.numel
        out["placement"] = placement
        return out

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_session", None) is not None:
            raise RuntimeError("add_param_group() after wrap() is not supported: trainstream.unwrap(model), add the "
                               "group, then wrap(model, optimizer) again (the state of the other groups is kept)")
        check_hyper(param_group, f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)

    def step(self, closure=None):
        """Attached: queues the updates whose gradients have arrived (see guard_params for what it
        waits for). On its own: one host AdamW step over every parameter with a gradient.
        No torch.no_grad() around the attached path: the engine touches no tensor autograd tracks,
        and a Ctrl-C inside torch's context manager could leave gradients off for the rest of the program."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        session = self._session
        if session is None:
            self._steps().step(self, check_hyper)
            return loss
        started = time.perf_counter()
        session.optimizer_step()
        self._attached_seconds = getattr(self, "_attached_seconds", 0.0) + time.perf_counter() - started
        return loss

    def train(self) -> None:
        """transformers.Trainer calls this (through Accelerate) at each training step. While attached, the
        check wrap() installed for the training loop runs here (``_loop_check``: the Hugging Face
        integration's refuses a Trainer whose clipping or accumulation the engine would not honour, the
        Trainer's own clipping seeing no gradients); the optimizer itself knows no training loop."""
        check = getattr(self, "_loop_check", None) if self._session is not None else None
        if check is not None:
            check(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Attached: gradients already left the GPU; this drops any that wait for a step that never came.
        ``set_to_none=False`` zeroes in place the gradients still in ``.grad`` (accumulating, or held for
        the norm) and leaves ``None`` where there is none, as torch's does: one taken by the engine is gone.
        On its own: as torch's."""
        session = self._session
        if session is None:
            super().zero_grad(set_to_none)
            return
        params = [p for group in self.param_groups for p in group["params"]]
        held = {} if set_to_none is not False else {id(p): p.grad for p in params if p.grad is not None}
        session.engine.discard()
        with torch.no_grad():
            for p in params:
                grad = held.get(id(p))
                p.grad = None if grad is None else grad.zero_()
            if session.shards is not None:  # FSDP2's sharded gradients not handed over yet
                session.shards.zero_grad(set_to_none is not False)

    def state_dict(self) -> dict:
        session = self._session
        if session is None:
            self._steps().synchronize()
            return super().state_dict()
        session.synchronize()
        state = {}
        for slot in session.engine.active:
            if slot.weight_changed():
                slot.follow_weight()  # a weight edited since the last update is what training continues from
            state[slot.index] = slot.export()
        if session.engine.step_hook is not None:
            state = session.engine.step_hook.gather_state(state)  # data parallel: collective, the full state
        groups = []
        index = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict from OffloadAdamW or torch.optim.AdamW (fp32 masters then come from the
        current weights); the weights are rewritten from the masters. Everything is checked first:
        on any error nothing has changed."""
        session = self._session
        if session is None:
            self._steps().load(self, state_dict, _validated)
            return
        groups, entries = _validated(self, state_dict, {s.index: s for s in session.engine.slots})
        # Data parallel: every rank loads the same full state and keeps its own share.
        self._load_attached(groups, entries, [slot for slot, _ in entries])

    def shared_loader(self, share: dict, loaded: list[int]):
        """For ``trainstream.distributed.load_checkpoint``: checks `share` (this rank's part of a state dict:
        its param groups and the entries it will own) as ``load_state_dict`` checks a whole one, and returns
        the function that applies it; `loaded` holds the index of every parameter with state on any rank."""
        slots = {s.index: s for s in self._session.engine.slots}
        groups, entries = _validated(self, share, slots)
        return lambda: self._load_attached(groups, entries, [slots[i] for i in loaded])

    def _load_attached(self, groups: list, entries: list, loaded: list) -> None:
        """Applies validated state while attached: `entries` the (slot, entry) pairs this rank may hold (under data
        parallel its owned ones are kept), `loaded` every slot with state on any rank, the same list on every
        rank (their owners share the weights they rewrote: collective)."""
        session = self._session
        shared = session.engine.step_hook
        if shared is not None:
            entries = [(slot, entry) for slot, entry in entries if slot.owned]
        session.synchronize()
        if session.weights is not None:
            session.weights.evict_all()  # streamed weights are written to their host copies: no stale device copy
        for slot in [slot for slot, _ in entries if slot.state is SlotState.DORMANT]:
            session.engine.activate(slot)  # state for a parameter frozen at wrap(): it trains from it
        session.engine.discard()  # gradients held for the old state's step do not carry over
        with torch.no_grad(), interrupts.critical():
            for mine, theirs in zip(self.param_groups, groups):
                for k, v in theirs.items():
                    if k != "params":
                        mine[k] = tuple(v) if k == "betas" else v
            for slot, (step, exp_avg, exp_avg_sq, master) in entries:
                slot.load(step, exp_avg, exp_avg_sq, master)
        session.synchronize()
        if shared is not None:
            shared.share_weights(sorted(loaded, key=lambda s: s.index))  # the owners rewrote them from masters


def _config_settings(config, lr: float) -> dict:
    """The engine settings an ``OptimizerConfig`` (``config=``) gives: the fields it changes from their defaults.
    Its ``lr`` is the optimizer's own argument here, so a different one is refused rather than ignored."""
    if config is None:
        return {}
    from ._config import OptimizerConfig  # at call time, as _check_engine_settings

    if not isinstance(config, OptimizerConfig):
        raise ValueError(f"OffloadAdamW(config=...) takes a trainstream.OptimizerConfig, not {type(config).__name__}")
    settings = {f: getattr(config, f) for f in config.__dataclass_fields__}
    defaults = OptimizerConfig()
    if settings.pop("lr") not in (defaults.lr, lr):
        raise ValueError(f"OffloadAdamW: config.lr={config.lr!r} differs from lr={lr!r}; the learning rate is "
                         f"OffloadAdamW's lr argument")
    return {k: v for k, v in settings.items() if v != getattr(defaults, k)}


def _check_engine_settings(settings: dict) -> None:
    """ValueError, at construction, for an engine setting wrap() would refuse (``mode`` is wrap()'s
    ``optimizer_mode``)."""
    from ._options import parse_options  # at call time: _options imports memory/, which imports the engine

    try:
        parse_options(dict(settings))
    except ValueError as error:
        raise ValueError(f"OffloadAdamW: {error}" + (" (the mode= argument)" if "optimizer_mode=" in str(error) else "")) \
            from None


def _validated(optimizer: OffloadAdamW, state_dict: dict, by_index: dict) -> tuple[list, list]:
    """(groups, [(slot, (step, exp_avg, exp_avg_sq, master or None))]) or ValueError; reads only."""
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
        raise ValueError("state_dict needs 'param_groups' (and 'state'), as optimizer.state_dict() returns")
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer {len(optimizer.param_groups)}")
    for number, (mine, theirs) in enumerate(zip(optimizer.param_groups, groups)):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError(f"param group {number} holds {len(theirs['params'])} parameters in state_dict, "
                             f"{len(mine['params'])} here")
        check_hyper(theirs, f"state_dict param group {number}: ")
    entries = []
    for key, value in state_dict.get("state", {}).items():
        slot = by_index.get(int(key))
        if slot is None:
            raise ValueError(f"state_dict has state for parameter {key}, which this optimizer does not train")
        entries.append((slot, _checked_entry(slot, key, value)))
    return groups, entries


def _checked_entry(slot, key, value: dict) -> tuple:
    where = f"state_dict's state for parameter {key}"
    missing = [name for name in ("step", "exp_avg", "exp_avg_sq") if name not in value]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    step = value["step"]
    step = float(step.item() if isinstance(step, torch.Tensor) else step)
    if not (math.isfinite(step) and 0 <= step < _MAX_INT32 and step == int(step)):  # the cores count in int32
        raise ValueError(f"{where}: step={step!r} is not valid; use a whole number in [0, 2**31 - 1)")
    tensors = []
    for name in ("exp_avg", "exp_avg_sq", "master_param"):
        t = value.get(name)
        if t is None and name == "master_param":
            tensors.append(None)
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{where}: {name} must be a floating-point tensor, not {type(t).__name__}"
                             + (f" of {t.dtype}" if isinstance(t, torch.Tensor) else ""))
        if t.numel() not in (slot.param.numel(), slot.numel):  # whole, or (a split parameter) this rank's piece
            raise ValueError(f"{where}: {name} has {t.numel()} values, {slot.label} has {slot.param.numel()}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} holds non-finite values")
        tensors.append(t)
    if bool((tensors[1] < 0).any()):
        raise ValueError(f"{where}: exp_avg_sq has negative values")
    return (int(step), *tensors)
