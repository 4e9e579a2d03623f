"""One rank of the multi-process tests (run as a script by _launch.run_ranks): joins a gloo
group through a file store, runs the scenarios of its backend, and writes what it saw as JSON.

    python _dist_worker.py BACKEND RANK WORLD INIT_FILE OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import ts_peer
from ts_peer import _core


def block_data(block_id: int, nbytes: int) -> torch.Tensor:
    """Every rank can regenerate any block's bytes (what a copy must equal bit for bit)."""
    gen = torch.Generator().manual_seed(1000 + block_id)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    backend, rank, world, init_file, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", 0) if backend == "cuda" else torch.device("cpu")
    result: dict = {"rank": rank}

    # Blocks of odd sizes (alignment), one empty, split by the planner; bf16 and fp32 tensors too.
    sizes = [1000, 4096, 1, 0, 77777, 300]
    owners = ts_peer.assign_blocks(sizes, [50_000, 50_000, 50_000][:world])
    result["owners"] = owners
    pool = ts_peer.PeerPool(device=device, backend=backend)
    for i, (n, owner) in enumerate(zip(sizes, owners)):
        if owner == rank:
            pool.place(i, block_data(i, n).to(device) if i % 2 else bytes(block_data(i, n).tolist()))
    typed = torch.randn(33, 7, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    if rank == world - 1:
        pool.place("typed", typed.to(device))
    pool.exchange()
    stream = torch.cuda.Stream(device) if backend == "cuda" else None
    equal = {}
    for i, n in enumerate(sizes):
        if owners[i] is None:
            assert i not in pool
            continue
        dst = torch.full((n,), 7, dtype=torch.uint8, device=device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # the fill above runs first
        pool.copy_block(i, dst, stream)
        if stream is not None:
            stream.synchronize()
        equal[str(i)] = torch.equal(dst.cpu(), block_data(i, n))
    got = torch.zeros(33, 7, dtype=torch.bfloat16, device=device)
    pool.copy_block("typed", got)
    equal["typed"] = torch.equal(got.cpu().view(torch.int16), typed.view(torch.int16))
    result["equal"] = equal
    result["stats"] = pool.stats()
    result["wrong_size"] = error_of(lambda: pool.copy_block(0, torch.empty(3, dtype=torch.uint8, device=device)))
    result["unknown"] = error_of(lambda: pool.copy_block("nope", torch.empty(3, dtype=torch.uint8, device=device)))
    if backend == "cuda":
        result["open_during"] = _core.ipc_open_count()
    pool.close()
    result["closed_copy"] = error_of(lambda: pool.copy_block(0, torch.empty(1000, dtype=torch.uint8, device=device)))
    if backend == "cuda":
        result["open_after"] = _core.ipc_open_count()
    else:
        result["shm_left"] = [f for f in os.listdir("/dev/shm") if f.startswith(f"ts_peer_{os.getpid()}_")]

    # The same block id placed by two ranks: refused on every rank, and nothing stays allocated.
    twice = ts_peer.PeerPool(device=device, backend=backend)
    twice.place("same", b"abc")
    result["duplicate"] = error_of(twice.exchange)
    result["duplicate_pool_bytes"] = twice.pool_bytes

    if backend == "cuda":
        # One handle opened twice in one process: one mapping, closed with the last release.
        buf = ts_peer.DeviceBuffer(0, 1 << 20)
        exported = ts_peer.IpcHandle("cuda", *buf.ipc_export()[:2], 1 << 20, 0, _core.pci_bus_id(0), os.getpid())
        handles = [None] * world
        dist.all_gather_object(handles, exported.to_bytes())
        other = ts_peer.IpcHandle.from_bytes(handles[(rank + 1) % world])
        a = _core.ipc_open(other.handle, 0)
        b = _core.ipc_open(other.handle, 0)
        result["cache"] = [a == b, _core.ipc_open_count(), _core.ipc_release(other.handle, 0),
                           _core.ipc_release(other.handle, 0), _core.ipc_open_count()]
        result["release_again"] = error_of(lambda: _core.ipc_release(other.handle, 0))
        dist.barrier()
        buf.release()

    # The one-call set-up: same blocks on every rank, budgets that leave one block on the host.
    every = {f"w{i}": block_data(50 + i, 1000 * (i + 1)).to(device) for i in range(5)}
    kwargs = {} if backend == "cuda" else {"budgets": [5000, 5000][:world], "backend": "host"}
    auto, reason = ts_peer.pool_blocks(every, device=device, **kwargs)
    result["auto_reason"] = reason
    result["auto_equal"] = {}
    for block_id, want in every.items():
        if block_id in auto:
            got = torch.empty_like(want)
            auto.copy_block(block_id, got)
            result["auto_equal"][block_id] = torch.equal(got.cpu(), want.cpu())
    auto.close()
    mine = {"w0": b"x" * (3 if rank == 0 else 4)}
    result["auto_mismatch"] = error_of(lambda: ts_peer.pool_blocks(mine, device=device, **kwargs))

    result["support"] = list(ts_peer.peer_support(device=device if backend == "cuda" else None))
    result["budgets"] = ts_peer.pool_budgets(device=device if backend == "cuda" else None)
    if backend == "cuda":
        result["free"] = torch.cuda.mem_get_info(0)[0]
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
