"""Benchmark: ts_adamw's host engine and CUDA kernel against torch's AdamW, beside the memory bandwidth.

Measures, in one run: host memory bandwidth (ts_adamw's native threaded triad, streaming-store triad and
AdamW-pattern read-modify-write kernels; the best, counting the bytes DRAM moves), then G params/s and effective
GB/s for one AdamW step over ``--params`` parameters: ts_adamw with fp32 and bf16 moments vs torch's fused
and foreach CPU AdamW at the same thread count; with a GPU also the CUDA kernel (device state and zero-copy
pinned host state) vs a device copy and torch's fused CUDA AdamW; trainstream's configuration (bf16 grad,
bf16 param_out, ordinary vs streaming stores) and a cache-resident compute ceiling. Prints a markdown table;
``--json`` writes the rows. Effective bytes count what an ideal single pass moves, write-allocate included
(fp32: 28 bytes per parameter).

    python tools/bench/adamw.py                 # 256M parameters (~3 minutes on 16 cores)
    python tools/bench/adamw.py --params 16M    # quick
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import ts_adamw
from ts_adamw import _core

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}


def parse_count(text: str) -> int:
    """'256M', '1G', '500k' or a plain integer, as a parameter count."""
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}
    text = text.strip().lower()
    if text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


def median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of fn (seconds) after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def filled(n: int, device: str = "cpu", dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.empty(n, device=device).uniform_(-scale, scale)).to(dtype)


def host_bandwidth(n: int, repeats: int, threads: int) -> dict:
    """Host memory bandwidth (GB/s) from ts_adamw's native STREAM-style kernels on the shared host pool.

    Over max(n, 64M) fp32 elements per buffer, the median of ``repeats`` timed passes (after one warm-up):
    - ``triad``: a = b + s*c with ordinary stores: 12 bytes per element read/written, plus 4 that the CPU
      reads to write-allocate ``a``'s lines: counted as 16 (the bytes DRAM moves);
    - ``triad_nt``: the same with streaming stores (no write-allocate): 12;
    - ``rmw``: AdamW's own pattern, 4 streams read and 3 written in place: 28 (no write-allocate, every
      written line was read first).
    The best of the three is the host bandwidth; torch's copy and add (8 and 12 bytes, write-allocate not
    counted, as torch's own users would count them) are kept for reference only.
    """
    count = max(n, 1 << 26)

    def best(fn: Callable[[], float]) -> float:
        fn()
        return statistics.median(fn() for _ in range(max(1, repeats)))

    a, b, c = torch.empty(count), filled(count), filled(count)
    out = {
        "triad": 16 * count / best(lambda: _core.stream_triad(a, b, c, 3.0, threads=threads)) / 1e9,
        "triad_nt": 12 * count / best(lambda: _core.stream_triad(a, b, c, 3.0, threads=threads,
                                                                  nontemporal=True)) / 1e9,
        "torch_copy": 8 * count / median_seconds(lambda: a.copy_(b), repeats) / 1e9,
        "torch_add": 12 * count / median_seconds(lambda: torch.add(b, c, out=a), repeats) / 1e9,
    }
    d = torch.zeros(count)
    out["rmw"] = 28 * count / best(lambda: _core.stream_rmw(a, b, c, d, 1e-7, threads=threads)) / 1e9
    out["best"] = max(out["triad"], out["triad_nt"], out["rmw"])
    return out


def row(name: str, n: int, seconds: float, bytes_per_param: int, threads: int | str) -> dict:
    return {"variant": name, "threads": threads, "params": n, "seconds": seconds,
            "gparams_per_s": n / seconds / 1e9, "gbytes_per_s": bytes_per_param * n / seconds / 1e9}


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def host_bytes_per_param(moments: torch.dtype, grad: torch.dtype, out: torch.dtype | None, streaming: bool) -> int:
    """Bytes DRAM moves per parameter in one ideal pass: p read+write (8), grad read, both moments read+write,
    params_out written, plus the write-allocate read of params_out's lines unless it is streamed."""
    size = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
    total = 8 + size[grad] + 4 * size[moments]
    if out is not None:
        total += size[out] * (1 if streaming else 2)
    return total


