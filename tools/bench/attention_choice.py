r"""What wrap(attention=...) does to a training step: "default" (PyTorch's own choice) against "auto"
(the fastest backend measured on the model's shapes) and each backend pinned by name.

Each run is one trainstream engine of tools/bench/compare.py (its _compare_engines helpers build the
model and call wrap()) in a fresh process, VRAM capped with set_per_process_memory_fraction, random
input ids; the step time is the median of --steps steps after --warmup warm-up steps (the first
forward is where "auto" measures, and the activation policy tunes itself in the first steps).

Scenarios (random init, Qwen2.5-1.5B shape, bf16 weights):
  full   full fine-tune: the trainstream-auto engine (optimizer_mode="auto", offload="auto")
  lora   LoRA r=16 on q,k,v,o,gate,up,down of every block, bf16 base (the trainstream-lora-bf16 engine)
  lora14b  the same on the Qwen2.5-14B shape with an NF4 base (the trainstream-lora engine; compare.py's
           lora14b at 1x512, lora14b_2k at 1x2048)
Shapes: 1x512, 4x512 (compare.py's full1.5b), 1x2048 and 4x2048 (batch x sequence); default 1x2048 4x2048. Modes: default auto cudnn efficient flash math.

    python tools/bench/attention_choice.py --json $OUT/attention.json          # everything (long)
    python tools/bench/attention_choice.py --scenarios full --shapes 1x2048    # one call's worth
    python tools/bench/attention_choice.py --smoke                              # CPU, tiny shapes

--smoke: the CPU, tiny model sizes (the "tiny" full model, the 2-layer LoRA one), shapes 1x32 and
2x32, all runs in this process: it checks the script, its numbers mean nothing.
The JSON keeps per run: the step times, peak VRAM, the losses, memory_report(model)["attention"]
(auto: the per-backend kernel timings in ms per attention shape and the chosen backend) and the
events about attention and activations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _compare_engines as engines

SCENARIOS = {"full": dict(engine="trainstream-auto", size="1.5b", lora=False),
             "lora": dict(engine="trainstream-lora-bf16", size="1.5b", lora=True),
             "lora14b": dict(engine="trainstream-lora", size="14b", lora=True)}
SMOKE_SIZES = {"full": "tiny", "lora": "lora-tiny", "lora14b": "lora-tiny"}
SHAPES = {"1x512": (1, 512), "4x512": (4, 512), "1x2048": (1, 2048), "4x2048": (4, 2048)}
SMOKE_SHAPES = {"1x32": (1, 32), "2x32": (2, 32)}
MODES = ["default", "auto", "cudnn", "efficient", "flash", "math"]


def _failure(error: BaseException, where: str) -> str:
    text = " ".join(str(error).split())
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return f"out of memory in {where} ({text[:160]})"
    return f"{where} raised {type(error).__name__}: {text[:300]}"


def run_one(scenario: str, shape: str, mode: str, *, smoke: bool, steps: int, warmup: int,
            vram_gb: float | None, wrap_options: dict) -> dict:
    """One (scenario, shape, mode) in this process: step times, peak VRAM, the attention report."""
    import trainstream

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and vram_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, vram_gb * 1e9 / total), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = SCENARIOS[scenario]
    batch, seq = (SMOKE_SHAPES if smoke else SHAPES)[shape]
    setup = {"size": SMOKE_SIZES[scenario] if smoke else spec["size"], "lora": spec["lora"], "batch": batch, "seq": seq}
    result: dict = {"scenario": scenario, "shape": shape, "mode": mode, "outcome": "ok", "median_s": None,
                    "peak_gb": None, "vram_cap_gb": vram_gb if device.type == "cuda" else None}
    info: dict = {}
    try:
        model, opt = engines.setup(spec["engine"], setup, device, dtype, {"attention": mode, **wrap_options}, info)
    except Exception as error:  # a run's failure is its outcome
        return {**result, "outcome": _failure(error, info.get("failed_in", "setup"))}
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    times, losses = [], []
    try:
        for step in range(warmup + steps):
            where = f"step {step + 1}"
            ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    except Exception as error:
        result["outcome"] = _failure(error, where)
    try:
        report = trainstream.memory_report(model)
        result["attention"] = report.get("attention")
        # The placement events too: a switch of the optimizer state in the timed steps moves them more than a kernel.
        result["events"] = [e for e in report.get("events", [])
                            if any(k in e for k in ("attention", "activation", "switch", "optimizer"))]
        result["activations"] = {k: v for k, v in (report.get("activations") or {}).items()
                                 if k in ("policy", "decision", "offloaded_blocks", "recompute_blocks")}
    except Exception as error:  # a report after a failed step is a bonus
        result["report_error"] = f"{type(error).__name__}: {error}"
    timed = times[warmup:]
    result.update(median_s=statistics.median(timed) if timed else None, steps_s=times, losses=losses,
                  peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
                  wrap_s=info.get("wrap_s"), build_s=info.get("build_s"))
    if smoke:
        trainstream.unwrap(model)
    return result


def _child(job: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**_head(job), "outcome": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    return {**_head(job), "outcome": "out of memory" if oom else "failed: " + " | ".join(tail)}


def _head(job: dict) -> dict:
    return {"scenario": job["scenario"], "shape": job["shape"], "mode": job["mode"], "median_s": None, "peak_gb": None}


def table(results: list[dict], modes: list[str]) -> str:
    """Markdown: median step (and peak VRAM) per scenario x shape and mode; auto's pick and its speed-up."""
    rows: dict = {}
    for r in results:
        rows.setdefault((r["scenario"], r["shape"]), {}).setdefault(r["mode"], []).append(r)
    lines = ["| scenario | shape | " + " | ".join(modes) + " | auto picked | default / auto |",
             "|---|---|" + "---|" * len(modes) + "---|---|"]
    for (scenario, shape), by_mode in rows.items():
        cells = []
        for mode in modes:
            cells.append(" / ".join(_cell(r) for r in by_mode.get(mode, [])))
        auto, default = _median_of_runs(by_mode.get("auto", [])), _median_of_runs(by_mode.get("default", []))
        picked = "/".join(sorted({(r.get("attention") or {}).get("backend") or "—" for r in by_mode.get("auto", [])}))
        ratio = f"{default / auto:.3f}x" if auto and default else "—"
        lines.append(f"| {scenario} | {shape} | " + " | ".join(cells) + f" | {picked} | {ratio} |")
    return "\n".join(lines)


