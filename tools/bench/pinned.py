"""Benchmark of ts-pinned: allocation from a reserved arena, and host-to-GPU copies.

    python tools/bench/pinned.py [--quick] [--json PATH]

(1) Allocation: blocks of random sizes from an arena reserved up front (only the
    allocations are timed) against torch.empty(..., pin_memory=True) for the same
    sizes. Blocks are allocated in rounds and freed between rounds, so at most
    --max-live-gb are live at once. torch's own pinned cache is emptied between
    rounds (each round pays for page-locking, as a first step does); a second torch
    row reuses that cache, for honesty. Without CUDA, pin_memory is impossible: the
    comparison is then against plain torch.empty, and the table says so.
(2) Copies of one large tensor to the GPU: pageable .to("cuda"), arena (pinned)
    non-blocking .to("cuda"), and ts_pinned.copy_to_device from pageable memory, in
    GB/s (median of several runs after a warm-up). Skipped without a GPU; the host
    side of copy_to_device (into a CPU tensor) is measured everywhere.
Prints markdown tables, machine first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

import torch
import ts_pinned
from ts_pinned import _core

MIB = 1 << 20
GIB = 1 << 30


def has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def machine() -> dict:
    info = {
        "gpu": torch.cuda.get_device_name(0) if has_gpu() else "none",
        "cpu_count": os.cpu_count(),
        "host_threads": _core.host_threads(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "ts_pinned": ts_pinned.__version__,
        "built_with_cuda": bool(_core.built_with_cuda),
        "arena_pinned": ts_pinned.PinnedArena(MIB).stats()["pinned"],
        "page_lock_budget_gib": round(ts_pinned.page_lock_budget().budget / GIB, 1),
    }
    return info


def empty_torch_host_cache() -> None:
    for fn in (getattr(torch.accelerator, "empty_host_cache", None), getattr(torch._C, "_host_emptyCache", None)):
        if fn is not None:
            try:
                fn()
                return
            except RuntimeError:
                pass


def rounds_of(sizes: list[int], max_live: int) -> list[list[int]]:
    """Consecutive groups of sizes, each summing to at most max_live bytes."""
    rounds, current, live = [], [], 0
    for size in sizes:
        if current and live + size > max_live:
            rounds.append(current)
            current, live = [], 0
        current.append(size)
        live += size
    if current:
        rounds.append(current)
    return rounds


def time_allocations(alloc, rounds: list[list[int]], between=None) -> list[float]:
    """Seconds per allocation; every round is freed (untimed) before the next."""
    times = []
    for sizes in rounds:
        live = []
        for size in sizes:
            start = time.perf_counter()
            t = alloc(size)
            times.append(time.perf_counter() - start)
            live.append(t)
        del live, t
        gc.collect()
        if between is not None:
            between()
    return times


def bench_allocation(name: str, count: int, low: int, high: int, max_live: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    sizes = [rng.randint(low, high) for _ in range(count)]
    rounds = rounds_of(sizes, max_live)
    largest_round = max(sum(r) for r in rounds)

    # The arena: reserve everything a round needs (plus a slab of headroom for
    # best-fit leftovers at slab ends), then time only the allocations.
    slab = min(GIB, max(64 * MIB, high * 8))
    arena = ts_pinned.PinnedArena(slab)
    start = time.perf_counter()
    arena.reserve(largest_round + slab)
    reserve_s = time.perf_counter() - start
    before = arena.stats()
    arena_times = time_allocations(lambda n: arena.empty(n, torch.uint8), rounds)
    after = arena.stats()
    arena = None  # its slabs go back to the OS before torch's turn
    gc.collect()

    pinned = has_gpu()
    rows = {}
    if pinned:
        empty_torch_host_cache()
        torch_cold = time_allocations(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True), rounds,
                                      between=empty_torch_host_cache)
        torch_warm = time_allocations(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True), rounds)
        empty_torch_host_cache()
        rows["torch.empty(pin_memory=True), cache emptied between rounds"] = torch_cold
        rows["torch.empty(pin_memory=True), reusing torch's pinned cache"] = torch_warm
    else:
        rows["torch.empty (pageable: no CUDA, pin_memory impossible)"] = time_allocations(
            lambda n: torch.empty(n, dtype=torch.uint8), rounds)

    def summary(times: list[float]) -> dict:
        return {"mean_us": statistics.fmean(times) * 1e6, "median_us": statistics.median(times) * 1e6,
                "max_us": max(times) * 1e6, "total_s": sum(times)}

    arena_summary = summary(arena_times)
    result = {
        "name": name,
        "blocks": count,
        "size_range_bytes": [low, high],
        "total_bytes": sum(sizes),
        "rounds": len(rounds),
        "max_live_bytes": largest_round,
        "reserve_s": reserve_s,
        "arena": arena_summary,
        "arena_host_alloc_calls_while_timed": after["host_alloc_calls"] - before["host_alloc_calls"],
        "arena_fallbacks_while_timed": after["arena_fallbacks"] - before["arena_fallbacks"],
        "baseline_pinned": pinned,
        "baselines": {},
    }
    for label, times in rows.items():
        s = summary(times)
        s["speedup_mean"] = s["mean_us"] / arena_summary["mean_us"]
        s["speedup_median"] = s["median_us"] / arena_summary["median_us"]
        result["baselines"][label] = s
    return result


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if has_gpu():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if has_gpu():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_host_staging(nbytes: int, repeats: int) -> dict:
    """Host side of copy_to_device (into a CPU tensor: slot fill + copy out) against one memcpy."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    memcpy = median_seconds(lambda: dst.copy_(src), repeats)
    staged = median_seconds(lambda: ts_pinned.copy_to_device(src, dst), repeats)
    assert torch.equal(src, dst)
    return {"bytes": nbytes, "torch_copy_gbps": nbytes / memcpy / 1e9, "copy_to_device_cpu_gbps": nbytes / staged / 1e9}


