r"""Head-to-head step times: trainstream against stock PyTorch, bitsandbytes QLoRA (and DeepSpeed where installed).

Each engine runs in a fresh process; the table shows the median step after warm-up (steps 3 on),
the peak VRAM from the end of the model build on, and a lower bound beside each trainstream row.

Scenarios (random init; VRAM capped with set_per_process_memory_fraction where a cap is given):
  full1.5b      Qwen2.5-1.5B shape (tied embeddings, as before), full fine-tune, 4 x 512, 24 GB cap
  full1.5b_2k   the same at 4 x 2048
  full7b        Qwen2.5-7B shape (untied), full fine-tune, 4 x 512, 24 GB cap, the bf16 weights built in host
                memory (as a checkpoint loads); trainstream-auto streams what does not fit (issue 11)
  tiny          a CPU-sized full fine-tune smoke run
  lora14b       Qwen2.5-14B shape (hidden 5120, intermediate 13824, 48 layers, 40/8 heads, vocab
                152064, untied), frozen bf16 base built block by block from the meta device, PEFT
                LoRA r=16 (alpha 32) on q,k,v,o,gate,up,down of every block, 1 x 512, 24 GB cap
  lora14b_2k    the same at 1 x 2048
  lora_tiny     a 2-layer small Qwen2 with the same LoRA, CPU-sized
Engines, full scenarios: stock-bf16 (bf16 weights + fused AdamW, no fp32 master), stock-mixed,
  deepspeed-zero2, trainstream-{cpu,gpu,auto}[-noguard]; stock-bf16-uncapped (no VRAM cap).
Engines, LoRA scenarios: stock-lora (bf16 base, fused torch AdamW on the adapters), stock-lora-uncapped
  (the same without the cap: the no-offload floor), bnb-qlora (bitsandbytes NF4 base, double quant off,
  bf16 compute, PEFT's bnb LoRA layer, fused torch AdamW), bnb-qlora-ckpt (the same with Hugging Face
  non-reentrant gradient checkpointing), trainstream-lora (wrap(model, opt, quantize="nf4") on the bf16
  base held in host memory, as a loaded checkpoint is), trainstream-lora-bf16 (quantize=None).
--compile-blocks MODE: after setup, the blocks are compiled in place by trainstream.compile_blocks(model, MODE)
(modes default, max-autotune-no-cudagraphs; reduce-overhead is refused there, which the engine reports);
--compile-skip-streamed leaves the blocks whose weights stream eager (compile_blocks' skip_streamed=True).
--wrap-option key=value (repeatable, value through ast.literal_eval, else the string) goes to every
trainstream engine's wrap() and overrides its own choice; names are not checked here: wrap() refuses
unknown ones and the engine reports the error as its outcome.

Lower bound beside each trainstream row: max(gpu, link, host), each measured in the same call.
  gpu   forward+backward time of the stock path; 0 ("not measured" on the terms line) when no such
        engine ran in the call
  link  bytes per step / the pinned link rate measured at the end, forward and backward in turn, each
        bound by its busier direction: forward pages activations out while half the streamed weights
        come in; backward sends gradients out while the pages and the other half come in
  host  host-placed trained values / the ts-adamw rate measured at the end (fp32 moments)
Per scenario:
  full1.5b, full1.5b_2k, tiny: gpu from stock-bf16 or stock-bf16-uncapped (no fp32 master: a floor);
    each way of the link carries host-placed values x 2 (bf16 gradient down, bf16 weight up) +
    mapped values x 12 + paged activation bytes (below); host = host-placed values.
  lora14b, lora14b_2k, lora_tiny: gpu from stock-lora or stock-lora-uncapped (bf16 base, so no
    dequantisation: a floor for the NF4 engines too); each way of the link carries host-placed adapter
    values x 4 (PEFT keeps the adapters fp32; 68.8 M values in 672 tensors at 14B) + mapped values x 12
    + paged activation bytes, and host->device also the streamed base weights (memory_report()
    ["params"]["load_bytes"] per step, once weights stream: issue 11); host = host-placed adapter values.
  Paged activation bytes per iteration, each way: memory_report()["activations"]["paging"] d2h_bytes /
    h2d_bytes over the iterations run, else block_bytes summed over offloaded_blocks; 0 without paging.
  The bytes per value are measured (element size of the trained tensors), not assumed.

    python tools/bench/compare.py                       # every engine, full1.5b (tiny without CUDA)
    python tools/bench/compare.py --scenario tiny       # a CPU-sized smoke run
    python tools/bench/compare.py --scenario lora_tiny --engines trainstream-lora

bitsandbytes is not on the H200 image: its wheel is downloaded here into .whl/ (git-ignored; see
docs/development.md), the run carries ".whl", and the device command starts with
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
then, one call per scenario (add --json $OUT/<scenario>.json; it is rewritten after each engine):
    python tools/bench/compare.py --scenario lora14b --engines stock-lora-uncapped bnb-qlora bnb-qlora-ckpt trainstream-lora
    python tools/bench/compare.py --scenario lora14b_2k --engines stock-lora-uncapped bnb-qlora-ckpt trainstream-lora \
        --wrap-option recompute=True
    python tools/bench/compare.py --scenario full1.5b_2k --engines stock-bf16-uncapped stock-bf16 trainstream-auto \
        --wrap-option activation_offload=True
trainstream-lora's JSON row has build_s (meta -> bf16 blocks via the GPU -> host) and wrap_s (wrap()
quantizing 13.2 B values on the host, then moving the codes): setup, not step time.
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
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _compare_engines as engines

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
LINK_GBPS = 55.0  # pinned host<->H200 each way, measured (DESIGN.md); re-measured below when CUDA is present


def _failure(e: BaseException, where: str) -> str:
    """The outcome of an engine that raised: CUDA OOMs as "out of memory in <phase> (...)", the rest by type."""
    text = " ".join(str(e).split())
    if isinstance(e, torch.OutOfMemoryError) or (type(e) is RuntimeError and "out of memory" in text.lower()):
        return f"out of memory in {where} ({text[:160]})"
    return f"{where} raised {type(e).__name__}: {text[:400]}"


def _run_engine(engine: str, scenario: dict, wrap_options: dict, compile_mode: str | None = None,
                skip_streamed: bool = False) -> dict:
    """One engine in this process: returns step times, peak VRAM and what it decided."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cap = None if engine.endswith("-uncapped") else scenario["vram_gb"]
    if device.type == "cuda" and cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap * 1e9 / total, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mixed = engine == "stock-mixed"
    result: dict = {"engine": engine, "outcome": "ok", "median_s": None, "peak_gb": None,
                    "vram_cap_gb": cap if device.type == "cuda" else None}
    info: dict = {}

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None

    try:
        model, opt = engines.setup(engine, scenario, device, dtype, wrap_options, info)
        if compile_mode:
            info["compiled_blocks"] = engines.compile_blocks(model, compile_mode, skip_streamed)
    except engines.EngineUnavailable as e:
        return {**result, "outcome": str(e)}
    except Exception as e:  # an engine's failure is its outcome
        return {**result, **info, "outcome": _failure(e, info.get("failed_in", "setup")), "peak_gb": peak()}
    is_trainstream = engine.startswith("trainstream")
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    times, fwd_bwd, losses, retries = [], [], [], []
    timed = device.type == "cuda" and engine in engines.STOCK_TIMED
    try:
        for step in range(scenario["steps"]):
            info["failed_in"] = f"step {step + 1}"
            ids = torch.randint(0, vocab, (scenario["batch"], scenario["seq"]), generator=generator).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if timed:
                torch.cuda.synchronize()
                fwd_bwd.append(time.perf_counter() - start)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if device.type == "cuda":  # the allocator freed its cache and retried (a device sync each)
                retries.append(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        info.pop("failed_in", None)
    except Exception as e:
        result["outcome"] = _failure(e, info["failed_in"])
        result["traceback"] = traceback.format_exc()[-4000:]
    if is_trainstream:
        try:
            result.update(engines.trainstream_report(model))
        except Exception as e:  # a report after a failed step is a bonus
            result["report_error"] = f"{type(e).__name__}: {e}"
    warm = 2 if len(times) > 3 else 0
    trainable = engines.trainable(model)
    values = sum(p.numel() for p in trainable)
    result.update({
        "median_s": statistics.median(times[warm:]) if times else None,
        "steps_s": times,
        "alloc_retries": retries,
        "losses": losses,
        "fwd_bwd_s": statistics.median(fwd_bwd[warm:]) if fwd_bwd else None,
        "peak_gb": peak(),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_bytes_per_value": sum(p.numel() * p.element_size() for p in trainable) / values if values else None,
        **info,
    })
    return result


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
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "outcome": f"timed out after {timeout:.0f} s", "median_s": None, "peak_gb": None}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    return {"engine": engine, "outcome": "out of memory" if oom else "failed: " + " | ".join(tail),
            "median_s": None, "peak_gb": None}


