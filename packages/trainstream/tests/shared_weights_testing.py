"""The ranks' side of test_weights_shared.py, in a module of its own (spawned processes unpickle the
worker by module name, and a test module's name depends on how pytest was invoked)."""

from __future__ import annotations

import datetime
import os
import time
import traceback

import torch
import torch.distributed as dist
import trainstream
import ts_pinned
from test_weights import _frozen_stack
from trainstream.weights import shared_host
from trainstream.weights import streamer as weights

STEPS = 3
GLOBAL = 4  # samples per step of the global batch


def global_batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL, 8, 32, generator=torch.Generator().manual_seed(step))


def mapping_of(ptr: int) -> tuple[str, str] | None:
    """(inode, path) of the mapping of this process that holds address `ptr` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr < end:
                return fields[4], (fields[5].strip() if len(fields) > 5 else "")
    return None


def shm_files() -> list[str]:
    return sorted(n for n in os.listdir(shared_host.SHM_DIR) if n.startswith(shared_host.PREFIX))


def train(rank: int, world: int, device: str = "cpu") -> dict:
    """STEPS steps of param_offload=True on this rank's share of the global batches (all of it alone)."""
    model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True, threads=1, device=device)
    streamer = model._trainstream_session.weights
    ptrs = {i: b.host.data_ptr() for i, b in streamer.streamed.items()}
    n = GLOBAL // world
    losses = []
    for step in range(STEPS):
        loss = model(global_batch(step)[rank * n:(rank + 1) * n].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "params": [p.detach().to("cpu", copy=True) for p in model.parameters()],
              "maps": {i: mapping_of(ptr) for i, ptr in ptrs.items()},
              "private_weights_bytes": ts_pinned.pinned_stats()["by_tag"].get("weights", {}),
              "stats": streamer.stats(), "files_while_training": shm_files(),
              "pinned": [b.pinned for b in streamer.streamed.values()]}
    trainstream.unwrap(model)
    result["maps_after_unwrap"] = {i: mapping_of(ptr) for i, ptr in ptrs.items()}
    result["files_after_unwrap"] = shm_files()
    result["params_after_unwrap"] = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    return result


def _die_in(name: str):
    """Replaces shared_host.`name` by one that does its work, then ends the process abruptly."""
    original = getattr(shared_host, name)

    def dying(*args, **kwargs):
        original(*args, **kwargs)
        os._exit(3)
    setattr(shared_host, name, dying)


def worker(rank: int, world: int, port: int, out: str, scenario: str, prefix: str) -> None:
    torch.set_num_threads(1)
    import trainstream.distributed as tsd

    tsd.DEFAULT_TIMEOUT_S = 20.0
    shared_host.PREFIX = prefix  # this test's files only
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result = {}
    try:
        if scenario in ("train", "train_cuda"):
            device = "cuda:0" if scenario == "train_cuda" else "cpu"  # both ranks on the one GPU
            if scenario == "train_cuda":
                torch.cuda.set_device(0)
            result["shared"] = train(rank, world, device)
            original = weights.WeightStreamer.__init__

            def private(self, *args, **kwargs):  # one copy per rank, as before
                original(self, *args, **{**kwargs, "shared": False})
            weights.WeightStreamer.__init__ = private
            result["private"] = train(rank, world, device)
        elif scenario == "no_room":  # /dev/shm cannot hold the region: private copies, with the reason
            def full(fd, offset, length):
                raise OSError(28, "No space left on device")
            os.posix_fallocate = full
            result["run"] = train(rank, world)
        elif scenario == "two_machines":  # ranks 0 and 1 on one machine, the last alone on another
            if rank == world - 1:
                key = shared_host.machine_key()
                shared_host.machine_key = lambda: key + "|elsewhere"
            result["run"] = train(rank, world)
        elif scenario == "offload_mismatch":  # rank 1 streams nothing: its set-up runs other collectives
            started = time.monotonic()
            try:
                trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=rank == 0, threads=1)
                result["error"] = None
            except Exception as error:
                result["error"] = f"{type(error).__name__}: {error}"
            result["seconds"] = time.monotonic() - started
            result["files"] = shm_files()
        elif scenario == "mismatch":  # rank 1 streams other blocks
            try:
                trainstream.wrap(_frozen_stack(depth=4 if rank == 0 else 3), lr=1e-3, param_offload=True, threads=1)
                result["error"] = None
            except Exception as error:
                result["error"] = f"{type(error).__name__}: {error}"
            result["files"] = shm_files()
        else:  # "leader_dies" / "follower_dies": during the set-up
            if (scenario == "leader_dies") == (rank == 0):
                _die_in("_create" if rank == 0 else "_open")
            started = time.monotonic()
            try:
                trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True, threads=1)
                result["error"] = None
            except Exception as error:
                result["error"] = f"{type(error).__name__}: {error}"
            result["seconds"] = time.monotonic() - started
            result["files"] = shm_files()
    except Exception:
        result["failed"] = traceback.format_exc()
    torch.save(result, f"{out}/rank{rank}.pt")
    os._exit(0)  # no process-group teardown: a dead rank would make it wait
