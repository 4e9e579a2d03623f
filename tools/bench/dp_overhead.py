"""CPU benchmark of data parallel's overhead (issue 16): the same global batch trained by one process
and by N gloo ranks (each on its share), median step times, and where the ranks' time goes
(forward + backward, which with overlap also starts the gradient reductions; what is left of the
reduction at step(); the updates and the weight broadcast after them), with the reductions started
during backward (overlap on, the default) and only at step() (off).

On one machine the N ranks share its cores, so compare the ranks' step with one process given the
same number of threads in all (--threads per rank; the single process gets ranks x threads).

    python tools/bench/dp_overhead.py                          # 2 ranks, 8 x 1024 MLP, 20 steps
    python tools/bench/dp_overhead.py --layers 2 --width 256 --steps 5    # a smoke run
    python tools/bench/dp_overhead.py --overlap on                 # one mode only (default: both, alternating)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import trainstream  # before init_process_group: see peer_overhead.py's note on importing torch._dynamo late


def build(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 8))


def batches(steps: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(steps)]


def train(rank: int, world: int, args, timers: dict, overlap: bool = True) -> list[float]:
    model = build(args.layers, args.width)
    threads = args.threads if world > 1 else args.threads * args.ranks
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), threads=threads,
                                        max_grad_norm=args.max_grad_norm)
    if world > 1:
        dp = model._trainstream_session.engine.step_hook
        dp.overlap = overlap
        for name in ("before_step", "after_updates"):
            original = getattr(dp, name)

            def timed(engine, original=original, name=name):
                started = time.perf_counter()
                original(engine)
                timers[name].append(time.perf_counter() - started)

            setattr(dp, name, timed)
    times = []
    marks = {k: len(v) for k, v in timers.items()}
    n = args.batch // world
    for x, y in batches(args.steps, args.batch, args.width):
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        started = time.perf_counter()
        torch.nn.functional.mse_loss(model(x), y).backward()
        timers["backward"].append(time.perf_counter() - started)
        optimizer.step()
        optimizer.zero_grad()
        optimizer.synchronize()
        times.append(time.perf_counter() - started)
    if world > 1:
        counts = dp.report()["overlap"]
        timers["buckets_in_backward"].append(counts["buckets_in_backward"])
        timers["buckets_at_step"].append(counts["buckets_at_step"])
    trainstream.unwrap(model)
    warmup = 2 if len(times) > 4 else 0
    for name in ("before_step", "after_updates", "backward"):
        if name in timers:
            del timers[name][marks[name]:marks[name] + warmup]
    return times[warmup:]


def _rank(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks, timeout=datetime.timedelta(seconds=120))
    results = {}
    for _ in range(args.repeats):  # the modes alternate, so a change in the machine's load hits both
        for mode in _modes(args):
            times, timers = results.setdefault(mode, ([], _timers()))
            times += train(rank, args.ranks, args, timers, overlap=mode == "on")
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _timers() -> dict:
    return {"before_step": [], "after_updates": [], "backward": [], "buckets_in_backward": [], "buckets_at_step": []}


def _modes(args) -> list[str]:
    return ["on", "off"] if args.overlap == "both" else [args.overlap]


def median_ms(values: list[float]) -> float:
    """The median in milliseconds (train() has dropped its warm-up steps)."""
    return statistics.median(values) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch and host AdamW threads per rank")
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--overlap", choices=["both", "on", "off"], default="both",
                        help="gradient reductions started during backward (on), at step() only (off), or both")
    parser.add_argument("--repeats", type=int, default=2, help="runs of --steps steps per mode, alternating")
    args = parser.parse_args()
    params = sum(p.numel() for p in build(args.layers, args.width).parameters())
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# load average before the run (the machine is shared): {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# model: {args.layers} x Linear({args.width}) + head, {params / 1e6:.2f} M fp32 parameters; global batch "
          f"{args.batch}; {args.steps} steps, median after 2 warm-up steps; max_grad_norm={args.max_grad_norm}; "
          f"data parallel: {args.repeats} runs per overlap mode ({', '.join(_modes(args))}), alternating")

    torch.set_num_threads(args.threads * args.ranks)
    timers = {"backward": []}
    single = statistics.median(train(0, 1, args, timers))
    print(f"one process ({args.threads * args.ranks} threads), batch {args.batch}: "
          f"median step {single * 1e3:.1f} ms (forward + backward "
          f"{median_ms(timers['backward']):.1f} ms)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=1800) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    state_mb = 12 * params / 1e6  # fp32 master + two fp32 moments, before sharding
    steps = {}
    for mode in _modes(args):
        for rank, per_mode in results:
            times, timers = per_mode[mode]
            reduce_ms = median_ms(timers["before_step"])
            share_ms = median_ms(timers["after_updates"])
            started = sum(timers["buckets_in_backward"])
            at_step = sum(timers["buckets_at_step"])
            print(f"overlap {mode:3}: rank {rank} of {args.ranks} ({args.threads} thread{'s' * (args.threads > 1)}), "
                  f"batch {args.batch // args.ranks}: median step {statistics.median(times) * 1e3:.1f} ms "
                  f"(forward + backward {median_ms(timers['backward']):.1f} ms, gradient reduction "
                  f"at step() {reduce_ms:.1f} ms, wait for updates + weight broadcast {share_ms:.1f} ms; buckets "
                  f"started during backward {started}, at step() {at_step})")
        steps[mode] = max(statistics.median(per_mode[mode][0]) for _, per_mode in results)
        print(f"overlap {mode:3}: {steps[mode] / single:.2f}x the one-process step")
    if len(steps) == 2:
        print(f"overlap on / off: {steps['on'] / steps['off']:.2f}x the step time ({steps['on'] * 1e3:.1f} ms against "
              f"{steps['off'] * 1e3:.1f} ms)")
    print(f"host optimizer state per rank about {state_mb / args.ranks:.0f} MB instead of {state_mb:.0f} MB")


if __name__ == "__main__":
    main()
