r"""Peer-GPU weight pools against host streaming (issue 16): two data-parallel ranks stream the same frozen
block stack (param_offload=True), first from host memory (peer=False), then with peer="auto" (each rank's
share of the blocks in a ts-peer pool, fetched GPU to GPU); median step time of the steps after the pool's
set-up step, the bytes each source served, and the peer events.

With ``--device cuda`` both ranks share GPU 0 (CUDA IPC works between two processes on one GPU; NCCL does
not, so the group is gloo): the "peer" copies are then device-to-device on one GPU, so this measures the
path's correctness and overhead, not NVLink (that needs two GPUs: issue 17). ``--device cpu`` uses
ts-peer's host backend (a smoke run of the script).

    python tools/bench/peer_overhead.py --device cuda                 # 16 blocks of 2 x 4096^2 bf16
    python tools/bench/peer_overhead.py --device cpu --width 64 --blocks 4 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

# Before any rank's init_process_group: trainstream imports torch._dynamo, and importing that while the
# default group exists keeps the group referenced after destroy_process_group (torch 2.13), so gloo's
# threads outlive it and, destroying a finished collective at interpreter exit, abort the process
# ("terminate called without an active exception"; 1 run in about 10 when imported late, 0 in 40 now).
import trainstream


class Block(torch.nn.Module):
    """A frozen two-matrix MLP (what streams) and a trained norm (what the optimizer updates)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, width, bias=False).requires_grad_(False)
        self.down = torch.nn.Linear(width, width, bias=False).requires_grad_(False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, width: int, blocks: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def train(peer_option, args, device: str) -> dict:
    from trainstream.weights import peer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Stack(args.width, args.blocks).to(device=device, dtype=dtype)
    model, opt = trainstream.wrap(model, lr=1e-4, param_offload=True, peer=peer_option, device=device)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(peer.SETUP_STEP + args.steps):
        x = torch.randn(args.tokens, args.width, generator=g).to(device=device, dtype=dtype)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    report = trainstream.memory_report(model)
    timed = times[peer.SETUP_STEP:]  # the pool serves the steps after its set-up step
    result = {"peer": peer_option, "median_s": statistics.median(timed), "steps_s": [round(t, 5) for t in times],
              "losses": losses, "h2d_bytes": report["params"]["streaming"].get("h2d_bytes"),
              "peer_bytes": report["params"]["peer_bytes"], "source": report["params"]["streaming"].get("source"),
              "events": [e for e in report["events"] if "peer" in e]}
    trainstream.unwrap(model)  # collective while a pool is in use
    return result


def worker(rank: int, world: int, out: str, args) -> None:
    device = args.device
    # A file store: no rank serves it, so no rank has to outlive the others.
    torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        runs = [train(False, args, device), train("auto", args, device)]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(runs, f)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the input per rank and step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps after the pool's set-up step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(2, out, args), nprocs=2, join=True)
        ranks = []
        for rank in range(2):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    bytes_per_block = 2 * args.width * args.width * (2 if args.device == "cuda" else 4)
    print(f"# {args.blocks} frozen blocks of {bytes_per_block / 2**20:.2f} MiB, {args.tokens} x {args.width} per rank, "
          f"2 ranks on one {torch.cuda.get_device_name() if args.device == 'cuda' else platform.processor() or 'cpu'}")
    print("| rank | peer= | median step | source | host->GPU bytes | peer bytes | losses equal host's |\n"
          "|---|---|---|---|---|---|---|")
    for rank, (host, pooled) in enumerate(ranks):
        for run in (host, pooled):
            print(f"| {rank} | {run['peer']} | {run['median_s'] * 1e3:.2f} ms | {run['source']} | {run['h2d_bytes']} "
                  f"| {run['peer_bytes']} | {run['losses'] == host['losses']} |")
    for rank, (_, pooled) in enumerate(ranks):
        for event in pooled["events"]:
            print(f"rank {rank} event: {event}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": ranks}, f, indent=2)
    same = all(pooled["losses"] == host["losses"] for host, pooled in ranks)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
