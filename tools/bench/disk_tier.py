"""Benchmark: a wrapped training step with the optimizer state on disk (``nvme_path``) against the same step
with it in RAM, on this machine's CPU and disk.

One process; rounds alternate the engines ram, disk, ram, disk ... Each round wraps a fresh copy of the same
model (a stack of square fp32 linears: every weight large enough for the disk tier), runs one warm-up step and
``--steps`` timed steps (forward, backward, ``optimizer.step()``, which on the CPU returns with the updates
applied), checks that both engines' weights end bit for bit equal, and unwraps. ``disk`` puts every eligible
parameter's master weights and moments on disk (a host budget just above what that leaves in RAM).

A disk step reads and writes the whole state on disk once (12 bytes per value each way with fp32 moments). Its
bound: max(file bytes / the disk's read rate, file bytes / its write rate, twice the file bytes / its rate
reading and writing at once, the RAM step's median), the disk rates measured by ts-planner's probe on the same directory before and after the rounds. ``share_of_bound`` is
bound / step: how close a disk step comes to what the disk allows (the goal: 0.8 or more).

    python tools/bench/disk_tier.py                                   # 8 x 2048^2 (403 MB on disk), ~1 minute
    python tools/bench/disk_tier.py --width 1024 --rounds 2           # quick
    python tools/bench/disk_tier.py --out docs/results/cpu-disk-tier-<date>.json

The directory (``--dir``, default /var/tmp) must be on a disk: tmpfs is refused (its "disk" is RAM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import trainstream
import ts_planner

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _record  # noqa: E402
from disk_state import PROBE_TOLERANCE, filesystem  # noqa: E402

GB = 1e9


def make_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def run_engine(engine: str, args, directory: str, budget: int) -> dict:
    model = make_model(args.width, args.depth)
    extra = {"nvme_path": directory, "host_budget": budget} if engine == "disk" else {}
    model, opt = trainstream.wrap(model, lr=1e-3, moment_dtype="float32", **extra)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(args.tokens, args.width, generator=gen) for _ in range(args.steps + 1)]
    times = []
    tier = model._trainstream_session.engine.disk
    for i, x in enumerate(inputs):
        before = dict(tier.seconds) if tier is not None else None
        started = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i:  # the first step is the warm-up
            times.append(time.perf_counter() - started)
    report = trainstream.memory_report(model)["optimizer"]["disk"]
    weights = [p.detach().clone() for p in model.parameters()]
    trainstream.unwrap(model)
    run = {"seconds": statistics.median(times), "step_times": times, "weights": weights}
    if tier is not None:
        run.update(file_bytes=report["file_bytes"], disk_params=report["params"], direct_io=report["direct_io"],
                   last_step_disk_s={k: tier.seconds[k] - before[k] for k in before})
    return run


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure (not tmpfs)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="rows of each step's input")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--machine-note", default=None)
    args = parser.parse_args(argv)
    kind = filesystem(args.dir)
    if kind == "tmpfs":
        parser.error(f"{args.dir} is on tmpfs (RAM): give --dir on a disk")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ts-disk-tier-") as directory:
        all_on_disk = trainstream.plan(make_model(args.width, args.depth), moment_dtype="float32",
                                       nvme_path=directory, host_budget=1, check_memory=False)
        budget = all_on_disk.host_state_bytes  # exactly: every eligible parameter on disk
        # The probe moves as many bytes as the tier's file, best of 3: the virtual disk's rate drifts and a
        # larger, repeated probe is the fairer (faster, so safer) reference for the bound.
        probe = -(-all_on_disk.disk_state_bytes // (1 << 20)) * (1 << 20)
        before = ts_planner.measure_disk(directory, probe, repeats=3)
        engines: dict[str, list[dict]] = {"ram": [], "disk": []}
        same = True
        for r in range(args.rounds):
            weights = {}
            for engine in engines:
                run = run_engine(engine, args, directory, budget)
                weights[engine] = run.pop("weights")
                engines[engine].append({"round": r, **run})
                print(f"round {r} {engine}: {run['seconds']:.3f} s/step", flush=True)
            same = same and all(torch.equal(a, b) for a, b in zip(weights["ram"], weights["disk"]))
        after = ts_planner.measure_disk(directory, probe, repeats=3)
    read = max(before.read_gbps, after.read_gbps)  # the faster rate: the smaller, safer bound
    write = max(before.write_gbps, after.write_gbps)
    mixed = max(before.mixed_gbps, after.mixed_gbps)
    file_bytes = engines["disk"][0]["file_bytes"]
    ram_median = statistics.median(r["seconds"] for r in engines["ram"])
    bound = max(file_bytes / (read * GB), file_bytes / (write * GB), 2 * file_bytes / (mixed * GB), ram_median)
    for run in engines["disk"]:
        run["share_of_bound"] = bound / run["seconds"]
    bounds = {"disk": {"value": bound, "terms": {
        "file_bytes": file_bytes, "read_gbs": read, "write_gbs": write, "mixed_gbs": mixed,
        "read_s": file_bytes / (read * GB), "write_s": file_bytes / (write * GB),
        "mixed_s": 2 * file_bytes / (mixed * GB), "ram_step_s": ram_median}}}
    reasons = [f"disk, round {r['round']}: {r['seconds']:.4g} s is below its bound {bound:.4g} s"
               for r in engines["disk"] if r["seconds"] < bound]
    probes = [before.read_gbps, after.read_gbps]
    if max(probes) > min(probes) * (1 + PROBE_TOLERANCE):
        reasons.append(f"disk read probes {probes[0]:.2f} and {probes[1]:.2f} GB/s differ by more than "
                       f"{PROBE_TOLERANCE:.0%}")
    shares = [r["share_of_bound"] for r in engines["disk"]]
    data = _record.record(
        "cpu-disk", "disk-tier", engines, "seconds", args.rounds, "s", bounds, argv=None, gpu=False,
        width=args.width, depth=args.depth, tokens=args.tokens, steps=args.steps, filesystem=kind,
        disk_probes={"before": vars(before), "after": vars(after)}, same_bits=same,
        share_of_bound=_record.summary(shares), share_goal=0.8, loaded_machine=bool(reasons),
        loaded_reasons=reasons, machine_note=args.machine_note, total_s=time.perf_counter() - started,
        bounds_note="disk: max(the state file's bytes / the disk's read rate, / its write rate, twice the bytes / its "
                    "rate reading and writing at once, the RAM engine's median step): a step reads and writes the "
                    "whole state on disk once; the rates are ts-planner's measure_disk on the same directory with "
                    "as many bytes as the file, best of 3, the faster of before and after the rounds",
        engine_notes={"ram": "trainstream.wrap(moment_dtype='float32'): master and moments in RAM",
                      "disk": "the same with nvme_path and a host budget that puts every eligible parameter's "
                              "master and moments on disk"},
        figure_note="a run's figure: the median seconds of its round's timed steps (forward, backward, "
                    "optimizer.step()), after one warm-up step; engines alternated ram, disk, ram, disk ...")
    print(f"disk step median {statistics.median(r['seconds'] for r in engines['disk']):.3f} s (bound {bound:.3f} s: "
          f"{file_bytes / 1e6:.0f} MB each way at {read:.2f} / {write:.2f} / {mixed:.2f} GB/s read / write / both, "
          f"RAM step {ram_median:.3f} s); share of the "
          f"bound {statistics.median(shares):.0%} (min {min(shares):.0%}, goal 80 %); same bits: {same}")
    _record.write(args.out, data)
    return data


if __name__ == "__main__":
    main()