def _cell(r: dict) -> str:
    if r.get("median_s") is None:
        return str(r.get("outcome"))[:40]
    peak = f", {r['peak_gb']:.1f} GB" if r.get("peak_gb") else ""
    return f"{r['median_s']:.3f} s{peak}" + ("" if r["outcome"] == "ok" else " (!)")


def _median_of_runs(runs: list[dict]) -> float | None:
    """The median over a mode's runs of each run's median step (None when none ran)."""
    medians = [r["median_s"] for r in runs if r.get("median_s")]
    return statistics.median(medians) if medians else None


def kernel_table(results: list[dict]) -> str:
    """Markdown: auto's measured forward+backward milliseconds per backend and attention shape."""
    lines = ["| scenario | shape | attention call | " + " | ".join(m for m in MODES[2:]) + " | chosen |",
             "|---|---|---|" + "---|" * (len(MODES) - 2) + "---|"]
    for r in results:
        report = r.get("attention") or {}
        if r["mode"] != "auto":
            continue
        for label, timings in (report.get("timings_ms") or {}).items():
            skipped = (report.get("skipped") or {}).get(label, {})
            cells = [f"{timings[b]:.3f}" if b in timings else ("skipped" if b in skipped else "") for b in MODES[2:]]
            lines.append(f"| {r['scenario']} | {r['shape']} | {label} | " + " | ".join(cells) +
                         f" | {(report.get('chosen') or {}).get(label)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=["full", "lora"],
                        help="default: full lora (lora14b builds a 14B model: minutes per run)")
    parser.add_argument("--shapes", nargs="+", default=None, help="default: 1x2048 4x2048 (smoke: 1x32 2x32)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 4; smoke 1)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per mode, interleaved (default, auto, default, auto, ...): one process per run; "
                             "on a shared host the spread between runs can exceed the differences between modes")
    parser.add_argument("--vram-gb", type=float, default=24.0, help="VRAM cap per run in GB (0: none)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run process")
    parser.add_argument("--wrap-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra wrap() option for every run (value through ast.literal_eval)")
    parser.add_argument("--json", default=None, help="write the results here (also after each run)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, in this process")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        job = json.loads(args.child)
        print("RESULT " + json.dumps(run_one(**job), default=str), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip tearing down the engine's threads and GBs: the result is out
    import compare  # its --wrap-option parser, so both scripts read options the same way

    wrap_options = dict(compare._wrap_option(text) for text in args.wrap_option)
    if "attention" in wrap_options:
        parser.error("--wrap-option attention=... is what --modes sets")
    shapes = args.shapes or list(SMOKE_SHAPES if args.smoke else ["1x2048", "4x2048"])
    known = SMOKE_SHAPES if args.smoke else SHAPES
    for shape in shapes:
        if shape not in known:
            parser.error(f"--shapes {shape!r} is not one of {', '.join(known)}")
    steps = args.steps or (2 if args.smoke else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 4)
    results = []
    for scenario in args.scenarios:
        for shape in shapes:
            for run in range(args.repeat):  # modes interleaved: default, auto, default, auto, ...
                for mode in args.modes:
                    job = dict(scenario=scenario, shape=shape, mode=mode, smoke=args.smoke, steps=steps,
                               warmup=warmup, vram_gb=args.vram_gb or None, wrap_options=wrap_options)
                    result = run_one(**job) if args.smoke else _child(job, args.timeout)
                    result["run"] = run
                    print(f"{scenario} {shape} {mode} (run {run + 1}): {result.get('outcome')} "
                          f"{result.get('median_s') or ''}", flush=True)
                    results.append(result)
                _save(args.json, _header(args, steps, warmup, wrap_options, partial=True), results)
    header = _header(args, steps, warmup, wrap_options, partial=False)
    _save(args.json, header, results)
    print("\n" + header + "\n\n" + table(results, args.modes) + "\n\n" + kernel_table(results))
    return 0 if all(r.get("outcome") == "ok" for r in results if r["mode"] in ("default", "auto")) else 1


def _header(args, steps: int, warmup: int, wrap_options: dict, partial: bool) -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    text = (f"attention_choice{' --smoke' if args.smoke else ''}: median of {steps} steps after {warmup}; GPU {gpu}; "
            f"VRAM cap {args.vram_gb or 'none'} GB; torch {torch.__version__}; {os.cpu_count()} CPUs")
    if wrap_options:
        text += f"; wrap options {wrap_options}"
    return text + (" (partial: runs still going)" if partial else "")


def _save(path: str | None, header: str, results: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
