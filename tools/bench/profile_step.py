"""Where a training step's time goes (issue 13): per step, host time against GPU busy time, and the top
host-side ops under torch.profiler, for trainstream and the stock engines of compare.py.

Per step: `host` is the time until Python has enqueued the whole step (forward, backward, step(),
zero_grad(), up to loss.item()'s wait excluded), `wall` the time until the GPU finished, `gpu busy`
the union of the step's kernel and copy intervals. host ~ wall and gpu busy << wall: host-bound.
Models come from tools/bench/_compare_engines.py (random-init Qwen2.5 shapes); "14b-8" is the 14B
shape cut to its first 8 decoder blocks (the slice the issue profiles).

    python tools/bench/profile_step.py --smoke                    # CPU, lora-tiny, both engines, seconds
    python tools/bench/profile_step.py                            # GPU: 14b-8, 1 x 512, VRAM capped at 24 GB
    python tools/bench/profile_step.py --engines trainstream-lora --top 40 --trace /tmp/ts.json
    python tools/bench/profile_step.py --engines trainstream-lora --wrap-option optimizer_mode=\\"gpu\\"

Each engine runs in its own process (the VRAM cap and the allocator start fresh).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _compare_engines as engines

engines.SHAPES.setdefault("14b-8", {**engines.SHAPES["14b"], "num_hidden_layers": 8})
DEFAULT_ENGINES = ["stock-lora-uncapped", "bnb-qlora", "trainstream-lora"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, opt, ids, device) -> tuple[float, float, float]:
    """(host s, wall s, loss) of one step; the GPU is idle at its start."""
    start = time.perf_counter()
    with torch.profiler.record_function("train_step"):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        host = time.perf_counter() - start
    _sync(device)
    wall = time.perf_counter() - start
    return host, wall, loss.item()


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def sum_by_name(pairs, top: int | None = None) -> list[tuple[str, float]]:
    """(name, amount) pairs summed per name, largest first (the first ``top``)."""
    totals: dict[str, float] = {}
    for name, amount in pairs:
        totals[name] = totals.get(name, 0.0) + amount
    return sorted(totals.items(), key=lambda item: -item[1])[:top]


def cprofile_top(profiler, top: int) -> list[str]:
    """A stopped cProfile.Profile's ``top`` functions by own time, as the lines pstats prints (header first)."""
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top - 1:]


def _kind(event: dict) -> str | None:
    """The GPU activity class of a chrome-trace event: "h2d" / "d2h" copies, "kernel" (kernels, memsets,
    device-to-device copies: work that occupies the GPU rather than the link), None for host events."""
    category, name = event.get("cat", ""), event.get("name", "")
    if category == "gpu_memcpy":
        return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "kernel"
    if category in ("kernel", "gpu_memset"):
        return "kernel"
    return None


def gpu_busy_per_window(prof, marker: str = "train_step", top: int = 0, trace: str | None = None) -> list[dict]:
    """Per window between two ``marker`` annotations (``record_function(marker)``; the last one runs to
    the trace's end), seconds of GPU activity: ``busy`` (kernels, copies, memsets: their union),
    ``kernel``, ``h2d``, ``d2h`` (each class's union), ``h2d_alone`` (host-to-device copying while no
    kernel runs: the compute stream waiting on the link), ``h2d_bytes``, and with ``top`` the window's
    ``top`` kernels by time, read from the exported chrome trace (the profiler's event list leaves out
    device work it cannot tie to a host op, e.g. most copies). A window's work is what lies between its
    marker and the next: where the GPU is synchronized at every window's end this is exact, otherwise
    steady-state windows still average right."""
    import tempfile

    # A profiler saves its trace once: with ``trace`` (a path) it is kept there, else in a temporary file.
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        path = trace or f.name
        prof.export_chrome_trace(path)
        with open(path) as saved:
            events = json.load(saved)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    marks = sorted(e["ts"] for e in events if e.get("name") == marker and e.get("cat") == "user_annotation")
    device_events = [(e["ts"], e["ts"] + e.get("dur", 0), _kind(e), e) for e in events if _kind(e) and "ts" in e]
    runtime = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events if e.get("cat") == "cuda_runtime" and "ts" in e]
    host = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
            if e.get("cat") in ("cpu_op", "user_annotation") and "ts" in e]
    out = []
    for i, start in enumerate(marks):
        stop = marks[i + 1] if i + 1 < len(marks) else float("inf")
        mine = [(max(a, start), min(b, stop), k, e) for a, b, k, e in device_events if a < stop and b > start]
        row = {"busy": _union_us([(a, b) for a, b, _k, _e in mine]) / 1e6}
        for kind in ("kernel", "h2d", "d2h"):
            row[kind] = _union_us([(a, b) for a, b, k, _e in mine if k == kind]) / 1e6
        both = _union_us([(a, b) for a, b, k, _e in mine if k in ("kernel", "h2d")]) / 1e6
        row["h2d_alone"] = both - row["kernel"]
        row["h2d_bytes"] = sum(int(e.get("args", {}).get("bytes", 0)) for _a, _b, k, e in mine if k == "h2d")
        if stop != float("inf"):
            row["wall"] = (stop - start) / 1e6
        if top:
            row["top"] = sum_by_name(((e["name"], (b - a) / 1e6) for a, b, k, e in mine if k == "kernel"), top)
            # Where the host waited: CUDA runtime calls by time (a synchronize, or a launch or copy call
            # that blocked), within the window.
            row["runtime_top"] = sum_by_name(((e["name"], (b - a) / 1e6) for a, b, e in runtime if start <= a < stop),
                                             top)
            # Host-side ops and annotated ranges (record_function) by time, within the window: what the
            # host was doing when it was not waiting.
            row["host_top"] = sum_by_name(((e["name"], (b - a) / 1e6) for a, b, e in host
                                           if start <= a < stop and e.get("name") != marker), top)
        out.append(row)
    return out