def bench_copies(nbytes: int, repeats: int) -> dict:
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # touched: no page faults in the timing
    arena = ts_pinned.PinnedArena(slab_bytes=nbytes)
    arena.reserve(nbytes)
    pinned = arena.empty(nbytes, torch.uint8).fill_(1)
    torch_pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    holder = {}

    def pageable_to():
        holder["x"] = pageable.to("cuda")

    def pinned_to():
        holder["x"] = pinned.to("cuda", non_blocking=True)

    def torch_pinned_to():
        holder["x"] = torch_pinned.to("cuda", non_blocking=True)

    def staged():
        ts_pinned.copy_to_device(pageable, dst)

    results = {"bytes": nbytes}
    for label, fn in [("pageable .to('cuda')", pageable_to), ("arena (pinned) .to('cuda', non_blocking=True)", pinned_to),
                      ("torch pin_memory .to('cuda', non_blocking=True)", torch_pinned_to),
                      ("ts_pinned.copy_to_device from pageable", staged)]:
        holder.clear()
        torch.cuda.empty_cache()
        seconds = median_seconds(fn, repeats)
        results[label] = nbytes / seconds / 1e9
    # The staged copy is bit-exact.
    dst.zero_()
    ts_pinned.copy_to_device(pageable, dst)
    torch.cuda.synchronize()
    results["copy_to_device_exact"] = bool(torch.equal(dst[:: 1 << 16].cpu(), pageable[:: 1 << 16])) and int(
        dst.sum(dtype=torch.int64)) == nbytes
    results["staging"] = ts_pinned.staging_stats()
    return results


def fmt_bytes(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n / 1024:g} KiB"


