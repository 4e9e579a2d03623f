"""plot_memory(): the picture of a wrapped model's memory: the plan made at wrap() (VRAM and host RAM
by category against the budgets) beside what the recent steps measured (VRAM, host RSS, stalls)."""

from __future__ import annotations

import os

import torch

from ._units import fmt_seconds

__all__ = ["plot_memory"]

GiB = float(1 << 30)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("trainstream.plot_memory needs matplotlib: pip install 'trainstream[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg", force=False)  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _stacked(ax, x: float, parts: dict, label: str, colors: dict) -> None:
    bottom = 0.0
    for name, value in parts.items():
        if value:
            ax.bar(x, value / GiB, bottom=bottom, color=colors.setdefault(name, f"C{len(colors) % 10}"),
                   label=name.replace("_", " "), width=0.6)
            bottom += value / GiB
    ax.text(x, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=8)


def plot_memory(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Draws the plan and the measured steps of a wrapped `model` into `path` (any format matplotlib
    writes: .png, .svg, .pdf) and returns the path. Left: the plan's VRAM and host RAM by category against
    the usable budgets. Right: per recent step, the VRAM allocated and peak and the host RSS (GiB), and the
    step's seconds waited on the link, on the host optimizer and on nothing. Needs matplotlib (the
    ``plot`` extra); ImportError saying so without it."""
    from ._report import memory_report

    plt = _pyplot()  # first: without matplotlib nothing else is done
    report = memory_report(model)
    plan, stalls = report.get("plan") or {}, report.get("stalls") or []
    fig, (ax_plan, ax_mem, ax_wait) = plt.subplots(1, 3, figsize=(15, 4.8))
    colors: dict = {}
    vram = {k: v for k, v in (plan.get("vram") or {}).items() if k != "cuda_context"}
    host = dict(plan.get("host") or {})
    if not vram and plan.get("peak_vram_bytes"):
        vram = {"weights": plan["peak_vram_bytes"]}
    if not host and plan.get("host_bytes"):
        host = {"optimizer_state": plan["host_bytes"]}
    _stacked(ax_plan, 0, vram, "VRAM", colors)
    _stacked(ax_plan, 1, host, "host RAM", colors)
    budget = plan.get("budget") or {}
    for x, key in ((0, "usable_vram_bytes"), (1, "host_bytes")):
        limit = budget.get(key)
        if limit and limit < (1 << 61):  # the CPU plan has no VRAM limit
            ax_plan.hlines(limit / GiB, x - 0.4, x + 0.4, colors="black", linestyles="dashed")
    ax_plan.set_xticks([0, 1], ["VRAM (plan)", "host RAM (plan)"])
    ax_plan.set_ylabel("GiB")
    bound = plan.get("lower_bound_s") or {}
    tokens = plan.get("tokens") or {}
    ax_plan.set_title(f"plan at {tokens.get('batch', '?')} x {tokens.get('seq', '?')} tokens: "
                      f"{'fits' if plan.get('fits') else 'refused / tries'}; quantize={plan.get('quantize') or 'none'}"
                      + (f"\nlower bound {fmt_seconds(bound['total'])}/step" if bound.get("total") else ""),
                      fontsize=9)
    handles, labels = ax_plan.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax_plan.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left")

    steps = [s["step"] for s in stalls]
    if steps:
        if any(s.get("gpu") for s in stalls):
            ax_mem.plot(steps, [(s["gpu"] or {}).get("allocated", 0) / GiB for s in stalls], "o-", label="VRAM allocated")
            ax_mem.plot(steps, [(s["gpu"] or {}).get("peak_allocated", 0) / GiB for s in stalls], "s--",
                        label="VRAM peak")
        if plan.get("peak_vram_bytes") and any(s.get("gpu") for s in stalls):
            ax_mem.axhline(plan["peak_vram_bytes"] / GiB, color="gray", linestyle=":", label="planned peak")
        if any(s.get("host_rss") for s in stalls):
            ax_mem.plot(steps, [(s.get("host_rss") or 0) / GiB for s in stalls], "^-", label="host RSS")
        bottom = [0.0] * len(steps)
        for key, label in (("link_s", "link"), ("host_optimizer_s", "host optimizer"), ("none_s", "nothing")):
            values = [s[key] * 1e3 for s in stalls]
            ax_wait.bar(steps, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax_mem.legend(fontsize=7)
        ax_wait.legend(fontsize=7)
    else:
        for ax in (ax_mem, ax_wait):
            ax.text(0.5, 0.5, "no step yet", ha="center", va="center", transform=ax.transAxes)
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("measured at each step's end", fontsize=9)
    ax_wait.set_xlabel("step")
    ax_wait.set_ylabel("ms")
    ax_wait.set_title("what each step waited on", fontsize=9)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