def profile_engine(engine: str, scenario: dict, wrap_options: dict, steps: int, warmup: int, top: int,
                   trace: str | None, py_profile: bool = False) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cap = None if engine.endswith("-uncapped") else scenario.get("vram_gb")
    if device.type == "cuda" and cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap * 1e9 / total, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    info: dict = {}
    try:
        model, opt = engines.setup(engine, scenario, device, dtype, wrap_options, info)
    except engines.EngineUnavailable as e:
        return {"engine": engine, "outcome": str(e)}
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def batch():
        return torch.randint(0, vocab, (scenario["batch"], scenario["seq"]), generator=generator).to(device)

    for _ in range(warmup):
        _step(model, opt, batch(), device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rows = []
    streamed_before = _streamed_h2d_bytes(model)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            ids = batch()
            _sync(device)
            rows.append(_step(model, opt, ids, device))
    busy = gpu_busy_per_window(prof, trace=trace) if device.type == "cuda" else [None] * len(rows)
    streamed = _streamed_h2d_bytes(model)
    streamed_per_step = (streamed - streamed_before) / len(rows) if streamed is not None else None
    if trace and device.type != "cuda":
        prof.export_chrome_trace(trace)
    averages = prof.key_averages()
    ops = sorted((a for a in averages if a.key != "train_step"), key=lambda a: a.self_cpu_time_total, reverse=True)
    top_ops = [{"op": a.key, "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3 / len(rows),
                "cpu_total_ms": a.cpu_time_total / 1e3 / len(rows),
                "us_per_call": a.self_cpu_time_total / max(1, a.count)} for a in ops[:top]]
    # The same steps again without the profiler: its own overhead inflates every host number above.
    plain = [_step(model, opt, batch(), device) for _ in range(steps)]
    python_top = _python_profile(model, opt, batch, device, steps, top) if py_profile else None
    events = []
    if hasattr(model, "_trainstream_session"):
        import trainstream
        events = [line[:200] for line in trainstream.memory_report(model).get("events", [])][-12:]
    return {"python_top": python_top, "events": events,"engine": engine, "outcome": "ok", "device": str(device),
            "streamed_h2d_bytes_per_step": streamed_per_step,
            "steps": [{"host_s": h, "wall_s": w, "gpu_busy_s": b and b["busy"], "gpu": b, "loss": loss}
                      for (h, w, loss), b in zip(rows, busy)],
            "unprofiled": [{"host_s": h, "wall_s": w} for h, w, _ in plain],
            "top_ops": top_ops}


def _streamed_h2d_bytes(model) -> int | None:
    """Bytes the weight streamer has copied host-to-device so far (None without streamed weights)."""
    if not hasattr(model, "_trainstream_session"):
        return None
    import trainstream
    params = trainstream.memory_report(model).get("params") or {}
    streaming = params.get("streaming") or {}
    return streaming.get("h2d_bytes")


def _python_profile(model, opt, batch, device, steps: int, top: int) -> list[str]:
    """cProfile over whole steps (host side): the top functions by own time, with their call counts,
    to tell Python bookkeeping from torch's dispatch."""
    import cProfile

    profiler = cProfile.Profile()
    for _ in range(steps):
        ids = batch()
        _sync(device)
        profiler.enable()
        _step(model, opt, ids, device)
        profiler.disable()
    return cprofile_top(profiler, top)


def report(result: dict) -> None:
    name = result["engine"]
    if result.get("outcome") != "ok":
        print(f"\n== {name}: {result.get('outcome')}")
        return
    print(f"\n== {name} on {result['device']} (per step; ms)")
    print(f"{'step':>4s} {'host':>9s} {'wall':>9s} {'gpu busy':>9s} {'busy/wall':>9s} {'kernels':>9s} {'h2d':>9s} "
          f"{'d2h':>9s} {'h2d alone':>9s}")
    for i, s in enumerate(result["steps"]):
        g = s.get("gpu") or {}
        cells = ["n/a"] * 6 if not g else [f"{g['busy'] * 1e3:.1f}", f"{g['busy'] / s['wall_s']:.0%}"] + [
            f"{g[k] * 1e3:.1f}" for k in ("kernel", "h2d", "d2h", "h2d_alone")]
        print(f"{i:4d} {s['host_s'] * 1e3:9.1f} {s['wall_s'] * 1e3:9.1f} " + " ".join(f"{c:>9s}" for c in cells))
    per_step = result.get("streamed_h2d_bytes_per_step")
    h2d = [s["gpu"]["h2d"] for s in result["steps"] if s.get("gpu")]
    if per_step and h2d:
        busy = statistics.median(h2d)
        print(f"streamed weights: {per_step / 1e9:.2f} GB per step; while host-to-device copies run the link "
              f"reaches {per_step / busy / 1e9:.1f} GB/s (all h2d copies: {busy * 1e3:.1f} ms per step, median)")
    plain = result["unprofiled"]
    print(f"without the profiler: host {statistics.median(s['host_s'] for s in plain) * 1e3:.1f} ms, "
          f"wall {statistics.median(s['wall_s'] for s in plain) * 1e3:.1f} ms (medians)")
    print("top host-side ops by self CPU time (per step; under the profiler):")
    print(f"  {'self ms':>8s} {'total ms':>9s} {'calls':>6s} {'us/call':>8s}  op")
    for op in result["top_ops"]:
        print(f"  {op['self_cpu_ms']:8.2f} {op['cpu_total_ms']:9.2f} {op['calls'] // max(1, len(result['steps'])):6d} "
              f"{op['us_per_call']:8.1f}  {op['op'][:90]}")
    if result.get("python_top"):
        print(f"cProfile over {len(result['steps'])} whole steps, by own time (seconds over all steps):")
        for line in result["python_top"]:
            print("  " + line[:150])
    for line in result.get("events", []):
        print("  event " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=None, help=f"default {DEFAULT_ENGINES}")
    parser.add_argument("--size", default=None, help="a _compare_engines shape: 14b-8 (GPU default), lora-tiny, 14b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None, help="default 512 (smoke: 32)")
    parser.add_argument("--vram-gb", type=float, default=24.0, help="VRAM cap of the capped engines (GPU)")
    parser.add_argument("--steps", type=int, default=None, help="profiled steps (default 3, smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before profiling (default 3, smoke 1)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", default=None, help="chrome trace path (one engine)")
    parser.add_argument("--wrap-option", action="append", default=[], metavar="KEY=PYTHON_LITERAL")
    parser.add_argument("--py-profile", action="store_true", help="also cProfile whole steps (Python's own time)")
    parser.add_argument("--full", action="store_true", help="a full fine-tune (engines trainstream-cpu, "
                        "trainstream-cpu-noguard, stock-bf16, ...) instead of LoRA")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: lora-tiny, 32 tokens, few steps")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.size = args.size or "lora-tiny"
        args.engines = args.engines or ["stock-lora", "trainstream-lora"]
    size = args.size or "14b-8"
    engine_names = args.engines or DEFAULT_ENGINES
    scenario = dict(size=size, lora=not args.full, batch=args.batch, seq=args.seq or (32 if args.smoke else 512),
                    vram_gb=args.vram_gb)
    steps = args.steps or (2 if args.smoke else 3)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    wrap_options = {}
    for item in args.wrap_option:
        key, _, value = item.partition("=")
        wrap_options[key] = ast.literal_eval(value)
    if args._child:
        (engine,) = engine_names
        result = profile_engine(engine, scenario, wrap_options, steps, warmup, args.top, args.trace,
                                args.py_profile)
        print("RESULT " + json.dumps(result))
        return
    print(f"scenario: {scenario}, {steps} profiled steps after {warmup}, wrap options {wrap_options}")
    results = []
    for engine in engine_names:
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", "--engines", engine, "--size", size,
               "--batch", str(args.batch), "--seq", str(scenario["seq"]), "--vram-gb", str(args.vram_gb),
               "--steps", str(steps), "--warmup", str(warmup), "--top", str(args.top)]
        cmd += ["--full"] if args.full else []
        cmd += [f"--wrap-option={o}" for o in args.wrap_option]
        cmd += ["--py-profile"] if args.py_profile else []
        if args.trace and len(engine_names) == 1:
            cmd += ["--trace", args.trace]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            result = {"engine": engine, "outcome": f"failed (rc {done.returncode}): {done.stderr.strip()[-600:]}"}
        else:
            result = json.loads(lines[-1][len("RESULT "):])
        report(result)
        results.append(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scenario": scenario, "wrap_options": wrap_options, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
