"""peer=: streamed frozen blocks pooled across data-parallel ranks (ts-peer's host backend on the
CPU, over gloo) train bit for bit like host streaming, and the pool is what serves the fetches."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.multiprocessing as mp
import trainstream
from test_weights import _frozen_stack
from trainstream.memory import peer

STEPS = peer.SETUP_STEP + 3  # the pool serves the last three steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(peer_option):
    model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True, peer=peer_option, threads=1)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 32, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    report = trainstream.memory_report(model)
    result = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
              "streaming": report["params"]["streaming"], "peer_bytes": report["params"]["peer_bytes"],
              "events": [e for e in report["events"] if "peer" in e]}
    trainstream.unwrap(model)  # collective while a pool is in use
    return result


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save({"host": _train(False), "peer": _train("auto")}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_peer_pools_serve_streamed_blocks_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
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
