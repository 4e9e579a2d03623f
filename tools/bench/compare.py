"""Head-to-head step times: trainstream against stock PyTorch (and DeepSpeed where installed).

Scenario full1.5b: a Qwen2.5-1.5B-shaped model (random init, bf16 weights), full
fine-tune, batch 4 x 512, VRAM capped at 24 GB with set_per_process_memory_fraction.
Each engine runs in a fresh process; the table shows the median step after
warm-up, the peak VRAM, and the lower bound
    max(GPU forward+backward time, host-link bytes / link rate, host AdamW time)
for the placement trainstream chose.

    python tools/bench/compare.py                       # every engine, full1.5b
    python tools/bench/compare.py --scenario tiny       # a CPU-sized smoke run
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

SCENARIOS = {
    # Qwen2.5-1.5B's published shape: 1.54 B parameters with tied embeddings.
    "full1.5b": dict(size="1.5b", batch=4, seq=512, vram_gb=24.0, steps=10),
    "tiny": dict(size="tiny", batch=2, seq=64, vram_gb=None, steps=6),
}
ENGINES = ["stock-bf16", "stock-mixed", "deepspeed-zero2", "trainstream-cpu", "trainstream-gpu", "trainstream-auto"]
# guard_params=False variants: what ordering reads after step() costs (pass them to --engines).
EXTRA_ENGINES = ["trainstream-cpu-noguard", "trainstream-auto-noguard"]
LINK_GBPS = 55.0  # pinned host<->H200 each way, measured (DESIGN.md); re-measured below when CUDA is present


def _model(size: str, device: torch.device, dtype: torch.dtype):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "packages", "trainstream", "src"))
    from trainstream.cli import SIZES
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SIZES[size], max_position_embeddings=4096, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype)


def _run_engine(engine: str, scenario: dict) -> dict:
    """One engine in this process: returns step times, peak VRAM and what it decided."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and scenario["vram_gb"]:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(scenario["vram_gb"] * 1e9 / total, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mixed = engine == "stock-mixed"
    model = _model(scenario["size"], device, torch.float32 if mixed else dtype)
    vocab = model.config.vocab_size
    extra: dict = {}
    if engine.startswith("stock"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    elif engine.startswith("trainstream"):
        import trainstream

        mode = engine.split("-")[1]
        model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-5),
                                      optimizer_mode=mode, offload=True if mode != "auto" else "auto",
                                      guard_params=not engine.endswith("-noguard"))
    elif engine == "deepspeed-zero2":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return {"engine": engine, "outcome": "not installed on this machine"}
        return {"engine": engine, "outcome": "installed but not wired in this script yet"}
    generator = torch.Generator().manual_seed(0)
    times, fwd_bwd = [], []
    for _ in range(scenario["steps"]):
        ids = torch.randint(0, vocab, (scenario["batch"], scenario["seq"]), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if device.type == "cuda" and engine == "stock-bf16":
            torch.cuda.synchronize()
            fwd_bwd.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if engine.startswith("trainstream"):
        report = trainstream.memory_report(model)
        extra["placements"] = report["optimizer"]["placements"]
        extra["events"] = report["events"]
        extra["transfers"] = report["transfers"]
    warm = 2 if len(times) > 3 else 0
    return {
        "engine": engine,
        "outcome": "ok",
        "median_s": statistics.median(times[warm:]),
        "steps_s": times,
        "fwd_bwd_s": statistics.median(fwd_bwd[warm:]) if fwd_bwd else None,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "params": sum(p.numel() for p in model.parameters()),
        **extra,
    }


def _child(engine: str, scenario_name: str, timeout: float, steps: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--scenario", scenario_name]
    if steps:
        cmd += ["--steps", str(steps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "outcome": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    oom = any("OutOfMemory" in t or "out of memory" in t for t in tail)
    return {"engine": engine, "outcome": "out of memory" if oom else "failed: " + " | ".join(tail)}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="full1.5b" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES + EXTRA_ENGINES,
                        help="engines in the order to run (repeat one to interleave runs)")
    parser.add_argument("--steps", type=int, default=None, help="steps per engine (default: the scenario's)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    scenario = dict(SCENARIOS[args.scenario])
    if args.steps:
        scenario["steps"] = args.steps
    if args.child:
        print("RESULT " + json.dumps(_run_engine(args.child, scenario), default=str), flush=True)
        return
    results = []
    for engine in args.engines:
        result = _child(engine, args.scenario, args.timeout, args.steps)
        print(f"{engine}: {result.get('outcome')} {result.get('median_s', '')}", flush=True)
        results.append(result)
    # Lower bound for each trainstream placement, from rates measured here and now.
    fwd_bwd = next((r.get("fwd_bwd_s") for r in results if r["engine"] == "stock-bf16" and r.get("fwd_bwd_s")), None)
    adamw_rate = _host_adamw_rate()
    link = _link_rate()
    for r in results:
        if not r["engine"].startswith("trainstream") or r.get("outcome") != "ok":
            continue
        host_values = r["placements"].get("host", {}).get("values", 0)
        mapped_values = r["placements"].get("mapped", {}).get("values", 0)
        link_bytes = host_values * 2 + mapped_values * 12  # bf16 grad down, bf16 weight up / fp32 state both ways
        terms = {"gpu_fwd_bwd": fwd_bwd or 0.0, "link": link_bytes / link, "host_adamw": host_values / adamw_rate}
        r["lower_bound_s"] = max(terms.values())
        r["lower_bound_terms"] = terms
    header = (f"scenario {args.scenario} {scenario}; GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
              f"{os.cpu_count()} CPUs; link {link / 1e9:.1f} GB/s; host AdamW {adamw_rate / 1e9:.2f} G values/s")
    print("\n" + header + "\n")
    print("| Engine | Median step | Peak VRAM | Lower bound | Outcome |\n|---|---|---|---|---|")
    for r in results:
        step = f"{r['median_s']:.3f} s" if r.get("median_s") is not None else "—"
        peak = f"{r['peak_gb']:.1f} GB" if r.get("peak_gb") else "—"
        bound = f"{r['lower_bound_s']:.3f} s" if r.get("lower_bound_s") else "—"
        print(f"| {r['engine']} | {step} | {peak} | {bound} | {r.get('outcome')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
