"""OffloadAdamW without a model attached: a plain torch optimizer whose AdamW runs on host threads.

At ``step()`` every gradient is copied to host memory (page-locked for a CUDA parameter), the
fp32 master weights and the moments are updated by ts-adamw's host engine, each as soon as its own
gradient has landed while later ones still cross, and the rounded weights go back on the caller's
current stream, so any later GPU work reads the new values without a host wait. The state lives in ``optimizer.state``
in ``torch.optim.AdamW``'s format plus ``master_param`` (fp32), which is what ``wrap()`` /
``attach()`` continue from and what ``unwrap()`` leaves behind. No hooks, no threads: the
streaming during backward comes with ``attach(model)``.
"""

from __future__ import annotations

import math
import time

import torch
import ts_adamw
import ts_pinned

from .engine.slots import dense_layout_problem, flat, grad_in_memory_order, shaped

__all__ = ["HostSteps", "moment_dtype_of"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BF16_NAMES = ("bfloat16", "bf16")


def moment_dtype_of(value) -> torch.dtype:
    """The moment dtype a standalone step uses for OffloadAdamW's ``moment_dtype`` (auto: float32)."""
    if value is torch.bfloat16 or value in _BF16_NAMES:
        return torch.bfloat16
    return torch.float32


class _Param:
    """What load-state validation needs to name and size a parameter (the engine's slots have the same)."""

    def __init__(self, index: int, param: torch.Tensor):
        self.index = index
        self.param = param
        self.numel = param.numel()
        self.label = f"parameter {index}"


class HostSteps:
    """The buffers and counters of standalone steps: page-locked staging per CUDA parameter, the
    uploads not yet known complete, and where each weight was last written (user edits are
    detected as in the engine: a changed version counter or storage means the master follows)."""

    def __init__(self) -> None:
        self.grad_host: dict[torch.Tensor, torch.Tensor] = {}
        self.out_host: dict[torch.Tensor, torch.Tensor] = {}
        self.seen: dict[torch.Tensor, tuple[int, int]] = {}
        self.uploads: list[torch.cuda.Event] = []
        self.steps = 0
        self.host_seconds = 0.0  # inside the host AdamW calls
        self.step_seconds = 0.0  # inside step(), copies and waits included
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self.last_grad_norm: float | None = None

    # ---- ordering -------------------------------------------------------------------

    def synchronize(self) -> None:
        """Waits until every weight written by a step has landed on its device."""
        for event in self.uploads:
            event.synchronize()
        self.uploads = []

    def forget(self) -> None:
        """Drops the staging buffers (attach() hands the state to the engine)."""
        self.synchronize()
        self.grad_host.clear()
        self.out_host.clear()
        self.seen.clear()

    # ---- one step ---------------------------------------------------------------------

    def step(self, optimizer, check_hyper) -> None:
        started = time.perf_counter()
        items = self._collect(optimizer, check_hyper)
        if not items:
            return
        moment = moment_dtype_of(optimizer.wrap_options.get("moment_dtype"))
        self.synchronize()  # the previous uploads read buffers this step rewrites
        grads, landed = self._gradients_to_host(items)
        for _, p, _, _ in items:
            self._ensure_state(optimizer.state[p], p, moment)
        scale = 1.0
        max_norm = optimizer.wrap_options.get("max_grad_norm")
        if max_norm is not None:
            for event in landed:
                if event is not None:
                    event.synchronize()
            norm = math.sqrt(ts_adamw.sum_of_squares(grads))
            self.last_grad_norm = norm
            scale = min(1.0, max_norm / (norm + 1e-6))  # clip_grad_norm_'s coefficient
        with torch.no_grad():
            # Each update starts once its own gradient has landed: later copies overlap the host work.
            for (index, p, group, _), grad, event in zip(items, grads, landed):
                if event is not None:
                    event.synchronize()
                t0 = time.perf_counter()
                self._update(optimizer.state[p], p, grad, group, scale, index)
                self.host_seconds += time.perf_counter() - t0
                self._upload(optimizer.state[p], p)
        for device in {p.device for _, p, _, _ in items if p.device.type == "cuda"}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.uploads.append(event)
        self.steps += 1
        self.step_seconds += time.perf_counter() - started

    def _collect(self, optimizer, check_hyper) -> list:
        """(index, param, group, grad) for every parameter with a gradient; everything checked before
        any state changes."""
        items, index = [], 0
        for number, group in enumerate(optimizer.param_groups):
            check_hyper(group, f"param group {number}: ")
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    where = f"parameter {index} (param group {number}, shape {tuple(p.shape)})"
                    if p.device.type not in ("cpu", "cuda"):
                        raise ValueError(f"{where} is on {p.device}; OffloadAdamW trains CPU and CUDA parameters")
                    if not p.is_floating_point() or p.dtype not in _GRAD_DTYPES:
                        raise ValueError(f"{where} is {p.dtype}; OffloadAdamW trains float32, bfloat16 and "
                                         f"float16 parameters")
                    problem = dense_layout_problem(p)
                    if problem:
                        raise ValueError(f"{where} cannot be trained: {problem}. Make it dense "
                                         f"(param.data = param.data.contiguous())")
                    if grad.is_sparse or grad.layout != torch.strided:
                        raise ValueError(f"{where} has a {grad.layout} gradient; OffloadAdamW trains dense "
                                         f"gradients only (use sparse=False in the embedding)")
                    if grad.shape != p.shape or grad.device != p.device or grad.dtype not in _GRAD_DTYPES:
                        raise ValueError(f"{where} has a {grad.dtype} gradient of shape {tuple(grad.shape)} on "
                                         f"{grad.device}; it must be a float32/bfloat16/float16 tensor shaped and "
                                         f"placed like the parameter")
                    items.append((index, p, group, grad))
                index += 1
        return items

    def _gradients_to_host(self, items: list) -> tuple[list[torch.Tensor], list]:
        """Flat host gradients in each parameter's memory order, and for each CUDA one the event after
        which it has landed (None for CPU parameters)."""
        out, landed = [], []
        for _, p, _, grad in items:
            src = grad_in_memory_order(grad.detach(), p)
            if p.device.type == "cpu":
                out.append(src)
                landed.append(None)
                continue
            buffer = self.grad_host.get(p)
            if buffer is None or buffer.dtype != grad.dtype:
                buffer = ts_pinned.empty(p.numel(), grad.dtype, tag="grads", allow_pageable=True)
                self.grad_host[p] = buffer
            stream = torch.cuda.current_stream(p.device)
            with torch.cuda.device(p.device):
                buffer.copy_(src, non_blocking=True)  # on the current stream: after the backward that made it
            event = torch.cuda.Event()
            event.record(stream)
            self.d2h_bytes += src.numel() * src.element_size()
            out.append(buffer)
            landed.append(event)
        return out, landed

    def _ensure_state(self, state: dict, p: torch.Tensor, moment: torch.dtype) -> None:
        """Creates the state from the weight, or brings loaded / migrated state to the layout the host
        engine reads (CPU, the parameter's memory order, both moments fp32 or both bf16)."""
        on_cuda = p.device.type == "cuda"
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        if "exp_avg" in state and "exp_avg_sq" in state:
            kept = state["exp_avg"].dtype
            moment = kept if kept in (torch.float32, torch.bfloat16) and state["exp_avg_sq"].dtype == kept else moment
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = shaped(torch.zeros(p.numel(), dtype=moment), p)
            else:
                state[key] = _host_like(state[key], p, moment, pinned=False)
        if "master_param" not in state or (p not in self.seen and not _rounds_to(state["master_param"], p)):
            state["master_param"] = _host_like(p.detach(), p, torch.float32, pinned=on_cuda, copy=True)
            self._note(p)
        else:
            state["master_param"] = _host_like(state["master_param"], p, torch.float32,
                                               pinned=on_cuda and p.dtype == torch.float32)
        if p not in self.seen:
            self._note(p)

    def _update(self, state: dict, p: torch.Tensor, grad: torch.Tensor, group: dict, scale: float,
                index: int) -> None:
        master = flat(state["master_param"])
        if _changed(self.seen.get(p), p):  # the weight was written by someone else: training continues from it
            master.copy_(flat(p.detach()))
        if p.device.type == "cpu":
            out = flat(p.data)  # the host step writes the weight itself
        else:
            out = master if p.dtype == torch.float32 else self._out_buffer(p)  # fp32 uploads from the master
        beta1, beta2 = group["betas"]
        step = int(float(state["step"])) + 1
        ts_adamw.adamw_step(master, grad, flat(state["exp_avg"]), flat(state["exp_avg_sq"]),
                            param_out=None if out is master else out, lr=float(group["lr"]),
                            beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                            weight_decay=float(group["weight_decay"]), step=step,
                            maximize=bool(group.get("maximize", False)), grad_scale=scale,
                            seed=index & 0xFFFFFFFF)
        state["step"] = torch.tensor(float(step))

    def _out_buffer(self, p: torch.Tensor) -> torch.Tensor:
        buffer = self.out_host.get(p)
        if buffer is None:
            buffer = ts_pinned.empty(p.numel(), p.dtype, tag="weights", allow_pageable=True)
            self.out_host[p] = buffer
        return buffer

    def _upload(self, state: dict, p: torch.Tensor) -> None:
        """The new weight into the parameter: on the current stream for CUDA (later kernels see it)."""
        if p.device.type == "cuda":
            src = flat(state["master_param"]) if p.dtype == torch.float32 else self.out_host[p]
            flat(p.data).copy_(src, non_blocking=True)
            self.h2d_bytes += src.numel() * src.element_size()
        # CPU parameters: written by the host step itself (param_out), below torch's version counter.
        self._note(p)

    def _note(self, p: torch.Tensor) -> None:
        self.seen[p] = (p._version, p.data_ptr())

    def load(self, optimizer, state_dict: dict, validated) -> None:
        """load_state_dict without a model attached: all checked first, then the state and the group
        hyper-parameters replaced and every weight rewritten from its master (or the master taken
        from the weight when the dict has none, as from torch.optim.AdamW)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        by_index = {i: _Param(i, p) for i, p in enumerate(params)}
        groups, entries = validated(optimizer, state_dict, by_index)
        self.synchronize()
        moment = moment_dtype_of(optimizer.wrap_options.get("moment_dtype"))
        with torch.no_grad():
            for mine, theirs in zip(optimizer.param_groups, groups):
                for k, v in theirs.items():
                    if k != "params":
                        mine[k] = tuple(v) if k == "betas" else v
            loaded = {}
            for ref, (step, exp_avg, exp_avg_sq, master) in entries:
                p = params[ref.index]
                dtype = exp_avg.dtype if exp_avg.dtype in (torch.float32, torch.bfloat16) and \
                    exp_avg_sq.dtype == exp_avg.dtype else moment
                state = {"step": torch.tensor(float(step)),
                         "exp_avg": _host_like(exp_avg.reshape(p.shape), p, dtype, pinned=False, copy=True),
                         "exp_avg_sq": _host_like(exp_avg_sq.reshape(p.shape), p, dtype, pinned=False, copy=True)}
                source = p.detach() if master is None else master.reshape(p.shape)
                state["master_param"] = _host_like(source, p, torch.float32, pinned=p.device.type == "cuda",
                                                   copy=True)
                loaded[p] = state
            optimizer.state.clear()
            for p, state in loaded.items():
                optimizer.state[p] = state
                flat(p.data).copy_(flat(state["master_param"]))
                self._note(p)
        for device in {p.device for p in loaded if p.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()

    def stats(self) -> dict:
        return {"steps": self.steps, "step_seconds": self.step_seconds, "host_update_seconds": self.host_seconds,
                "d2h_bytes": self.d2h_bytes, "h2d_bytes": self.h2d_bytes, "last_grad_norm": self.last_grad_norm}


def _host_like(t: torch.Tensor, p: torch.Tensor, dtype: torch.dtype, *, pinned: bool, copy: bool = False) -> torch.Tensor:
    """`t` as a CPU tensor of `dtype` with `p`'s shape and memory order (page-locked if asked); `t`
    itself when it already is one and no copy is asked for."""
    ok = (t.device.type == "cpu" and t.dtype == dtype and t.shape == p.shape and t.stride() == p.stride()
          and (not pinned or t.is_pinned()) and t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr())
    if ok and not copy:
        return t
    n = p.numel()
    buffer = ts_pinned.empty(n, dtype, tag="master", allow_pageable=True) if pinned else torch.empty(n, dtype=dtype)
    out = shaped(buffer, p)
    out.copy_(t.detach())
    return out


def _rounds_to(master: torch.Tensor, p: torch.Tensor) -> bool:
    """True while a saved master still rounds to the weight (else the weight was changed since)."""
    if master.shape != p.shape:
        return False
    return torch.equal(master.detach().to(device="cpu", dtype=p.dtype), p.detach().cpu())


def _changed(seen: tuple[int, int] | None, p: torch.Tensor) -> bool:
    return seen is not None and (p._version != seen[0] or p.data_ptr() != seen[1])
