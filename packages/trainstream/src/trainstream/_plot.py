"""plot_memory(): the picture of a wrapped model's memory: the plan made at wrap() (VRAM and host RAM
by category against the budgets), priced at the batch the steps trained, beside what the recent steps
measured (VRAM, host RSS, where each step's time went, and the plan's lower bound on the same axis)."""

from __future__ import annotations

import dataclasses
import os

import torch

from ._units import fmt_bytes, fmt_seconds

__all__ = ["plot_memory"]

GiB = float(1 << 30)
VISIBLE = 1 / 200  # a part drawn smaller than this fraction of its axis is not visible: no legend entry
NO_LIMIT = 1 << 61  # budgets at or above this are "no limit" (the CPU plan's VRAM)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("trainstream.plot_memory needs matplotlib: pip install 'trainstream[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg", force=False)  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def trained_tokens(stalls: list[dict]) -> tuple[tuple[int, int] | None, int | None]:
    """((batch, sequence), training forwards) of the most recent step that saw a training forward, else
    (None, None): what the steps trained, as ``memory_report()["stalls"]`` recorded it."""
    for step in reversed(stalls):
        if step.get("tokens"):
            batch, seq = step["tokens"]
            return (int(batch), int(seq)), step.get("forwards")
    return None, None


def plan_at(model: torch.nn.Module, plan: dict, tokens: tuple[int, int] | None) -> tuple[dict, str]:
    """(the plan's numbers, what tokens they are for). With `tokens` (batch, sequence) and a priced plan (a
    decoder shape), the plan's own choices priced again at those tokens (``ts_planner.check_plan``): the
    memory by category, the peak and the lower bound of the batch trained. Otherwise the plan as wrap() made it
    (one sequence of 2,048 tokens: wrap() does not see the batch)."""
    session = getattr(model, "_trainstream_session", None)
    priced = getattr(getattr(getattr(session, "plan", None), "memory", None), "plan", None)
    own = plan.get("tokens") or {}
    if priced is None:
        return plan, "no decoder shape: priced as a whole"
    if tokens is None:
        return plan, f"at {own.get('batch')} x {own.get('seq')} tokens (wrap()'s assumption: no training step yet)"
    if tokens != (priced.options.batch, priced.options.seq):
        import ts_planner

        options = dataclasses.replace(priced.options, batch=tokens[0], seq=tokens[1])
        again = ts_planner.check_plan(priced.shape, priced.budget, options, priced.choices)
        plan = {**plan, **again.to_dict()}
    return plan, f"at {tokens[0]} x {tokens[1]} tokens (the batch trained)"


def _stacked(ax, x: float, parts: dict, top: float, colors: dict) -> None:
    """One bar of `parts` (bytes by category), each visible part labelled; the total (every part) on top."""
    bottom = 0.0
    for name, value in parts.items():
        height = value / GiB
        if height >= VISIBLE * top:
            ax.bar(x, height, bottom=bottom, color=colors.setdefault(name, f"C{len(colors) % 10}"),
                   label=name.replace("_", " "), width=0.6)
            bottom += height
    total = sum(parts.values()) / GiB
    ax.text(x, max(bottom, total), f"{total:.2f}", ha="center", va="bottom", fontsize=8)


