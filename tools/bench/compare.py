r"""Same-run step times: TrainStream against stock PyTorch, bitsandbytes QLoRA, DeepSpeed ZeRO offload, the
reference 0.4.1 and Unsloth, each engine a fresh process, alternated in rounds (A B C A B C ...).

Each run's figure is the median step of its steady-state window (_compare_run.py: after the warm-up, the last
compiling step and the plan settling; allocator retries excluded and counted); the record gives every run,
and the table the median over runs with the min-max spread, the peak VRAM, and beside each TrainStream row
its lower bound (_compare_bounds.py: max of compute, dequantize, link and host AdamW, rates measured in the
same call after the engines ran; a run below its bound is flagged as a wrong bound). A stock run without the
VRAM cap is a floor, named so. --json writes one record (_record.py; rendered into the docs by render.py),
rewritten after each run.

Scenarios (random init; VRAM capped with set_per_process_memory_fraction where a cap is given):
  full1.5b      Qwen2.5-1.5B shape (tied embeddings), full fine-tune, 4 x 512, 24 GB cap
  full1.5b_2k   the same at 4 x 2048
  full7b        Qwen2.5-7B shape (untied), full fine-tune, 4 x 512, 24 GB cap, the bf16 weights built in host
                memory (as a checkpoint loads); trainstream-auto streams what does not fit
  tiny          a CPU-sized full fine-tune smoke run
  lora14b       Qwen2.5-14B shape (hidden 5120, intermediate 13824, 48 layers, 40/8 heads, vocab
                152064, untied), frozen bf16 base built block by block from the meta device, PEFT
                LoRA r=16 (alpha 32) on q,k,v,o,gate,up,down of every block, 1 x 512, 24 GB cap
  lora14b_2k    the same at 1 x 2048
  lora32b       Qwen2.5-32B shape, the same LoRA, 1 x 512, 24 GB cap
  lora_tiny     a 2-layer small Qwen2 with the same LoRA, CPU-sized
Engines, full scenarios: stock-bf16 (bf16 weights + fused AdamW, no fp32 master), stock-mixed (fp32 weights,
  bf16 autocast), stock-bf16-uncapped (the floor), trainstream-{cpu,gpu,auto}[-noguard] (optimizer_mode).
Engines, LoRA scenarios: stock-lora (bf16 base, fused torch AdamW on the adapters), stock-lora-uncapped
  (the floor), bnb-qlora (bitsandbytes NF4 base, double quant off, bf16 compute, PEFT's bnb LoRA layer, fused
  torch AdamW), bnb-qlora-ckpt (the same with Hugging Face non-reentrant gradient checkpointing),
  trainstream-lora (wrap(model, opt, quantize="nf4") on the bf16 base held in host memory, as a loaded
  checkpoint is), trainstream-lora-bf16 (quantize=None), unsloth (where it installs).
Engines, both: deepspeed-zero2 / deepspeed-zero3 (CPU-offloaded optimizer; ZeRO-3 also parameters;
  tools/bench/deepspeed_zero*.json), reference-0.4.1 (this project's predecessor from its own prefix,
  TS_BENCH_REFERENCE_PREFIX). _external_engines.py and fetch_external.sh say how they are installed.
--compile-blocks MODE: after setup, the blocks are compiled in place by trainstream.compile_blocks(model, MODE)
(modes default, max-autotune-no-cudagraphs; reduce-overhead is refused there, which the engine reports);
--compile-skip-streamed leaves the blocks whose weights stream eager (compile_blocks' skip_streamed=True).
--wrap-option key=value (repeatable, value through ast.literal_eval, else the string) goes to every
trainstream engine's wrap() and overrides its own choice; names are not checked here: wrap() refuses
unknown ones and the engine reports the error as its outcome.

    python tools/bench/compare.py --scenario tiny --rounds 2        # a CPU-sized smoke run
    python tools/bench/compare.py --scenario lora_tiny --engines stock-lora trainstream-lora

On a device machine (no network: wheels carried in .whl/, see docs/development.md and fetch_external.sh),
stamp the commit (a snapshot has no git of its own) and write the record to $OUT:
    TS_BENCH_COMMIT=<sha> TS_BENCH_DIRTY=0 python3 tools/bench/compare.py --scenario full1.5b --rounds 2 \
        --engines stock-bf16-uncapped stock-bf16 trainstream-auto deepspeed-zero2 reference-0.4.1 \
        --json $OUT/compare-full1.5b-<gpu>-<date>.json
--bounds-for JSON adds the bounds to a record whose call stopped before measuring its rates (said in it).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _compare_bounds as bounds
import _compare_engines as engines
import _compare_run
import _record

SCENARIOS = {
    # Qwen2.5-1.5B's published shape: 1.54 B parameters with tied embeddings.
    "full1.5b": dict(size="1.5b", batch=4, seq=512, vram_gb=24.0, steps=10),
    "full1.5b_2k": dict(size="1.5b", batch=4, seq=2048, vram_gb=24.0, steps=10),
    "tiny": dict(size="tiny", batch=2, seq=64, vram_gb=None, steps=6),
    "lora14b": dict(size="14b", lora=True, batch=1, seq=512, vram_gb=24.0, steps=10),
    "lora14b_2k": dict(size="14b", lora=True, batch=1, seq=2048, vram_gb=24.0, steps=10),
    "lora_tiny": dict(size="lora-tiny", lora=True, batch=2, seq=64, vram_gb=None, steps=6),
    # Qwen2.5-7B's shape, untied, built in host memory (as a checkpoint loads): its weights alone are 15.2 GB.
    "full7b": dict(size="7b", batch=4, seq=512, vram_gb=24.0, steps=6, host=True),
    # Qwen2.5-32B's shape, LoRA r=16: the bf16 base is 65.5 GB (trainstream builds it in host memory).
    "lora32b": dict(size="32b", lora=True, batch=1, seq=512, vram_gb=24.0, steps=8),
}
ENGINES = engines.FULL_ENGINES
EXTRA_ENGINES = engines.FULL_EXTRA + engines.LORA_ENGINES + engines.LORA_EXTRA


def _child(engine: str, scenario_name: str, timeout: float, steps: int | None, wrap_option_args: list[str],
           compile_mode: str | None = None, skip_streamed: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--scenario", scenario_name]
    if steps:
        cmd += ["--steps", str(steps)]
    for text in wrap_option_args:
        cmd += ["--wrap-option", text]
    if compile_mode:
        cmd += ["--compile-blocks", compile_mode] + (["--compile-skip-streamed"] if skip_streamed else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=engines.child_env(engine))
    except subprocess.TimeoutExpired:
        return {"engine": engine, "outcome": f"timed out after {timeout:.0f} s", "median_s": None, "peak_gb": None}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    return {"engine": engine, "outcome": "out of memory" if oom else "failed: " + " | ".join(tail),
            "median_s": None, "peak_gb": None}


def _wrap_option(text: str) -> tuple[str, object]:
    """argparse type for --wrap-option key=value: the value through ast.literal_eval, else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"takes key=value (for example recompute=True), not {text!r}")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def add_bounds(runs: dict[str, list[dict]]) -> dict:
    """Measures the rates here (after every engine ran: the GPU was theirs), adds each trainstream run's lower
    bound, flags a run below its bound, and returns the record's rates, bounds and below-bound list."""
    stock = [r for name in engines.STOCK_TIMED for r in runs.get(name, []) if r.get("fwd_bwd_s")]
    compute = (("+".join(sorted({r["engine"] for r in stock})), statistics.median(r["fwd_bwd_s"] for r in stock))
               if stock else None)
    rates = {"host_adamw_values_per_s": bounds.host_adamw_rate(), "link_bytes_per_s": bounds.link_rate(),
             "dequantize_nf4_values_per_s": bounds.dequantize_rate("nf4")}
    per_engine, below = {}, []
    for name, engine_runs in runs.items():
        bounded = []
        for i, r in enumerate(engine_runs):
            if not name.startswith("trainstream") or r.get("placements") is None:
                continue
            bounds.lower_bound(r, compute, rates["link_bytes_per_s"], rates["host_adamw_values_per_s"],
                               rates["dequantize_nf4_values_per_s"])
            bounded.append(r)
            if r.get("median_s") is not None and r["median_s"] < r["lower_bound_s"]:
                r["below_bound"] = True
                below.append({"engine": name, "round": i, "median_s": r["median_s"], "bound_s": r["lower_bound_s"]})
        if bounded:
            middle = sorted(bounded, key=lambda r: r["lower_bound_s"])[len(bounded) // 2]
            per_engine[name] = {"value": middle["lower_bound_s"], "terms": middle["lower_bound_terms"]}
    return {"rates": rates, "bounds": per_engine, "below_bound": below}


def _print_table(data: dict) -> None:
    print("| Engine | Median step (runs) | Spread (min-max) | Peak VRAM | Lower bound | Outcome |")
    print("|---|---|---|---|---|---|")
    for name, entry in data["engines"].items():
        s = entry["summary"]
        runs = entry["runs"]
        step = f"{s['median']:.3f} s ({s['runs']})" if s.get("runs") else "—"
        spread = f"{s['min']:.3f}-{s['max']:.3f} s" if s.get("runs") else "—"
        peaks = [r["peak_gb"] for r in runs if r.get("peak_gb")]
        peak = f"{max(peaks):.1f} GB" if peaks else "—"
        bound = data["bounds"].get(name)
        outcomes = sorted({str(r.get("outcome")) for r in runs})
        floor = " (floor: no VRAM cap)" if name in data["floors"] else ""
        bound_text = f"{bound['value']:.3f} s" if bound else "—"
        print(f"| {name}{floor} | {step} | {spread} | {peak} | {bound_text} | "
              f"{'; '.join(outcomes)} |")
    for name, bound in data["bounds"].items():
        t = bound["terms"]
        compute = (f"compute {t['compute_fwd_bwd']:.3f} s ({t['compute_from']})" if t["compute_fwd_bwd"]
                   else "compute not measured (run a stock engine in the same call)")
        dequant = f", dequantize {t['dequantize']:.3f} s" if t.get("dequantize") else ""
        print(f"lower bound {name}: max({compute}{dequant}, link {t['link']:.3f} s, host AdamW {t['host_adamw']:.3f} s)")
    for b in data["below_bound"]:
        print(f"ERROR: {b['engine']} round {b['round']} ran {b['median_s']:.3f} s, below its bound "
              f"{b['bound_s']:.3f} s: the bound is wrong")


def _bounds_later(path: str) -> None:
    """--bounds-for: a record's bounds from rates measured in a later call (said in the record)."""
    with open(path) as f:
        data = json.load(f)
    runs = {name: entry["runs"] for name, entry in data["engines"].items()}
    extra = add_bounds(runs)
    here = _record.provenance(gpu=True)
    data.update(bounds=extra["bounds"], rates=extra["rates"], below_bound=extra["below_bound"],
                rates_note=f"measured after the call, on {here['host']} ({here['gpu']}): the call ended before "
                           "measuring them")
    for key in ("gpu", "driver"):  # a record saved before its engines' results were complete lacks them
        data["provenance"][key] = data["provenance"].get(key) or here[key]
    _print_table(data)
    _record.write(path, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="full1.5b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--engines", nargs="+", default=None, choices=engines.ALL_ENGINES, metavar="ENGINE",
                        help=f"engines to run, alternated in each round: {', '.join(engines.ALL_ENGINES)}; default: "
                             f"{' '.join(ENGINES)} in full scenarios, {' '.join(engines.LORA_ENGINES)} in LoRA ones")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every engine once, in order")
    parser.add_argument("--steps", type=int, default=None, help="steps per engine run (default: the scenario's)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per engine process")
    parser.add_argument("--wrap-option", type=_wrap_option, action="append", default=[], metavar="KEY=VALUE",
                        help="extra trainstream.wrap() option for every trainstream engine (repeatable)")
    parser.add_argument("--compile-blocks", default=None, choices=engines.COMPILE_MODES, metavar="MODE",
                        help="torch.compile each block in place with this mode: " + ", ".join(engines.COMPILE_MODES))
    parser.add_argument("--compile-skip-streamed", action="store_true",
                        help="with --compile-blocks: blocks whose weights stream stay eager")
    parser.add_argument("--json", default=None, help="write the record here (also after each engine run)")
    parser.add_argument("--bounds-for", default=None, metavar="JSON",
                        help="add the bounds to a record whose call ended before measuring its rates, measuring them "
                             "now (the record notes it); run on the same host, warm")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bounds_for:
        _bounds_later(args.bounds_for)
        return
    if args.rounds < 1:
        parser.error("--rounds takes 1 or more")
    scenario = dict(SCENARIOS[args.scenario])
    if args.steps:
        scenario["steps"] = args.steps
    wrap_options = dict(args.wrap_option)
    if args.child:
        result = _compare_run.run_engine(args.child, scenario, wrap_options, args.compile_blocks,
                                         args.compile_skip_streamed)
        print("RESULT " + json.dumps(result, default=str), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip tearing down tens of GB and the engine's threads: the result is out
    lora = bool(scenario.get("lora"))
    engine_list = list(dict.fromkeys(args.engines or (engines.LORA_ENGINES if lora else ENGINES)))
    passthrough = [f"{key}={value!r}" for key, value in args.wrap_option]  # repr round-trips literal_eval
    settings = {"scenario": scenario, "wrap_options": {k: repr(v) for k, v in wrap_options.items()},
                "compile_blocks": args.compile_blocks, "compile_skip_streamed": args.compile_skip_streamed}
    runs: dict[str, list[dict]] = {name: [] for name in engine_list}
    order: list[str] = []  # engine names in the order they ran
    flat: list[dict] = []  # the runs in that order (older readers: interleaved_ab.py, plan_accuracy.py)

    def snapshot(extra: dict) -> dict:
        # gpu=False until the engines ran: no CUDA call in this process before them (the GPU is theirs).
        data = _record.record("compare", args.scenario, runs, "median_s", args.rounds, unit="s",
                              bounds=extra.get("bounds"), gpu=bool(extra), settings=settings, order=order,
                              floors=[n for n in engine_list if n.endswith("-uncapped")],
                              rates=extra.get("rates", {}), below_bound=extra.get("below_bound", []),
                              header=f"scenario {args.scenario} {scenario}", results=flat)
        return data

    for round_index in range(args.rounds):
        for name in engine_list:
            skip = engines.not_applicable(name, scenario)
            result = ({"engine": name, "outcome": skip, "median_s": None, "peak_gb": None} if skip
                      else _child(name, args.scenario, args.timeout, args.steps, passthrough, args.compile_blocks,
                                  args.compile_skip_streamed))
            result["round"] = round_index
            runs[name].append(result)
            order.append(name)
            flat.append(result)
            print(f"round {round_index + 1} {name}: {result.get('outcome')} {result.get('median_s') or ''}", flush=True)
            _record.write(args.json, snapshot({}))
    data = snapshot(add_bounds(runs))
    rates = data["rates"]
    p = data["provenance"]
    print(f"\nscenario {args.scenario} {scenario}; {args.rounds} rounds alternated; GPU {p['gpu'] or 'none'}; "
          f"{p['cpus']} CPUs; link {rates['link_bytes_per_s'] / 1e9:.1f} GB/s; "
          f"host AdamW {rates['host_adamw_values_per_s'] / 1e9:.2f} G values/s\n")
    _print_table(data)
    _record.write(args.json, data)


if __name__ == "__main__":
    main()
