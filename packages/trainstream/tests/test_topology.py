"""One rule for which processes share a machine (trainstream/_topology.py): the ranks of a process group whose
hostname, boot id and /dev/shm match; the launcher's count when it gives one, checked against the ranks at
wrap(). Two gloo ranks on this machine, with and without the launcher's variables, and as two machines."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from topology_testing import run as _run

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def test_without_the_launcher_s_word_the_ranks_on_this_machine_are_counted(tmp_path):
    """A Slurm-style launch (RANK / WORLD_SIZE, no LOCAL_WORLD_SIZE): both ranks see two local processes,
    so each plans with half the machine's RAM, and wrap() goes ahead."""
    results = _run(tmp_path, {})
    assert [r["count"] for r in results] == [2, 2]
    assert results[0]["keys"] == results[1]["keys"] and all(r.get("wrapped") for r in results)


def test_a_launcher_that_miscounts_is_refused_at_wrap(tmp_path):
    results = _run(tmp_path, {"LOCAL_WORLD_SIZE": "1"})
    assert [r["count"] for r in results] == [1, 1]  # the launcher's word, no collective
    for r in results:
        assert "LOCAL_WORLD_SIZE='1' says 1 processes share this machine, but 2 ranks" in r["refused"]


def test_two_machines_are_two_machines(tmp_path):
    results = _run(tmp_path, {}, machines=True)
    assert [r["count"] for r in results] == [1, 1] and results[0]["keys"][0] != results[0]["keys"][1]
    assert all(r.get("wrapped") for r in results)
