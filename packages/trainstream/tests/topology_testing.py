"""The worker of test_topology.py (spawned ranks import it by this module name)."""

from __future__ import annotations

import datetime
import os
import pathlib

import torch
import torch.distributed as dist
from distributed_testing import free_port, spawn_ranks


def _worker(rank: int, world: int, port: int, out: str, env: dict, machines: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if name not in env:
            os.environ.pop(name, None)
    import trainstream
    from trainstream import _topology

    if machines:  # two machines emulated: each rank its own hostname
        _topology.socket.gethostname = lambda: f"node{rank}"
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result = {"count": _topology.local_process_count(), "keys": _topology.machine_keys()}
    model = torch.nn.Linear(8, 8)
    try:
        trainstream.wrap(model, lr=1e-3)
        result["wrapped"] = True
        trainstream.unwrap(model)
    except ValueError as error:
        result["refused"] = str(error)
    torch.save(result, pathlib.Path(out) / f"topology-rank{rank}.pt")
    os._exit(0)


def run(tmp_path, env: dict, machines: bool = False) -> list[dict]:
    spawn_ranks(_worker, (2, free_port(), str(tmp_path), env, machines), 2, "the topology check", 120)
    return [torch.load(tmp_path / f"topology-rank{r}.pt", weights_only=False) for r in range(2)]
