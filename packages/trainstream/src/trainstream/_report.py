"""memory_report(): what lives where, and every decision with its reason."""

from __future__ import annotations

import torch
import ts_pinned

from ._units import fmt_bytes
from .distributed import report as distributed_report
from .engine import transfer_stats

__all__ = ["memory_report", "pinned_stats"]


def pinned_stats() -> dict:
    """Counters of the page-locked arena, with live bytes per tag in ``"by_tag"``."""
    return ts_pinned.pinned_stats()


def _gpu(device: torch.device | None) -> dict:
    if device is None or device.type != "cuda":
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
    }


def memory_report(model: torch.nn.Module | None = None) -> dict:
    """For a wrapped model: ``events``, ``gpu``, ``pinned``, ``pinned_by_tag``, ``transfers``,
    ``optimizer``, ``resident``, ``params``, ``activations``, ``attention``, ``plan`` (the plan made at
    wrap(): choices, predicted peak VRAM, host bytes, the lower bound and its terms, ``transitions``: the
    run-time adaptations of the plan since, ``target_vram``, ``settled``, ``history``: the plan and switch
    events) and ``stalls`` (the
    recent steps: seconds waited on the link, on the host optimizer, and on nothing); without one:
    ``gpu``, ``pinned`` and ``pinned_by_tag``."""
    pinned = pinned_stats()
    by_tag = pinned.pop("by_tag")
    session = getattr(model, "_trainstream_session", None) if model is not None else None
    if model is not None and session is None:
        raise ValueError("memory_report(model) needs a model returned by trainstream.wrap()")
    device = session.device if session else (torch.device("cuda", torch.cuda.current_device())
                                             if torch.cuda.is_available() else None)
    report = {"gpu": _gpu(device), "pinned": pinned, "pinned_by_tag": by_tag}
    if session is None:
        return report
    slots = session.engine.active
    placements: dict[str, dict[str, int]] = {}
    for slot in slots:
        entry = placements.setdefault(slot.placement, {"params": 0, "values": 0, "state_bytes": 0})
        entry["params"] += 1
        entry["values"] += slot.numel
        entry["state_bytes"] += slot.state_bytes()
    report.update({
        "events": session.events.lines(),
        "transfers": transfer_stats(session.device),
        "optimizer": {
            "mode": session.config.optimizer_mode,
            "moment_dtype": str(session.moment_dtype).removeprefix("torch."),
            "steps": session.steps,
            "host_updates": session.engine.host.updates,
            "host_calls": session.engine.host.calls,
            "placements": placements,
            "last_grad_norm": session.engine.last_grad_norm,
            "disk": None if session.engine.disk is None else session.engine.disk.report(),
        },
        "resident": all(s.placement == "device" for s in slots),
        "params": _quantized(session),
        "activations": session.activations.report(),
    })
    if session.host_embedding is not None:
        report["params"]["host_embedding"] = session.host_embedding.report()
    if session.weights is not None:
        stats = session.weights.stats()
        steps = max(session.steps, 1)
        streamed = set(stats["streamed_blocks"])
        report["params"].update({"paged_blocks": sorted(streamed),
                                 "resident_blocks": [i for i in range(len(session.weights.blocks)) if i not in streamed],
                                 "host_bytes": stats["host_bytes"],
                                 "link_bytes_per_s": stats["link_bytes_per_s"],
                                 "load_bytes": stats["link_bytes"] / steps, "bounce_bytes": stats["bounce_bytes"],
                                 "peer_bytes": stats.get("peer_bytes", 0),
                                 "peer_blocks": stats.get("peer_blocks", 0),
                                 "peer_owned_bytes": stats.get("peer_owned_bytes", 0),
                                 "shared_host_bytes": stats.get("shared_host_bytes", 0),
                                 "host_owner": stats.get("host_owner"), "streaming": stats})
    if session.attention is not None:
        report["attention"] = session.attention.report()
    if session.engine.step_hook is not None:
        report["distributed"] = distributed_report(session.engine)
    plan = getattr(session, "plan", None)  # the plan applied, adapted by each run-time transition since
    if plan is not None:
        plan = plan.to_dict()
        plan.update({"target_vram": (plan.get("budget") or {}).get("usable_vram_bytes"),
                     "settled": not session.adapting and bool(getattr(session.activations, "settled", True)),
                     "history": [str(e) for e in session.events if e.kind in ("plan", "switch")]})
    report["plan"] = plan
    clock = getattr(session, "stalls", None)
    report["stalls"] = clock.recent() if clock is not None else []
    return report


def _quantized(session) -> dict:
    """The params entry's quantization part: the format, what quantize_model did, the quantized blocks
    (``quantized_blocks``) and the largest outlier fraction their layers keep exact (``outliers``)."""
    if session.quantized is None:
        return {"quantize": None, "quantized_blocks": [], "outliers": 0.0}
    info = dict(session.quantized)
    blocks = info.pop("blocks", [])
    from ts_quant import QuantLinear

    fractions = [float(getattr(m, "outliers", 0.0) or 0.0) for m in session.model.modules()
                 if isinstance(m, QuantLinear)]
    return {**info, "quantized_blocks": list(blocks), "outliers": max(fractions, default=0.0)}


def summary_lines(report: dict) -> list[str]:
    """A few lines of a wrapped model's ``memory_report()`` for a console: where the optimizer state is, what
    streams, the peaks, and the plan's automatic decisions (the whole report is the JSON)."""
    optimizer = report["optimizer"]
    places = ", ".join(f"{place} {p['values'] / 1e6:.1f} M values ({fmt_bytes(p['state_bytes'])})"
                       for place, p in optimizer["placements"].items()) or "nothing trained"
    lines = [f"optimizer state   {places}; {optimizer['moment_dtype']} moments; {optimizer['steps']} steps"]
    params = report["params"]
    if params.get("paged_blocks"):
        lines.append(f"streamed weights  blocks {params['paged_blocks']} from host memory, "
                     f"{fmt_bytes(params['load_bytes'])} per step")
    if params.get("quantize"):
        lines.append(f"quantized         {params['quantize']}: {len(params['quantized_blocks'])} blocks")
    gpu = report["gpu"]
    if gpu and gpu["peak_allocated"]:  # on the CPU: nothing to say
        lines.append(f"GPU memory        peak {fmt_bytes(gpu['peak_allocated'])} allocated")
    pinned = report["pinned"]
    lines.append(f"host memory       {fmt_bytes(pinned.get('arena_used', 0))} in trainstream's host arena")
    plan = report.get("plan") or {}
    decided = ", ".join(f"{d['option']}={d['value']!r}" for d in plan.get("decisions", []))
    if decided:
        lines.append(f"decided           {decided}")
    for t in plan.get("transitions", []):
        if t["changes"]:
            lines.append(f"after step {t['step']:<6} {t['transition']}: {t['reason']}")
    return lines