def print_tables(report: dict) -> None:
    m = report["machine"]
    print("# ts-pinned benchmark\n")
    print("| machine | |\n|---|---|")
    for key in ("gpu", "cpu_count", "host_threads", "cpu", "torch", "cuda", "built_with_cuda", "arena_pinned",
                "page_lock_budget_gib"):
        print(f"| {key} | {m[key]} |")
    print()
    for a in report["allocation"]:
        lo, hi = a["size_range_bytes"]
        print(f"## Allocation: {a['blocks']} blocks of {fmt_bytes(lo)}-{fmt_bytes(hi)} ({a['name']})\n")
        print(f"{a['total_bytes'] / GIB:.1f} GiB in {a['rounds']} round(s), at most {a['max_live_bytes'] / GIB:.2f} GiB "
              f"live; the arena reserved its memory first ({a['reserve_s']:.2f} s, untimed); host calls while timed: "
              f"{a['arena_host_alloc_calls_while_timed']}, fallbacks: {a['arena_fallbacks_while_timed']}.")
        if not a["baseline_pinned"]:
            print("No CUDA here: pin_memory=True is impossible, so the baseline is plain pageable torch.empty "
                  "(no page-locking) and the speed-up below is NOT the pinned comparison.")
        print()
        print("| allocator | mean µs / alloc | median µs | max µs | speed-up (mean) | speed-up (median) |")
        print("|---|---:|---:|---:|---:|---:|")
        ar = a["arena"]
        print(f"| ts_pinned arena (reserved) | {ar['mean_us']:.1f} | {ar['median_us']:.1f} | {ar['max_us']:.0f} | 1x | 1x |")
        for label, s in a["baselines"].items():
            print(f"| {label} | {s['mean_us']:.1f} | {s['median_us']:.1f} | {s['max_us']:.0f} | "
                  f"{s['speedup_mean']:.1f}x | {s['speedup_median']:.1f}x |")
        print()
    h = report["host_staging"]
    print(f"## Host side of copy_to_device ({h['bytes'] / MIB:.0f} MiB, CPU to CPU)\n")
    print("| copy | GB/s |\n|---|---:|")
    print(f"| torch dst.copy_(src) (one memcpy) | {h['torch_copy_gbps']:.1f} |")
    print(f"| ts_pinned.copy_to_device, CPU dst (fill slot + copy out) | {h['copy_to_device_cpu_gbps']:.1f} |")
    print()
    c = report.get("copies")
    if c is None:
        print("## Host-to-GPU copies\n\nSkipped: no CUDA GPU.")
        return
    print(f"## Host-to-GPU copies of {c['bytes'] / GIB:.2f} GiB (median of {report['repeats']})\n")
    print("| copy | GB/s |\n|---|---:|")
    for label, value in c.items():
        if isinstance(value, float):
            print(f"| {label} | {value:.1f} |")
    print(f"\ncopy_to_device bit-exact: {c['copy_to_device_exact']}; staging ring: {c['staging']['slots']} slots of "
          f"{c['staging']['slot_bytes'] / MIB:.0f} MiB, slot waits {c['staging']['slot_waits']}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks, less memory, smaller copies")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--max-live-gb", type=float, default=None, help="most GiB live at once (default 8, quick 1)")
    parser.add_argument("--copy-gb", type=float, default=None, help="size of the copied tensor (default 2, quick 0.5)")
    args = parser.parse_args(argv)

    max_live = int((args.max_live_gb or (1 if args.quick else 8)) * GIB)
    copy_bytes = int((args.copy_gb or (0.5 if args.quick else 2)) * GIB)
    blocks = 200 if args.quick else 1000
    repeats = 3 if args.quick else 7

    report = {"machine": machine(), "quick": args.quick, "repeats": repeats, "allocation": []}
    report["allocation"].append(bench_allocation("large", blocks, 1 * MIB, 64 * MIB, max_live))
    report["allocation"].append(bench_allocation("small", blocks, 4 << 10, 1 * MIB, max_live, seed=1))
    report["host_staging"] = bench_host_staging(min(copy_bytes, 512 * MIB), repeats)
    if has_gpu():
        report["copies"] = bench_copies(copy_bytes, repeats)
    print_tables(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
