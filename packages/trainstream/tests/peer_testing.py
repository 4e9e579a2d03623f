"""The ranks' side of test_peer_weights.py, in a module of its own: spawned processes unpickle the
worker by its module name, which must be importable from sys.path (a test module's name depends on
how pytest was invoked)."""

from __future__ import annotations

import datetime
import socket

import torch
import trainstream
from test_weights import _frozen_stack
from trainstream.weights import peer

STEPS = peer.SETUP_STEP + 3  # the pool serves the last three steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(peer_option, device="cpu"):
    model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True, peer=peer_option, threads=1,
                                  device=device)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 32, generator=g).to(device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    report = trainstream.memory_report(model)
    result = {"losses": losses, "params": [p.detach().cpu().clone() for p in model.parameters()],
              "streaming": report["params"]["streaming"], "peer_bytes": report["params"]["peer_bytes"],
              "events": [e for e in report["events"] if "peer" in e]}
    trainstream.unwrap(model)  # collective while a pool is in use
    return result


def worker(rank: int, world: int, port: int, out: str, device: str = "cpu", split: bool = False) -> None:
    """``device`` "cuda": every rank on GPU 0 (two processes sharing one GPU, where CUDA IPC works).
    ``split``: the last rank says it is on another machine (a Slurm-style launch: no LOCAL_WORLD_SIZE)."""
    torch.set_num_threads(1)
    if split and rank == world - 1:
        from trainstream import _topology
        from trainstream.weights import shared_host

        key = _topology.machine_key()
        _topology.machine_key = shared_host.machine_key = lambda: key + "|elsewhere"
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save({"host": train(False, device), "peer": train("auto", device)}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()
