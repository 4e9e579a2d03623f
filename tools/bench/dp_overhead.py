"""CPU benchmark of data parallel's overhead (issue 16): the same global batch trained by one process
and by N gloo ranks (each on its share), median step times, and where the ranks' time goes
(gradient reduction before the updates, the updates, the weight broadcast after them).

On one machine the N ranks share its cores, so compare the ranks' step with one process given the
same number of threads in all (--threads per rank; the single process gets ranks x threads).

    python tools/bench/dp_overhead.py                          # 2 ranks, 8 x 1024 MLP, 20 steps
    python tools/bench/dp_overhead.py --layers 2 --width 256 --steps 5    # a smoke run
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


def build(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 8))


def batches(steps: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(steps)]


def train(rank: int, world: int, args, timers: dict) -> list[float]:
    import trainstream

    model = build(args.layers, args.width)
    threads = args.threads if world > 1 else args.threads * args.ranks
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), threads=threads,
                                        max_grad_norm=args.max_grad_norm)
    if world > 1:
        dp = model._trainstream_session.engine.step_hook
        for name in ("before_step", "after_updates"):
            original = getattr(dp, name)

            def timed(engine, original=original, name=name):
                started = time.perf_counter()
                original(engine)
                timers[name].append(time.perf_counter() - started)

            setattr(dp, name, timed)
    times = []
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
    trainstream.unwrap(model)
    return times


def _rank(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks, timeout=datetime.timedelta(seconds=120))
    timers = {"before_step": [], "after_updates": [], "backward": []}
    times = train(rank, args.ranks, args, timers)
    queue.put((rank, times, timers))
    dist.barrier()
    dist.destroy_process_group()


def median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[2:] if len(values) > 4 else values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch and host AdamW threads per rank")
    parser.add_argument("--max-grad-norm", type=float, default=None)
    args = parser.parse_args()
    params = sum(p.numel() for p in build(args.layers, args.width).parameters())
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}")
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# load average before the run (the machine is shared): {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"# model: {args.layers} x Linear({args.width}) + head, {params / 1e6:.2f} M fp32 parameters; global batch "
          f"{args.batch}; {args.steps} steps, median after 2 warm-up steps; max_grad_norm={args.max_grad_norm}")

    torch.set_num_threads(args.threads * args.ranks)
    timers = {"backward": []}
    single = train(0, 1, args, timers)
    print(f"one process ({args.threads * args.ranks} threads), batch {args.batch}: "
          f"median step {median_after_warmup(single) * 1e3:.1f} ms (forward + backward "
          f"{median_after_warmup(timers['backward']) * 1e3:.1f} ms)")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    state_mb = 12 * params / 1e6  # fp32 master + two fp32 moments, before sharding
    for rank, times, timers in results:
        reduce_ms = median_after_warmup(timers["before_step"]) * 1e3
        share_ms = median_after_warmup(timers["after_updates"]) * 1e3
        print(f"rank {rank} of {args.ranks} ({args.threads} thread{'s' * (args.threads > 1)}), batch "
              f"{args.batch // args.ranks}: median step {median_after_warmup(times) * 1e3:.1f} ms "
              f"(forward + backward {median_after_warmup(timers['backward']) * 1e3:.1f} ms, gradient reduction {reduce_ms:.1f} ms, wait for updates + weight broadcast {share_ms:.1f} ms)")
    step_dp = max(median_after_warmup(t) for _, t, _ in results)
    print(f"overhead: {step_dp / median_after_warmup(single):.2f}x the one-process step; host optimizer state "
          f"per rank about {state_mb / args.ranks:.0f} MB instead of {state_mb:.0f} MB")


if __name__ == "__main__":
    main()