def bench_ts_host(n: int, moments: torch.dtype, threads: int, repeats: int, grad: torch.dtype = torch.float32,
                  out: torch.dtype | None = None, streaming: str = "auto", label: str = "") -> dict:
    p, g = filled(n), filled(n, dtype=grad, scale=1e-2)
    m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    p_out = None if out is None else torch.zeros(n, dtype=out)
    state = {"step": 0}
    _core._set_streaming_stores(streaming)

    def step():
        state["step"] += 1
        ts_adamw.adamw_step(p, g, m, v, step=state["step"], threads=threads, param_out=p_out, **HYPER)

    try:
        t = median_seconds(step, repeats)
    finally:
        _core._set_streaming_stores("auto")
    streamed = out is not None and (streaming == "on" or (streaming == "auto" and n * p_out.element_size() >= 32 << 20))
    name = f"ts_adamw host, {_short(moments)} moments"
    if grad != torch.float32 or out is not None:
        name += f", {_short(grad)} grad"
    if out is not None:
        name += f", {_short(out)} param_out ({'streaming' if streamed else 'ordinary'} stores)"
    return row(name + label, n, t, host_bytes_per_param(moments, grad, out, streamed), threads)


def bench_ts_host_cached(moments: torch.dtype, threads: int, repeats: int) -> dict:
    """The host kernel on buffers small enough to stay in cache (128K parameters per thread), timed over
    many back-to-back steps: roughly the compute ceiling, to tell compute-bound from memory-bound."""
    n = (1 << 17) * threads
    p, g = filled(n), filled(n, scale=1e-2)
    m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    calls = 50

    def steps():
        for step in range(1, calls + 1):
            ts_adamw.adamw_step(p, g, m, v, step=step, threads=threads, **HYPER)

    t = median_seconds(steps, max(1, repeats)) / calls
    r = row(f"ts_adamw host, {_short(moments)} moments, cache-resident (compute ceiling)", n, t,
            host_bytes_per_param(moments, torch.float32, None, False), threads)
    r["cache_resident"] = True
    return r


def bench_torch(n: int, device: str, mode: str, threads: int | str, repeats: int) -> dict:
    p = torch.nn.Parameter(filled(n, device))
    p.grad = filled(n, device, scale=1e-2)
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], **{mode: True})
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t = median_seconds(opt.step, repeats, sync)
    return row(f"torch.optim.AdamW {mode} ({device})", n, t, 28, threads)


def bench_ts_cuda(n: int, moments: torch.dtype, zero_copy: bool, repeats: int) -> dict:
    where = "cpu" if zero_copy else "cuda"
    p = filled(n, where)
    m, v = torch.zeros(n, dtype=moments, device=where), torch.zeros(n, dtype=moments, device=where)
    if zero_copy:
        p, m, v = p.pin_memory(), m.pin_memory(), v.pin_memory()
    g = filled(n, "cuda", scale=1e-2)
    state = {"step": 0}

    def step():
        state["step"] += 1
        ts_adamw.cuda_adamw_step([p], [g], [m], [v], step=state["step"], **HYPER)

    t = median_seconds(step, repeats, torch.cuda.synchronize)
    kind = "zero-copy pinned host state" if zero_copy else "device state"
    bpp = 28 if moments == torch.float32 else 20
    if zero_copy:  # the grad lives on the GPU: only p, m, v cross the link, read and written back
        bpp -= 4
    return row(f"ts_adamw CUDA, {kind}, {'fp32' if moments == torch.float32 else 'bf16'} moments", n, t, bpp, "gpu")