def _host_adamw_rate(threads: int | None = None) -> float:
    """ts-adamw fp32-moment updates per second on this host (64 M values)."""
    import ts_adamw

    n = 64 << 20
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    out = torch.empty(n, dtype=torch.bfloat16)
    g16 = g.to(torch.bfloat16)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    ts_adamw.adamw_step(p, g16, m, v, step=1, param_out=out, **kw)
    start = time.perf_counter()
    for step in range(2, 7):
        ts_adamw.adamw_step(p, g16, m, v, step=step, param_out=out, **kw)
    return 5 * n / (time.perf_counter() - start)


def _link_rate() -> float:
    if not torch.cuda.is_available():
        return LINK_GBPS * 1e9
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * host.numel() / (time.perf_counter() - start)


def _wrap_option(text: str) -> tuple[str, object]:
    """argparse type for --wrap-option key=value: the value through ast.literal_eval, else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"takes key=value (for example recompute=True), not {text!r}")
    try:
        return key.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.strip(), value


def _lower_bound(r: dict, gpu: tuple[str, float] | None, link: float, adamw_rate: float) -> None:
    """Adds lower_bound_s and lower_bound_terms to a trainstream result (see the module docstring)."""
    placements = r.get("placements") or {}
    host_values = placements.get("host", {}).get("values", 0)
    mapped_values = placements.get("mapped", {}).get("values", 0)
    per_value = r.get("trainable_bytes_per_value") or 2
    paged_down, paged_up = engines.activation_link_bytes(r.get("activations"), len(r.get("steps_s") or []))
    weights = r.get("weights") or {}
    streamed = weights.get("load_bytes") or 0
    # A full fine-tune's streamed trained weights come back in their blocks' fetches (load_bytes), not as uploads.
    fetched = (weights.get("streaming") or {}).get("trained_bytes") or 0
    down = host_values * per_value + mapped_values * 12  # gradients leave the GPU in backward
    up = host_values * per_value - fetched + mapped_values * 12 + streamed  # weights come back
    # Forward, then backward, each bound by its busier direction: in forward the pages leave (device to
    # host) while the streamed blocks come in (about half of them: a block is fetched for forward and again
    # for backward); in backward the gradients leave while the page-ins and the other half come in.
    link_s = (max(paged_down, streamed / 2) + max(down, up - streamed / 2 + paged_up)) / link
    down, up = down + paged_down, up + paged_up
    terms = {"gpu_fwd_bwd": gpu[1] if gpu else None, "gpu_from": gpu[0] if gpu else None,
             "link": link_s, "host_adamw": host_values / adamw_rate,
             "link_bytes_down": down, "link_bytes_up": up}
    r["lower_bound_s"] = max(terms["gpu_fwd_bwd"] or 0.0, terms["link"], terms["host_adamw"])
    r["lower_bound_terms"] = terms


def _save(path: str | None, header: str, results: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=2, default=str)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="full1.5b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--engines", nargs="+", default=None, choices=ENGINES + EXTRA_ENGINES, metavar="ENGINE",
                        help="engines in the order to run (repeat one to interleave runs): "
                             f"{', '.join(ENGINES + EXTRA_ENGINES)}; default: {' '.join(ENGINES)} in full "
                             f"scenarios, {' '.join(engines.LORA_ENGINES)} in LoRA ones")
    parser.add_argument("--steps", type=int, default=None, help="steps per engine (default: the scenario's)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per engine process")
    parser.add_argument("--wrap-option", type=_wrap_option, action="append", default=[], metavar="KEY=VALUE",
                        help="extra trainstream.wrap() option for every trainstream engine (repeatable)")
    parser.add_argument("--compile-blocks", default=None, choices=engines.COMPILE_MODES, metavar="MODE",
                        help="torch.compile each block in place with this mode: " + ", ".join(engines.COMPILE_MODES))
    parser.add_argument("--compile-skip-streamed", action="store_true",
                        help="with --compile-blocks: blocks whose weights stream stay eager")
    parser.add_argument("--json", default=None, help="write the results here (also after each engine)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    scenario = dict(SCENARIOS[args.scenario])
    if args.steps:
        scenario["steps"] = args.steps
    wrap_options = dict(args.wrap_option)
    if args.child:
        result = _run_engine(args.child, scenario, wrap_options, args.compile_blocks, args.compile_skip_streamed)
        print("RESULT " + json.dumps(result, default=str), flush=True)
        sys.stderr.flush()
        os._exit(0)  # skip tearing down tens of GB and the engine's threads: the result is out
    lora = bool(scenario.get("lora"))
    engine_list = args.engines or (engines.LORA_ENGINES if lora else ENGINES)
    # No CUDA call in this process before the engines ran: they get the GPU to themselves.
    partial = f"scenario {args.scenario} {scenario} (partial: engines still running)"
    passthrough = [f"{key}={value!r}" for key, value in args.wrap_option]  # repr round-trips literal_eval
    results = []
    for engine in engine_list:
        skip = engines.not_applicable(engine, scenario)
        result = ({"engine": engine, "outcome": skip, "median_s": None, "peak_gb": None} if skip
                  else _child(engine, args.scenario, args.timeout, args.steps, passthrough, args.compile_blocks,
                              args.compile_skip_streamed))
        print(f"{engine}: {result.get('outcome')} {result.get('median_s') or ''}", flush=True)
        results.append(result)
        _save(args.json, partial, results)
    # Lower bound for each trainstream placement, from rates measured here and now.
    stock = engines.STOCK_TIMED
    gpu = next(((r["engine"], r["fwd_bwd_s"]) for r in results if r["engine"] in stock and r.get("fwd_bwd_s")), None)
    adamw_rate = _host_adamw_rate()
    link = _link_rate()
    for r in results:
        if r["engine"].startswith("trainstream") and r.get("placements") is not None:
            _lower_bound(r, gpu, link, adamw_rate)
    header = (f"scenario {args.scenario} {scenario}; GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
              f"{os.cpu_count()} CPUs")
    if wrap_options:
        header += f"; wrap options {wrap_options}"
    if args.compile_blocks:
        header += f"; blocks compiled (mode {args.compile_blocks}{', streamed ones eager' if args.compile_skip_streamed else ''})"
    header += f"; link {link / 1e9:.1f} GB/s; host AdamW {adamw_rate / 1e9:.2f} G values/s"
    print("\n" + header + "\n")
    print("| Engine | Median step | Peak VRAM | Lower bound | Outcome |\n|---|---|---|---|---|")
    for r in results:
        step = f"{r['median_s']:.3f} s" if r.get("median_s") is not None else "—"
        peak = f"{r['peak_gb']:.1f} GB" if r.get("peak_gb") else "—"
        bound = f"{r['lower_bound_s']:.3f} s" if r.get("lower_bound_s") else "—"
        print(f"| {r['engine']} | {step} | {peak} | {bound} | {r.get('outcome')} |")
    for r in results:
        terms = r.get("lower_bound_terms")
        if terms:
            gpu_text = (f"GPU {terms['gpu_fwd_bwd']:.3f} s ({terms['gpu_from']})" if terms["gpu_fwd_bwd"]
                        else "GPU not measured (run a stock engine in the same call)")
            print(f"lower bound {r['engine']}: max({gpu_text}, link {terms['link']:.3f} s, "
                  f"host AdamW {terms['host_adamw']:.3f} s)")
    _save(args.json, header, results)


if __name__ == "__main__":
    main()
