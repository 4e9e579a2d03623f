"""peer=: streamed frozen blocks pooled across data-parallel ranks (ts-peer's host backend on the
CPU, over gloo) train bit for bit like host streaming, and the pool is what serves the fetches."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import trainstream
from peer_testing import free_port, worker
from test_weights import _frozen_stack
from trainstream.weights import peer


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_peer_pools_serve_streamed_blocks_bit_for_bit(tmp_path, monkeypatch, device):
    """On the CPU ts-peer's host backend; on CUDA two processes share GPU 0 and the pools are device
    memory the other rank reads through CUDA IPC."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one machine by its key, whatever the launcher sets
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), device), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        host, pooled = r["host"], r["peer"]
        assert pooled["losses"] == host["losses"]
        assert all(torch.equal(a, b) for a, b in zip(pooled["params"], host["params"]))
        assert pooled["streaming"]["source"] == "peer" and host["streaming"]["source"] == "host"
        assert pooled["peer_bytes"] > 0 and host["peer_bytes"] == 0
        assert any("pooled across 2 ranks" in e for e in pooled["events"])
        # Same fetches; those of the steps after the set-up came from the pool, the earlier ones from the host.
        assert pooled["streaming"]["h2d_bytes"] == host["streaming"]["h2d_bytes"]
        assert 0 < pooled["peer_bytes"] < pooled["streaming"]["h2d_bytes"]


def test_ranks_on_two_machines_keep_streaming_from_host_memory(tmp_path, monkeypatch):
    """Ranks launched as Slurm's srun does (no LOCAL_WORLD_SIZE), one on another machine (its machine key):
    peer='auto' is off with the reason on every rank, and training goes on from host memory. Before: the
    world size was taken for the machine's, and the pool's set-up failed at step 10."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    mp.spawn(worker, args=(2, free_port(), str(tmp_path), "cpu", True), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        host, asked = r["host"], r["peer"]
        assert asked["losses"] == host["losses"] and asked["streaming"]["source"] == "host"
        assert asked["peer_bytes"] == 0
        assert any("the group spans machines (2 ranks, 1 on this one)" in e for e in asked["events"]), asked["events"]


def test_peer_is_off_with_the_reason_without_ranks():
    model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True, peer="auto")
    for _ in range(peer.SETUP_STEP):
        model(torch.randn(2, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    events = [e for e in trainstream.memory_report(model)["events"] if "peer=" in e]
    assert model._trainstream_session.peer is None
    assert any("off: peer pools need data parallel ranks" in e for e in events)
    trainstream.unwrap(model)


@pytest.mark.parametrize("bad", [0, -5, "yes", 1.5, True])
def test_bad_peer_option_is_refused(bad):
    with pytest.raises(ValueError, match="peer="):
        trainstream.wrap(_frozen_stack(), lr=1e-3, peer=bad)


def test_peer_overhead_bench_smoke():
    """tools/bench/peer_overhead.py on the CPU (host backend): both ranks, both sources, equal losses."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[3] / "tools" / "bench" / "peer_overhead.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--width", "32", "--blocks", "3",
                           "--steps", "1", "--tokens", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("| peer | ") == 2 and done.stdout.count("| host | ") == 2
    assert done.stdout.count("| True |") == 4 and "pooled across 2 ranks" in done.stdout