def device_bandwidth(n: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write)."""
    src, dst = filled(n, "cuda"), torch.empty(n, device="cuda")
    t = median_seconds(lambda: dst.copy_(src), repeats, torch.cuda.synchronize)
    return 2 * 4 * n / t


def run(n: int, threads: int, repeats: int, zero_copy_params: int) -> dict:
    torch.set_num_threads(threads)
    result = {"params": n, "threads": threads, "host_isa": ts_adamw.host_isa(), "cpu": platform.processor(),
              "torch": torch.__version__, "rows": []}
    bandwidth = host_bandwidth(n, repeats, threads)
    result["host_bandwidth"] = bandwidth
    result["host_bandwidth_gbs"] = bandwidth["best"]
    rows = result["rows"]
    rows.append(bench_ts_host(n, torch.float32, threads, repeats))
    rows.append(bench_ts_host(n, torch.bfloat16, threads, repeats))
    rows.append(bench_torch(n, "cpu", "fused", threads, repeats))
    rows.append(bench_torch(n, "cpu", "foreach", threads, max(1, repeats - 1)))
    # The configuration trainstream runs: fp32 master, bf16 grad in, bf16 weights out for the GPU.
    for moments in (torch.float32, torch.bfloat16):
        for streaming in ("off", "on"):
            rows.append(bench_ts_host(n, moments, threads, repeats, grad=torch.bfloat16, out=torch.bfloat16,
                                      streaming=streaming))
    rows.append(bench_ts_host_cached(torch.float32, threads, repeats))
    rows.append(bench_ts_host_cached(torch.bfloat16, threads, repeats))
    for r in rows:
        if not r.get("cache_resident"):
            r["of_bandwidth"] = r["gbytes_per_s"] / result["host_bandwidth_gbs"]
    if torch.cuda.is_available() and ts_adamw.built_with_cuda:
        result["gpu"] = torch.cuda.get_device_name()
        result["device_bandwidth_gbs"] = device_bandwidth(n, repeats) / 1e9
        gpu_rows = [bench_ts_cuda(n, torch.float32, False, repeats), bench_ts_cuda(n, torch.bfloat16, False, repeats),
                    bench_torch(n, "cuda", "fused", "gpu", repeats),
                    bench_ts_cuda(zero_copy_params, torch.float32, True, repeats)]
        for r in gpu_rows[:3]:
            r["of_bandwidth"] = r["gbytes_per_s"] / result["device_bandwidth_gbs"]
        rows.extend(gpu_rows)
    fused = next(r for r in rows if r["variant"] == "torch.optim.AdamW fused (cpu)")
    for r in rows:
        if r["threads"] != "gpu":
            r["vs_torch_fused"] = r["gparams_per_s"] / fused["gparams_per_s"]
    return result


def table(result: dict) -> str:
    lines = [f"{result['params'] / 1e6:.0f}M parameters, {result['threads']} threads, ISA {result['host_isa']}, "
             f"host bandwidth {result['host_bandwidth_gbs']:.1f} GB/s"
             + (f", {result['gpu']} copy bandwidth {result['device_bandwidth_gbs']:.0f} GB/s" if "gpu" in result
                else ""),
             "host bandwidth (GB/s, bytes DRAM moves): " + ", ".join(
                 f"{k} {v:.1f}" for k, v in result["host_bandwidth"].items() if k != "best"),
             "",
             "| variant | threads | G params/s | GB/s | % of measured bandwidth | vs torch fused CPU |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        share = f"{100 * r['of_bandwidth']:.0f}%" if "of_bandwidth" in r else "-"
        speedup = f"{r['vs_torch_fused']:.2f}x" if "vs_torch_fused" in r else "-"
        lines.append(f"| {r['variant']} | {r['threads']} | {r['gparams_per_s']:.2f} | {r['gbytes_per_s']:.1f} | "
                     f"{share} | {speedup} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("256M"), help="parameters (256M, 16M, ...)")
    parser.add_argument("--threads", type=int, default=ts_adamw.host_threads(), help="threads (default: cores)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant (median)")
    parser.add_argument("--zero-copy-params", type=parse_count, default=None,
                        help="parameters for the zero-copy CUDA row (default: min(params, 64M))")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    zero_copy = args.zero_copy_params or min(args.params, parse_count("64M"))
    result = run(args.params, args.threads, args.repeats, zero_copy)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
