"""ts_adamw.AdamW: a drop-in torch.optim.AdamW for CPU parameters on the host engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _core
from ._args import bump_versions, scalar, thread_count

__all__ = ["AdamW"]

_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_KEYS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None}


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    lr, eps, weight_decay = scalar(lr, "lr"), scalar(eps, "eps"), scalar(weight_decay, "weight_decay")
    if not lr >= 0:
        raise ValueError(f"Invalid learning rate: lr={lr} must be >= 0")
    if not eps >= 0:
        raise ValueError(f"Invalid epsilon value: eps={eps} must be >= 0")
    if not weight_decay >= 0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} must be >= 0")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas={betas!r} must be a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        b = scalar(b, f"betas[{i}]")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b} must be in [0, 1)")


def _check_group(group: dict) -> None:
    if group.get("amsgrad", False):
        raise ValueError("ts_adamw.AdamW does not implement amsgrad; use torch.optim.AdamW for it")
    for flag in ("capturable", "differentiable"):
        if group.get(flag, False):
            raise ValueError(f"ts_adamw.AdamW does not support {flag}=True (it updates host tensors in place)")
    if group.get("decoupled_weight_decay", True) is False:
        raise ValueError("ts_adamw.AdamW always decouples weight decay; decoupled_weight_decay=False is Adam")
    _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])


class AdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` for CPU fp32 parameters, run by the threaded SIMD host engine.

    Same update (within fp32 rounding), same ``state_dict`` format (``step``, ``exp_avg``, ``exp_avg_sq``
    per parameter), so it loads a ``torch.optim.AdamW`` state and schedulers edit ``lr`` as usual.
    ``moment_dtype=torch.bfloat16`` keeps both moments in bf16 with seeded stochastic rounding (half the
    state memory); ``threads`` caps the host threads (None: all physical cores). One native call per
    parameter group and step count. amsgrad, capturable and differentiable raise ValueError; ``foreach`` and
    ``fused`` are accepted and ignored.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, moment_dtype: torch.dtype = torch.float32,
                 threads: int | None = None, maximize: bool = False, amsgrad: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, seed: int = 0) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        if moment_dtype not in _MOMENT_DTYPES:
            raise ValueError(f"moment_dtype={moment_dtype} is not supported; use torch.float32 or torch.bfloat16")
        self.threads = thread_count(threads) or None
        self.moment_dtype = moment_dtype
        self.seed = int(seed)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable, "fused": fused}
        _check_group(defaults)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in _TORCH_KEYS.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state from this class or from ``torch.optim.AdamW``; moments become ``moment_dtype``.

        The tensors are copied, so the source (e.g. a live optimizer's ``state_dict()``) is never aliased.
        """
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(dtype=self.moment_dtype, memory_format=torch.contiguous_format,
                                               copy=True)
            if "step" in state:
                step = state["step"]
                step = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
                state["step"] = torch.tensor(step, dtype=torch.float32)
            state.pop("max_exp_avg_sq", None)

    def _collect(self, group: dict, first_slot: int) -> dict[int, list]:
        """Validates the group's parameters with gradients; buckets them by their next step count."""
        buckets: dict[int, list] = {}
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"ts_adamw.AdamW updates CPU float32 parameters; got {p.dtype} on {p.device}")
            if not p.is_contiguous():
                raise ValueError("ts_adamw.AdamW needs contiguous parameters; call .contiguous() on them")
            grad = p.grad
            if grad.is_sparse:
                raise ValueError("ts_adamw.AdamW does not support sparse gradients")
            if grad.dtype not in _GRAD_DTYPES or grad.device.type != "cpu" or grad.numel() != p.numel():
                raise ValueError(f"gradient of a {tuple(p.shape)} parameter is {grad.dtype} {tuple(grad.shape)} "
                                 f"on {grad.device}; it must be a CPU float32/bfloat16/float16 tensor of equal size")
            state = self.state.get(p, {})  # .get: a failed step must not even add empty entries
            step = int(state["step"].item()) + 1 if "step" in state else 1
            buckets.setdefault(step, []).append((p, grad.detach().contiguous(), first_slot + index))
        return buckets

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros(p.shape, dtype=self.moment_dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step over every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans, slot = [], 0
        for group in self.param_groups:  # validate everything before touching any state
            _check_group(group)
            plans.append((group, self._collect(group, slot)))
            slot += len(group["params"])
        for group, buckets in plans:
            beta1, beta2 = group["betas"]
            for step, items in buckets.items():
                states = [self.state[p] for p, _, _ in items]
                for (p, _, _), state in zip(items, states):
                    self._init_state(p, state)
                _core.step([p.detach() for p, _, _ in items], [g for _, g, _ in items],
                           [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                           [], [k & 0xFFFFFFFF for _, _, k in items], scalar(group["lr"], "lr"),
                           scalar(beta1, "beta1"), scalar(beta2, "beta2"), scalar(group["eps"], "eps"),
                           scalar(group["weight_decay"], "weight_decay"), step, bool(group["maximize"]), 1.0,
                           self.seed & 0xFFFFFFFFFFFFFFFF, self.threads or 0)
                bump_versions([p for p, _, _ in items] + [s[k] for s in states for k in ("exp_avg", "exp_avg_sq")])
                for state in states:
                    state["step"].fill_(float(step))
        return loss
