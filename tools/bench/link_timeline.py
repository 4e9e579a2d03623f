"""Where the link sits idle in a streamed step: reads a chrome trace of ``profile_step.py --trace`` and
prints, for one ``train_step`` window, how busy the host-to-device streams and the compute streams were
in time bins, and the longest gaps of the link with what the GPU and the host did meanwhile.

A step whose weights stream is bound by the link when the link never idles; every gap listed here is
time the step could lose (issue 11: 14B LoRA with a bf16 base, 0.54 s/step against a 0.44 s link bound).

    python tools/bench/profile_step.py --size 14b --engines trainstream-lora-bf16 --warmup 8 --steps 2 \\
        --wrap-option param_offload=\\"auto\\" --trace /tmp/step.json
    python tools/bench/link_timeline.py /tmp/step.json --bin-ms 20 --gaps 15

"Link" streams are those that carry a host-to-device copy in the window (their kernels, e.g. the decode
of packed weights, count as link time too); every other stream with kernels is "compute".
"""

from __future__ import annotations

import argparse
import gzip
import json

from profile_step import _kind, _union_us, sum_by_name


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def windows(events: list[dict], marker: str = "train_step") -> list[tuple[float, float]]:
    marks = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("name") == marker and e.get("cat") == "user_annotation")
    out = []
    for i, (start, end) in enumerate(marks):
        # The GPU finishes after the host leaves the annotation: a window runs to the next one's start.
        stop = marks[i + 1][0] if i + 1 < len(marks) else max(e["ts"] + e.get("dur", 0) for e in events if "ts" in e)
        out.append((start, max(stop, end)))
    return out


def gaps_of(busy: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    """The complement of the union of ``busy`` within [start, stop)."""
    out, cursor = [], start
    for a, b in sorted(busy):
        a, b = max(a, start), min(b, stop)
        if b <= cursor:
            continue
        if a > cursor:
            out.append((cursor, a))
        cursor = b
    if cursor < stop:
        out.append((cursor, stop))
    return out


def _clip(spans, start: float, stop: float) -> list[tuple[float, float]]:
    return [(max(a, start), min(b, stop)) for a, b, *_ in spans if a < stop and b > start]


def analyse(events: list[dict], window: tuple[float, float], bin_ms: float, top_gaps: int) -> dict:
    start, stop = window
    device = [(e["ts"], e["ts"] + e.get("dur", 0), _kind(e), e) for e in events
              if _kind(e) and "ts" in e and e["ts"] < stop and e["ts"] + e.get("dur", 0) > start]
    # A link stream spends more time copying host-to-device than running kernels (the compute stream's
    # own small uploads, e.g. a batch's ids, do not make it one).
    copying: dict = {}
    for a, b, k, e in device:
        sign = 1 if k == "h2d" else -1 if k == "kernel" else 0
        copying[e.get("tid")] = copying.get(e.get("tid"), 0.0) + sign * (b - a)
    link_streams = {tid for tid, balance in copying.items() if balance > 0}
    link = [(a, b) for a, b, _k, e in device if e.get("tid") in link_streams]
    compute = [(a, b, e) for a, b, k, e in device if k == "kernel" and e.get("tid") not in link_streams]
    host = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
            if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and "ts" in e
            and e["ts"] < stop and e["ts"] + e.get("dur", 0) > start and e.get("name") != "train_step"]
    # CUDA runtime calls: a synchronize that blocks the host shows here (a gap where the host waits).
    runtime = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "ts" in e
               and e["ts"] < stop and e["ts"] + e.get("dur", 0) > start]
    bins = []
    width = bin_ms * 1e3
    t = start
    while t < stop:
        u = min(t + width, stop)
        bins.append({"from_ms": (t - start) / 1e3, "link": _union_us(_clip(link, t, u)) / (u - t),
                     "compute": _union_us(_clip(compute, t, u)) / (u - t)})
        t = u
    gaps = sorted(gaps_of(link, start, stop), key=lambda g: g[0] - g[1])[:top_gaps]
    described = []
    for a, b in sorted(gaps):
        kernels = [(e["name"], (min(y, b) - max(x, a)) / 1e3) for x, y, e in compute if x < b and y > a]
        ops = [(e["name"], (min(y, b) - max(x, a)) / 1e3) for x, y, e in host if x < b and y > a]
        calls = [(e["name"], (min(y, b) - max(x, a)) / 1e3) for x, y, e in runtime if x < b and y > a]
        described.append({"at_ms": (a - start) / 1e3, "ms": (b - a) / 1e3,
                          "compute_ms": _union_us([(max(x, a), min(y, b)) for x, y, _e in compute
                                                   if x < b and y > a]) / 1e3,
                          "kernels": sum_by_name(kernels, 3), "host": sum_by_name(ops, 4),
                          "runtime": sum_by_name(calls, 2)})
    return {"window_ms": (stop - start) / 1e3, "link_ms": _union_us(link) / 1e3,
            "compute_ms": _union_us([(a, b) for a, b, _e in compute]) / 1e3,
            "link_streams": sorted(str(s) for s in link_streams), "bins": bins, "gaps": described}


def report(result: dict) -> None:
    print(f"window {result['window_ms']:.1f} ms: link busy {result['link_ms']:.1f} ms, compute busy "
          f"{result['compute_ms']:.1f} ms (link streams {', '.join(result['link_streams'])})")
    print("bins (from ms: link busy / compute busy):")
    line = []
    for b in result["bins"]:
        line.append(f"{b['from_ms']:6.0f}: {b['link']:4.0%}/{b['compute']:4.0%}")
        if len(line) == 5:
            print("  " + "   ".join(line))
            line = []
    if line:
        print("  " + "   ".join(line))
    print("longest link gaps, in time order (at ms, length ms, compute busy ms inside; top kernels; host ops; "
          "CUDA runtime calls):")
    for g in result["gaps"]:
        kernels = ", ".join(f"{n[:40]} {t:.1f}" for n, t in g["kernels"])
        ops = ", ".join(f"{n[:40]} {t:.1f}" for n, t in g["host"])
        calls = ", ".join(f"{n[:30]} {t:.1f}" for n, t in g.get("runtime", []))
        print(f"  {g['at_ms']:8.1f} {g['ms']:7.2f} {g['compute_ms']:7.2f}  | {kernels} | {ops} | {calls}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="chrome trace (.json or .json.gz) of profile_step.py --trace")
    parser.add_argument("--step", type=int, default=-1, help="which train_step window (default the last)")
    parser.add_argument("--bin-ms", type=float, default=20.0)
    parser.add_argument("--gaps", type=int, default=15, help="how many of the longest link gaps to list")
    parser.add_argument("--save-window", default=None, metavar="PATH.json.gz",
                        help="also write that window's events alone, gzipped (small enough to copy off a machine)")
    args = parser.parse_args()
    events = load_events(args.trace)
    found = windows(events)
    if not found:
        raise SystemExit(f"{args.trace}: no train_step annotation (record it with profile_step.py --trace)")
    window = found[args.step]
    report(analyse(events, window, args.bin_ms, args.gaps))
    if args.save_window:
        start, stop = window
        kept = [e for e in events if "ts" not in e or (e["ts"] < stop and e["ts"] + e.get("dur", 0) > start)]
        with gzip.open(args.save_window, "wt") as f:
            json.dump({"traceEvents": kept}, f)


if __name__ == "__main__":
    main()