def _plan_panel(ax, plan: dict, what: str) -> None:
    vram = {k: v for k, v in (plan.get("vram") or {}).items() if k != "cuda_context" and v}
    host = {k: v for k, v in (plan.get("host") or {}).items() if v}
    if not vram and plan.get("peak_vram_bytes"):
        vram = {"weights": plan["peak_vram_bytes"]}
    if not host and plan.get("host_bytes"):
        host = {"optimizer_state": plan["host_bytes"]}
    budget = plan.get("budget") or {}
    limits = [(0, budget.get("usable_vram_bytes"), "VRAM budget (usable)", "black"),
              (1, budget.get("host_bytes"), "host RAM budget", "dimgray")]
    limits = [(x, v, name, color) for x, v, name, color in limits if v and v < NO_LIMIT]
    top = max([sum(vram.values()) / GiB, sum(host.values()) / GiB] + [v / GiB for _, v, _, _ in limits]) or 1.0
    colors: dict = {}
    _stacked(ax, 0, vram, top, colors)
    _stacked(ax, 1, host, top, colors)
    for x, limit, name, color in limits:
        ax.hlines(limit / GiB, x - 0.4, x + 0.4, colors=color, linestyles="dashed",
                  label=f"{name} {fmt_bytes(limit, 'GiB', 1)}")
    on_gpu = str(plan.get("device", "cuda")).startswith("cuda")
    ax.set_xticks([0, 1], ["VRAM (plan)" if on_gpu else "memory on the CPU (plan)", "host RAM (plan)"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("GiB")
    ax.set_title(f"plan {what}: {'fits' if plan.get('fits') else 'does not fit'}; "
                 f"quantize={plan.get('quantize') or 'none'}", fontsize=9)
    _legend(ax, loc="upper left")


def _legend(ax, **kwargs) -> None:
    """A legend of the labelled artists, each label once (none when nothing is labelled)."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax.legend(unique.values(), unique.keys(), fontsize=7, **kwargs)


def _measured_panel(ax, steps: list[int], stalls: list[dict], plan: dict) -> None:
    gpu = [s.get("gpu") or {} for s in stalls]
    if any(gpu):
        ax.plot(steps, [g.get("allocated", 0) / GiB for g in gpu], "o-", color="C0", label="VRAM allocated")
        ax.plot(steps, [g.get("peak_allocated", 0) / GiB for g in gpu], "s--", color="C1", label="VRAM peak")
        if plan.get("peak_vram_bytes"):
            ax.axhline(plan["peak_vram_bytes"] / GiB, color="C1", linestyle=":", label="VRAM peak (plan)")
    if any(s.get("host_rss") for s in stalls):
        ax.plot(steps, [(s.get("host_rss") or 0) / GiB for s in stalls], "^-", color="C2", label="host RSS")
        if plan.get("host_bytes"):
            ax.axhline(plan["host_bytes"] / GiB, color="C2", linestyle=":", label="host RAM (plan)")
    ax.set_ylim(bottom=0)
    _legend(ax, loc="lower right")


def _waits_panel(ax, steps: list[int], stalls: list[dict], plan: dict, tokens, forwards) -> None:
    top = max(s["step_s"] for s in stalls) * 1e3 or 1.0
    bottom = [0.0] * len(steps)
    for key, label, color in (("link_s", "link", "C0"), ("host_optimizer_s", "host optimizer", "C1"),
                              ("disk_s", "disk (nvme_path)", "C4"), ("none_s", "nothing (compute, data, your code)", "C2")):
        values = [s.get(key, 0.0) * 1e3 for s in stalls]
        if max(values) >= VISIBLE * top:  # a part no step shows is not drawn, so it has no legend entry
            ax.bar(steps, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
    bound = (plan.get("lower_bound_s") or {}).get("total")
    note = None
    if not plan.get("tokens"):
        note = "no lower bound: the plan has no decoder shape to price a step with"
    elif tokens is None:
        note = "no lower bound: no step recorded the batch it trained"
    elif forwards is not None and forwards != 1:
        note = f"no lower bound: {forwards} training forwards a step; the plan prices one forward and one update"
    elif bound:
        ax.axhline(bound * 1e3, color="black", linestyle="--",
                   label=f"lower bound {fmt_seconds(bound)}/step (plan at {tokens[0]} x {tokens[1]} tokens)")
        top = max(top, bound * 1e3)
    if note:
        ax.text(0.02, 0.98, note, transform=ax.transAxes, ha="left", va="top", fontsize=7)
    ax.set_ylim(0, top * (1.3 if note else 1.15))
    _legend(ax, loc="upper right")


def plot_memory(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Draws the plan and the measured steps of a wrapped `model` into `path` (any format matplotlib
    writes: .png, .svg, .pdf) and returns the path. Left: the plan's VRAM and host RAM by category against
    the usable budgets, priced at the batch the recent steps trained (wrap()'s one sequence of 2,048 tokens
    before any step). Middle: per recent step, the VRAM allocated and peak and the host RSS (GiB), each beside
    the plan's number. Right: each step's milliseconds waited on the link, on the host optimizer and on nothing,
    with the plan's lower bound of a step on the same axis (left out, with a note saying why, where the plan
    cannot price the steps). Only parts tall enough to see get legend entries; every axis starts at zero.
    Needs matplotlib (the ``plot`` extra); ImportError saying so without it."""
    plt = _pyplot()  # first: without matplotlib nothing else is done
    fig = memory_figure(model)
    try:
        path = os.fspath(path)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def memory_figure(model: torch.nn.Module):
    """plot_memory()'s matplotlib Figure (three Axes: the plan, the measured memory, the step times), not saved;
    the caller closes it."""
    from matplotlib.ticker import MaxNLocator

    from ._report import memory_report

    plt = _pyplot()
    report = memory_report(model)
    stalls = report.get("stalls") or []
    tokens, forwards = trained_tokens(stalls)
    plan, what = plan_at(model, report.get("plan") or {}, tokens)
    fig, (ax_plan, ax_mem, ax_wait) = plt.subplots(1, 3, figsize=(15, 4.8))
    _plan_panel(ax_plan, plan, what)
    steps = [s["step"] for s in stalls]
    if steps:
        _measured_panel(ax_mem, steps, stalls, plan)
        _waits_panel(ax_wait, steps, stalls, plan, tokens, forwards)
    else:
        for ax in (ax_mem, ax_wait):
            ax.text(0.5, 0.5, "no step yet", ha="center", va="center", transform=ax.transAxes)
            ax.set_ylim(bottom=0)
    for ax, unit, title in ((ax_mem, "GiB", "measured at each step's end"),
                            (ax_wait, "ms", "where each step's time went")):
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig
