"""ts-quant benchmark: dequantize bandwidth, quantized_linear speed, weight error, CPU quantize rate.

    python tools/bench/quant.py [--json PATH] [--quick]

CUDA-only sections are skipped without a GPU. Shapes: W 13824 x 5120 (a Qwen2.5-14B MLP
projection) and x 512 x 5120. Prints markdown tables; --json writes every number.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import ts_quant
from ts_quant import _fused

N, K, M = 13824, 5120, 512
SPIN_CYCLES = 40_000_000  # about 20 ms of GPU spin: longer than the host needs to enqueue a timed loop
COPIES = 4  # weight copies the linear timings rotate through: 4 x 35 MB of NF4 exceeds the 60 MB L2


def cuda_time_ms(fn, iters: int = 40, warmup: int = 5, reps: int = 5) -> float:
    """Median GPU milliseconds per fn() call, launch gaps excluded.

    The GPU is held by a spin kernel while the host enqueues `iters` calls, so the events bracket
    back-to-back GPU work even where the host takes longer per call than the GPU (host_us_per_call
    reports that side).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def host_us_per_call(fn, iters: int = 40) -> float:
    """Host microseconds to issue one fn() call (the GPU held busy, so no call waits on it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / iters * 1e6


def rotating(fn, operands):
    """fn over the operands in turn: each call reads a buffer the last few calls did not, as layers do."""
    cycle = itertools.cycle(operands)
    return lambda: fn(next(cycle))


def copy_bandwidth() -> float:
    """Device-to-device copy rate in GB/s (bytes read + written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def dequantize_rates(w: torch.Tensor, copy_gbs: float) -> list[dict]:
    rows = []
    for fmt in ts_quant.FORMATS:
        q = ts_quant.quantize(w, fmt)
        out = torch.empty(w.shape, dtype=torch.bfloat16, device="cuda")
        scales = q.block_scales().view(torch.uint8) if fmt == "nvfp4" else q.block_scales()

        def run(q=q, out=out, scales=scales):
            ts_quant._native.native_dequantize(q.format, q.shape, q.data, scales, q.global_scale, q.block_size, out)

        ms = cuda_time_ms(run)
        moved = q.nbytes + out.numel() * 2
        gbs = moved / ms / 1e6
        rows.append({"format": fmt, "ms": ms, "GB/s": gbs, "% of copy": 100 * gbs / copy_gbs})
    return rows


def _bnb_linear():
    try:
        import bitsandbytes as bnb
    except Exception:
        return None
    return bnb


def fp8_parts(x: torch.Tensor, w: torch.Tensor, bf16_ms: float) -> list[dict]:
    """The FP8 scaled_mm path split into its per-call parts (sm_90 only)."""
    from ts_quant import _scaled

    q = ts_quant.quantize(w, "fp8")
    if ts_quant.linear_path(x, q) != "fp8_scaled_mm":
        return []
    codes, scales = _scaled.fp8_act_quant(x)
    parts = {
        "fp8 act-quant (fused kernel)": lambda: _scaled.fp8_act_quant(x),
        "fp8 act-quant (torch ops, old path)": lambda: _scaled.quantize_activation_1x128(x),
        "fp8 scaled_mm only": lambda: _scaled.fp8_scaled_mm(codes, scales, q, x.dtype),
        "fp8 total (quantized_linear)": lambda: ts_quant.quantized_linear(x, q),
    }
    return [{"path": name, "ms": (ms := cuda_time_ms(fn)), "x bf16": ms / bf16_ms, "host us/call": host_us_per_call(fn)}
            for name, fn in parts.items()]


def linear_rates(w: torch.Tensor) -> list[dict]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wbs = [w.to(torch.bfloat16) for _ in range(COPIES)]
    bf16 = rotating(lambda wb: F.linear(x, wb), wbs)
    bf16_ms = cuda_time_ms(bf16)
    rows = [{"path": "bf16 matmul", "ms": bf16_ms, "x bf16": 1.0, "host us/call": host_us_per_call(bf16)}]
    del wbs
    for fmt in ts_quant.FORMATS:
        qs = [ts_quant.quantize(w, fmt) for _ in range(COPIES)]
        ms = cuda_time_ms(rotating(lambda q: q.dequantize(torch.bfloat16), qs))
        rows.append({"path": f"{fmt} dequantize only", "ms": ms, "x bf16": ms / bf16_ms, "host us/call": 0.0})
        for fused in (True, False):
            ts_quant.configure_linear(fused=fused)
            path = ts_quant.linear_path(x, qs[0])
            if not fused and path not in ("dequantize", "dequantize_tiled"):
                continue  # the fused switch changes nothing for this format
            call = rotating(lambda q: ts_quant.quantized_linear(x, q), qs)
            ms = cuda_time_ms(call)
            rows.append({"path": f"{fmt} ({path})", "ms": ms, "x bf16": ms / bf16_ms,
                         "host us/call": host_us_per_call(call)})
        ts_quant.configure_linear(fused=True)
        del qs
    rows += fp8_parts(x, w, bf16_ms)
    bnb = _bnb_linear()
    if bnb is not None:
        packed, state = bnb.functional.quantize_4bit(w.to(torch.bfloat16), blocksize=64, quant_type="nf4")
        call = lambda: bnb.matmul_4bit(x, packed.t(), quant_state=state)  # noqa: E731
        ms = cuda_time_ms(call)
        rows.append({"path": f"bitsandbytes {bnb.__version__} matmul_4bit nf4", "ms": ms, "x bf16": ms / bf16_ms,
                     "host us/call": host_us_per_call(call)})
    return rows


def fused_sweep(w: torch.Tensor) -> list[dict]:
    """NF4 fused kernel against bf16 across batch sizes (the tile width follows m)."""
    rows = []
    qs = [ts_quant.quantize(w, "nf4") for _ in range(COPIES)]
    wbs = [w.to(torch.bfloat16) for _ in range(COPIES)]
    ts_quant.configure_linear(fused=False)
    for m in (16, 64, 128, 256, 512, 1024, 1536, 2048, 4096):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        bf16_ms = cuda_time_ms(rotating(lambda wb, x=x: F.linear(x, wb), wbs))
        unfused_ms = cuda_time_ms(rotating(lambda q, x=x: ts_quant.quantized_linear(x, q), qs))
        for tile_m in (0, 128) if m in (512, 2048) else (0,):
            ms = cuda_time_ms(rotating(lambda q, x=x, t=tile_m: _fused.fused_linear(x, q, None, t), qs))
            rows.append({"m": m, "tile_m": tile_m or "auto", "bf16 ms": bf16_ms, "nf4 fused ms": ms,
                         "x bf16": ms / bf16_ms, "TFLOP/s": 2 * m * N * K / ms / 1e9,
                         "nf4 dequantize+matmul ms": unfused_ms})
    ts_quant.configure_linear(fused=True)
    return rows


def weight_errors(device: str) -> list[dict]:
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for fmt in ts_quant.FORMATS:
        q = ts_quant.quantize(w, fmt)
        err = (q.dequantize(torch.float32) - w).norm() / w.norm()
        rows.append({"format": fmt, "relative error %": 100 * err.item(),
                     "bytes/weight": q.nbytes / w.numel()})
    return rows


def cpu_quantize_rates(quick: bool) -> list[dict]:
    w = torch.randn(4096 if quick else 8192, 4096).to(torch.bfloat16)
    rows = []
    for fmt in ts_quant.FORMATS:
        ts_quant.quantize(w, fmt)  # warm the pool
        start = time.perf_counter()
        reps = 3
        for _ in range(reps):
            ts_quant.quantize(w, fmt)
        seconds = (time.perf_counter() - start) / reps
        rows.append({"format": fmt, "M values/s": w.numel() / seconds / 1e6,
                     "GB/s of bf16 input": w.numel() * 2 / seconds / 1e9})
    return rows


def table(title: str, rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"### {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all results to this path")
    parser.add_argument("--quick", action="store_true", help="smaller CPU tensors")
    args = parser.parse_args()
    result = {"torch": torch.__version__, "host": platform.node(), "host_threads": ts_quant._core.host_threads(),
              "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()
        result["copy GB/s"] = copy_bandwidth()
        w = torch.randn(N, K, device="cuda")
        result["dequantize"] = dequantize_rates(w, result["copy GB/s"])
        result["linear"] = linear_rates(w)
        if ts_quant.linear_path(torch.empty(1, K, device="cuda", dtype=torch.bfloat16),
                                ts_quant.quantize(w[:128], "nf4")) == "fused_sm90":
            result["fused sweep"] = fused_sweep(w)
        del w
    result["weight error"] = weight_errors("cuda" if torch.cuda.is_available() else "cpu")
    result["cpu quantize"] = cpu_quantize_rates(args.quick)
    print(f"ts-quant bench: torch {result['torch']}, {result.get('device', 'no GPU')}, "
          f"{result['host_threads']} host threads")
    if "copy GB/s" in result:
        print(f"\nHBM copy: {result['copy GB/s']:.0f} GB/s\n")
        print(table(f"Dequantize W {N}x{K} to bf16 (bytes read + written)", result["dequantize"]))
        print(table(f"Forward x {M}x{K} @ W^T, W {N}x{K} (GPU time per call; {COPIES} weight copies rotated)",
                    result["linear"]))
        if "fused sweep" in result:
            print(table(f"NF4 fused vs bf16 over batch rows m (W {N}x{K})", result["fused sweep"]))
    print(table("Weight error on a 4096x4096 N(0,1) matrix (||dequant - w|| / ||w||)", result["weight error"]))
    print(table("CPU quantize (bf16 input)", result["cpu quantize"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
