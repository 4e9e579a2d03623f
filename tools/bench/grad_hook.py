"""Host time inside trainstream's gradient hook, per trained tensor (issue 13), on host_overhead.py's model:
672 LoRA-sized tensors, host AdamW. The hook (``UpdateEngine._on_grad``) runs on the main thread during
backward for every host-placed tensor, so its cost adds to every step; this times it alone (a wrapper
around it), which the noisy whole-step numbers of host_overhead.py cannot resolve.

    python tools/bench/grad_hook.py                  # 48 blocks, 20 steps after 5, 3 runs

(docs/results/grad-hook-cpu-2026-12-02.log compared a cache of the hook's checked hyper-parameters against
checking them in every call, with an option of this script at commit 0286621: no measurable difference, so the
cache was removed.)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_overhead


def hook_times(blocks: int, width: int, steps: int, warmup: int) -> list[float]:
    """Mean microseconds per hook call in each step after `warmup`."""
    import trainstream
    from trainstream.engine.engine import UpdateEngine

    spent, calls = [0.0], [0]
    original = UpdateEngine._on_grad

    def timed(self, param):
        start = time.perf_counter()
        original(self, param)
        spent[0] += time.perf_counter() - start
        calls[0] += 1

    UpdateEngine._on_grad = timed
    try:
        model, opt = trainstream.wrap(host_overhead.build(blocks, width), lr=1e-3)
        batch = torch.randn(4, width)
        per_step = []
        for step in range(warmup + steps):
            spent[0], calls[0] = 0.0, 0
            model(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step >= warmup:
                per_step.append(spent[0] / max(calls[0], 1) * 1e6)
        trainstream.unwrap(model)
        return per_step
    finally:
        UpdateEngine._on_grad = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import trainstream

    print(f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, trainstream from "
          f"{os.path.dirname(trainstream.__file__)}")
    print(f"{args.blocks} blocks x {host_overhead.PROJECTIONS} projections x 2: "
          f"{args.blocks * host_overhead.PROJECTIONS * 2} trained tensors; {args.steps} steps after {args.warmup}")
    medians = []
    for run in range(args.runs):
        times = hook_times(args.blocks, args.width, args.steps, args.warmup)
        medians.append(statistics.median(times))
        print(f"run {run + 1}: gradient hook median {medians[-1]:.1f} us per tensor, best step {min(times):.1f} us")
    print(f"median of the runs' medians {statistics.median(medians):.1f} us per tensor")


if __name__ == "__main__":
    main()
