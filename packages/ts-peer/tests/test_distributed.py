"""Two ranks over gloo with the host backend (shared-memory pools, CPU tensors): every block
reaches every rank bit for bit from its owner, errors are raised on every rank alike, and
peer_support gives both ranks the same answer. One launch serves all the checks."""

from __future__ import annotations

import pytest

SIZES = [1000, 4096, 1, 0, 77777, 300]


@pytest.fixture(scope="module")
def ranks(run_ranks, tmp_path_factory):
    return run_ranks("host", 2, tmp_path_factory.mktemp("peer_gloo"))


def test_every_block_is_copied_bit_for_bit_on_every_rank(ranks):
    for r in ranks:
        assert r["owners"] == ranks[0]["owners"]
        assert r["owners"][4] is None  # 77777 bytes fit in neither rank's 50000
        assert r["equal"] == {"0": True, "1": True, "2": True, "3": True, "5": True, "typed": True}


def test_counters_split_local_and_remote_bytes(ranks):
    owners = ranks[0]["owners"]
    typed = 33 * 7 * 2
    for rank, r in enumerate(ranks):
        local = sum(n for n, o in zip(SIZES, owners) if o == rank) + (typed if rank == 1 else 0)
        total = sum(n for n, o in zip(SIZES, owners) if o is not None) + typed
        s = r["stats"]
        assert (s["peer_bytes"], s["local_bytes"], s["remote_bytes"]) == (total, local, total - local)
        assert s["copies"] == 6 and s["blocks"] == 6 and s["world"] == 2 and s["pool_bytes"] > 0


def test_misuse_and_duplicates_raise_on_every_rank(ranks):
    for r in ranks:
        assert r["wrong_size"].startswith("ValueError: dst has 3 bytes, block 0 has 1000")
        assert r["unknown"].startswith("KeyError")
        assert r["closed_copy"] == "RuntimeError: PeerPool: the pool is closed"
        assert r["duplicate"] == ("ValueError: PeerPool.exchange: block 'same' was placed by ranks 0 and 1; "
                                  "place each block on one rank (see assign_blocks)")
        assert r["duplicate_pool_bytes"] == 0
        assert r["shm_left"] == []


def test_peer_support_agrees_on_every_rank(ranks):
    ok, reason = ranks[0]["support"]
    assert not ok and reason.startswith("rank(s) 0, 1 cannot use CUDA peer pools")
    assert ranks[1]["support"] == ranks[0]["support"]


def test_pool_budgets_without_cuda_are_zero(ranks):
    assert ranks[0]["budgets"] == ranks[1]["budgets"] == [0, 0]


def test_pool_blocks_sets_up_in_one_call(ranks):
    for r in ranks:
        # w0..w4 = 1000..5000 bytes into two budgets of 5000: w4 | w3 + w0; w2 and w1 fit nowhere after that.
        assert r["auto_reason"] == "3 of 5 blocks (10000 bytes) pooled across 2 ranks; 2 left with their host source"
        assert r["auto_equal"] == {"w0": True, "w3": True, "w4": True}
        assert r["auto_mismatch"].startswith("ValueError: pool_blocks: rank 1's blocks differ from rank 0's")
