"""Under data parallel, the frozen weights every rank streams (param_offload=) are held once per
machine: one /dev/shm region that the ranks map, filled by the lowest rank (weights/shared_host.py).
2 gloo ranks on the CPU."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
import torch.multiprocessing as mp
import trainstream
from peer_testing import free_port
from shared_weights_testing import GLOBAL, STEPS, global_batch, worker
from test_weights import _frozen_stack
from trainstream.weights import shared_host
from trainstream.weights.streamer import WeightStreamer

pytestmark = pytest.mark.skipif(not os.path.isdir(shared_host.SHM_DIR), reason="no /dev/shm")


def _run(tmp_path, scenario: str, limit: float = 120.0, world: int = 2) -> tuple[list[dict], str]:
    prefix = f"trainstream-weights-test-{uuid.uuid4().hex[:8]}-"
    ctx = mp.start_processes(worker, args=(world, free_port(), str(tmp_path), scenario, prefix), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    try:
        while not all(not p.is_alive() for p in ctx.processes):
            assert time.monotonic() < deadline, f"2 ranks did not finish {scenario} within {limit} s"
            time.sleep(0.2)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) if (tmp_path / f"rank{r}.pt").exists()
               else None for r in range(world)]
    return results, prefix


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    results, prefix = _run(tmp_path_factory.mktemp("shared"), "train")
    for r in results:
        assert "failed" not in r, r.get("failed")
    return results, prefix


def _one_process() -> tuple[list[float], list[torch.Tensor]]:
    model, opt = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True, threads=1)
    losses = []
    for step in range(STEPS):
        loss = model(global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trainstream.unwrap(model)
    return losses, [p.detach().clone() for p in model.parameters()]


def test_shared_host_copy_trains_bit_for_bit_like_private_copies_and_like_one_process(trained):
    results, _ = trained
    for r in results:
        shared, private = r["shared"], r["private"]
        assert shared["losses"] == private["losses"]
        assert all(torch.equal(a, b) for a, b in zip(shared["params"], private["params"]))
        assert all(torch.equal(a, b) for a, b in zip(shared["params_after_unwrap"], private["params_after_unwrap"]))
    losses, params = _one_process()
    assert GLOBAL % 2 == 0
    mean = [(a + b) / 2 for a, b in zip(results[0]["shared"]["losses"], results[1]["shared"]["losses"])]
    assert mean == pytest.approx(losses, abs=1e-6)
    for rank in range(2):
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(results[rank]["shared"]["params"], params))


def test_the_machine_holds_the_streamed_weights_once(trained):
    results, _ = trained
    maps = [r["shared"]["maps"] for r in results]
    assert maps[0].keys() == maps[1].keys() and maps[0]
    for i in maps[0]:
        # Both ranks' host copies of block i are one file's pages: the same inode, in /dev/shm, already unlinked.
        assert maps[0][i] == maps[1][i], (i, maps)
        inode, path = maps[0][i]
        assert inode != "0" and path.startswith(os.path.join(shared_host.SHM_DIR, shared_host.PREFIX[:19]))
        assert path.endswith("(deleted)")
    for rank, r in enumerate(results):
        stats = r["shared"]["stats"]
        assert not r["shared"]["private_weights_bytes"]  # nothing of this process's arena holds streamed weights
        assert stats["private_host_bytes"] == 0 and stats["shared_host_bytes"] == stats["host_bytes"] > 0
        assert stats["local_ranks"] == 2 and stats["host_owner"] == (rank == 0)
        assert "one host copy for the 2 ranks" in stats["shared"]
        # Without sharing each rank holds its own copy: what the shared run saves.
        assert r["private"]["private_weights_bytes"] and r["private"]["stats"]["private_host_bytes"] > 0
        assert r["private"]["maps"][0] != r["shared"]["maps"][0]


def test_nothing_stays_in_dev_shm_and_unwrap_unmaps(trained):
    results, prefix = trained
    for r in results:
        assert r["shared"]["files_while_training"] == []  # unlinked once every rank mapped it
        assert r["shared"]["files_after_unwrap"] == []
        shared_maps = set(r["shared"]["maps"].values())
        assert not shared_maps & set(r["shared"]["maps_after_unwrap"].values())  # the mapping is gone
    assert not [n for n in os.listdir(shared_host.SHM_DIR) if n.startswith(prefix)]


@pytest.mark.parametrize("scenario", ["leader_dies", "follower_dies"])
def test_a_rank_dying_during_set_up_is_a_clear_error_and_leaves_no_file(tmp_path, scenario):
    results, prefix = _run(tmp_path, scenario)
    dead, alive = (0, 1) if scenario == "leader_dies" else (1, 0)
    assert results[dead] is None  # it ended mid-set-up
    r = results[alive]
    assert "failed" not in r, r.get("failed")
    assert r["error"].startswith("DistributedError") and "shared host copy" in r["error"], r["error"]
    assert r["seconds"] < 20.0 + 15
    assert r["files"] == []
    assert not [n for n in os.listdir(shared_host.SHM_DIR) if n.startswith(prefix)]


def test_no_room_in_dev_shm_keeps_private_copies_with_the_reason(tmp_path):
    results, prefix = _run(tmp_path, "no_room")
    for r in results:
        assert "failed" not in r, r.get("failed")
        stats = r["run"]["stats"]
        assert stats["shared_host_bytes"] == 0 and stats["private_host_bytes"] == stats["host_bytes"] > 0
        assert "a private host copy per rank" in stats["shared"] and "could not hold" in stats["shared"]
        assert r["run"]["files_while_training"] == []
    assert not [n for n in os.listdir(shared_host.SHM_DIR) if n.startswith(prefix)]


def test_ranks_alone_on_their_machine_keep_private_copies_beside_a_shared_one(tmp_path):
    results, prefix = _run(tmp_path, "two_machines", world=3)
    for r in results:
        assert "failed" not in r, r.get("failed")
    runs = [r["run"] for r in results]
    assert runs[0]["maps"] == runs[1]["maps"] and runs[0]["stats"]["local_ranks"] == 2
    assert runs[0]["stats"]["shared_host_bytes"] > 0 and runs[2]["stats"]["shared_host_bytes"] == 0
    assert "one rank on this machine" in runs[2]["stats"]["shared"]
    assert runs[2]["private_weights_bytes"]
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[2]["params"]))  # one model everywhere
    assert not [n for n in os.listdir(shared_host.SHM_DIR) if n.startswith(prefix)]


def test_other_streamed_blocks_on_a_rank_are_a_model_mismatch_on_every_rank(tmp_path):
    results, _ = _run(tmp_path, "mismatch")
    for r in results:
        assert "failed" not in r, r.get("failed")
        assert r["error"].startswith("ModelMismatch") and "streamed blocks" in r["error"], r["error"]
        assert r["files"] == []


def test_param_offload_on_one_rank_only_is_an_options_mismatch_on_every_rank(tmp_path):
    """Before: UnicodeDecodeError inside the shared host copy's set-up (its collectives paired with the other
    rank's model check); now both ranks refuse at once, naming the option, and nothing is left in /dev/shm."""
    results, _ = _run(tmp_path, "offload_mismatch")
    for result in results:
        assert "failed" not in result, result.get("failed")
        assert result["error"] is not None and result["error"].startswith("ModelMismatch"), result
        assert "different wrap() options" in result["error"] and "param_offload (streamed blocks)" in result["error"]
        assert result["seconds"] < 10.0 and result["files"] == [], result  # not the 20 s timeout


