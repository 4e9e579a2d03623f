"""wrap() and unwrap(): the user's entry points."""

from __future__ import annotations

import torch

from ._convert import to_offload_adamw
from ._optimizer import OffloadAdamW
from ._options import parse_options
from ._plan import vram_budget
from ._quantize import choose_quantize, quantize_model
from ._session import TrainStreamSession

__all__ = ["unwrap", "wrap"]


def _training_device(model: torch.nn.Module, requested: torch.device | None) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if requested is not None:
        if requested.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(requested)!r} was requested but CUDA is not available "
                             f"(torch {torch.__version__}); use device='cpu' or install a CUDA build of torch")
        return requested
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
                         "move it to one, or pass device=")
    return next(iter(devices)) if devices else torch.device("cpu")


def wrap(model: torch.nn.Module, optimizer=None, **options):
    """Trains ``model`` with its optimizer state in host memory; returns ``(model, optimizer)``.

    ``optimizer``: ``torch.optim.AdamW`` / ``Adam`` (converted, state migrated), a
    ``trainstream.OffloadAdamW``, or ``None`` (one is made with ``lr=``). Options are
    validated up front; see the README for each one.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"wrap() takes a torch.nn.Module, not {type(model).__name__}")
    if getattr(model, "_trainstream_session", None) is not None:
        raise ValueError("this model is already wrapped; call trainstream.unwrap(model) first")
    if isinstance(optimizer, OffloadAdamW):
        options = {**optimizer.wrap_options, **options}
    opts = parse_options(options)
    device = _training_device(model, opts.device)
    # Quantize where the weights are, before the move: a base too large for the GPU in bf16 moves as codes.
    fmt, why = _quantize_decision(model, device, opts)
    quantized = quantize_model(model, fmt) if fmt else None
    if any(p.device != device for p in model.parameters()) or quantized:
        model.to(device)  # keeps the Parameter objects, so the optimizer still refers to them
    converted = to_offload_adamw(optimizer, model, opts.lr)
    session = TrainStreamSession(model, converted, opts, device)
    if why:
        session.events.add("quantize", why)
    if quantized:
        session.quantized = {"quantize": fmt, **quantized}
        session.events.add("quantize", f"{quantized['tensors']} frozen linear weights of the blocks stored as "
                                       f"{fmt}: {quantized['bytes_before'] / 2**30:.2f} GiB -> "
                                       f"{quantized['bytes_after'] / 2**30:.2f} GiB")
    migrated = getattr(converted, "_migrated_state", None)
    if migrated:
        _migrate_state(session, migrated)
        session.events.add("optimizer", f"migrated existing AdamW state of {len(migrated)} parameters")
    converted._session = session
    model._trainstream_session = session
    return model, converted


def _quantize_decision(model: torch.nn.Module, device: torch.device, opts) -> tuple[str | None, str | None]:
    """(format or None, why) for wrap()'s quantize option; "auto" measures the weights against the VRAM."""
    if opts.quantize != "auto":
        return opts.quantize, None
    if device.type != "cuda":
        return None, "auto: training on the CPU, no VRAM to fit; weights stay as they are"
    fmt, why = choose_quantize(model, vram_budget(device, opts.vram_headroom))
    return fmt, f"auto: {why}"


def _migrate_state(session: TrainStreamSession, migrated: dict) -> None:
    for slot in session.engine.slots:
        state = migrated.get(id(slot.param))
        if not state:
            continue
        slot.step = int(float(state.get("step", 0)))
        slot.exp_avg.copy_(state["exp_avg"].reshape(-1))
        slot.exp_avg_sq.copy_(state["exp_avg_sq"].reshape(-1))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Waits for every update, removes TrainStream's hooks and returns the plain model.
    The optimizer it returned is detached and must not be stepped again."""
    session: TrainStreamSession | None = getattr(model, "_trainstream_session", None)
    if session is None:
        raise ValueError("this model is not wrapped by trainstream")
    session.close()
    if isinstance(session.optimizer, OffloadAdamW):
        session.optimizer._session = None
    del model._trainstream_session
    return model
