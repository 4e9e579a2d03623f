"""One benchmark run's record: the JSON every script in tools/bench writes and tools/bench/render.py reads.

A record is the source of every performance figure in the docs. It says where and what ran, so a reader can
tell a same-run comparison from a collection of runs:

    {"schema": SCHEMA, "kind": "compare" | "cpu-<name>", "name": <scenario or benchmark>,
     "provenance": {commit, dirty, host, cpu, cpus, gpu, driver, python, torch, cuda, command, started},
     "rounds": <how many times each engine ran, alternated A B C A B C ...>,
     "figure": <the per-run key summarised>, "unit": "s" | ..., "bounds": {<engine>: {"value", "terms"}},
     "engines": {<engine>: {"runs": [<one dict per round>], "summary": summary(...) of a per-run figure}},
     ... the script's own keys (bounds, rates, notes)}

Figures are medians over a run's steady-state window; a summary over runs gives the median, the quartiles,
the min-max range and the run count, never the best run alone.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys

SCHEMA = "trainstream-bench/1"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=20,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> tuple[str | None, str | None]:
    """(GPU name, driver version); (None, None) without CUDA. Only called by a parent after its children ran,
    or by a CPU benchmark: touching CUDA here would hold GPU memory for the whole run."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    driver = None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        driver = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return torch.cuda.get_device_name(), driver


def provenance(argv: list[str] | None = None, gpu: bool = True) -> dict:
    """Where and what ran. The commit is TS_BENCH_COMMIT (and TS_BENCH_DIRTY) where the caller stamps it (a
    snapshot of the tree run on a device machine, where git would answer for whatever checkout holds it),
    else git's; dirty is None when unknown."""
    import torch

    if os.environ.get("TS_BENCH_COMMIT"):  # a stamp wins: a snapshot inside another checkout would read that one
        commit = os.environ["TS_BENCH_COMMIT"]
        dirty = os.environ.get("TS_BENCH_DIRTY") not in (None, "", "0", "false") if "TS_BENCH_DIRTY" in os.environ else None
    else:
        commit = _git("rev-parse", "HEAD")
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
    name, driver = _gpu() if gpu else (None, None)
    args = sys.argv if argv is None else argv
    return {
        "commit": commit, "dirty": dirty, "host": socket.gethostname(), "cpu": _cpu_name(), "cpus": os.cpu_count(),
        "gpu": name, "driver": driver, "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "command": " ".join(shlex.quote(a) for a in args),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def summary(values: list[float | None]) -> dict:
    """Median, quartiles, min-max and count of the runs that produced a figure (None: a failed run, counted
    apart); {} when no run produced one."""
    good = sorted(v for v in values if v is not None)
    out = {"runs": len(good), "failed": len(values) - len(good)}
    if not good:
        return out
    q1, q3 = (statistics.quantiles(good, n=4, method="inclusive")[::2] if len(good) > 1 else (good[0], good[0]))
    return {**out, "median": statistics.median(good), "q1": q1, "q3": q3, "min": good[0], "max": good[-1]}


def record(kind: str, name: str, engines: dict[str, list[dict]], figure: str, rounds: int, unit: str = "s",
           bounds: dict[str, dict] | None = None, argv: list[str] | None = None, gpu: bool = True,
           **extra) -> dict:
    """A record for runs of several engines, each engine's runs summarised by the per-run key `figure` (in
    `unit`; smaller is better). `bounds` maps an engine to {"value": lower bound in `unit`, "terms": {...}}: the
    least the figure can be on this host, from measured rates; render.py prints it beside the figure and flags
    a run below it."""
    return {
        "schema": SCHEMA, "kind": kind, "name": name, "provenance": provenance(argv, gpu), "rounds": rounds,
        "figure": figure, "unit": unit, "bounds": bounds or {},
        "engines": {engine: {"runs": runs, "summary": summary([r.get(figure) for r in runs])}
                    for engine, runs in engines.items()},
        **extra,
    }


def write(path: str | None, data: dict) -> None:
    """Writes the record (atomically: a reader never sees half a file)."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def load(path: str) -> dict | None:
    """A record written by this module; None for older result files (they stay as history, not rendered)."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError:
            return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None