def test_one_process_keeps_a_private_copy():
    model, _ = trainstream.wrap(_frozen_stack(), lr=1e-3, param_offload=True)
    stats = model._trainstream_session.weights.stats()
    assert stats["shared_host_bytes"] == 0 and stats["private_host_bytes"] == stats["host_bytes"] > 0
    assert stats["shared"] is None and stats["local_ranks"] == 1
    trainstream.unwrap(model)


def test_bad_shared_option_is_refused():
    with pytest.raises(ValueError, match="shared="):
        WeightStreamer([torch.nn.Linear(2, 2)], [0], device=torch.device("cpu"), shared="yes")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_two_ranks_on_one_gpu_share_a_page_locked_host_copy(tmp_path):
    results, prefix = _run(tmp_path, "train_cuda", limit=300.0)
    for rank, r in enumerate(results):
        assert "failed" not in r, r.get("failed")
        shared, private = r["shared"], r["private"]
        assert shared["losses"] == private["losses"]
        assert all(torch.equal(a, b) for a, b in zip(shared["params"], private["params"]))
        assert all(shared["pinned"]), shared["stats"]["shared"]  # each process registered the mapping
        assert shared["stats"]["bounce_bytes"] == 0 and shared["stats"]["private_host_bytes"] == 0
        assert shared["stats"]["host_owner"] == (rank == 0)
        assert shared["files_after_unwrap"] == []
    assert results[0]["shared"]["maps"] == results[1]["shared"]["maps"]
    assert not [n for n in os.listdir(shared_host.SHM_DIR) if n.startswith(prefix)]
