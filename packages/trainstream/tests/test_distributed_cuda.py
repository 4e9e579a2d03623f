"""Data parallel with the model on CUDA: two gloo ranks sharing one GPU (host collectives, the CUDA
engine's copy streams), and two NCCL ranks on two GPUs (device buckets); both must train like one
process on the global batch."""

from __future__ import annotations

import pytest
import torch
from distributed_testing import STEPS, Branchy, branch_run, make_model, make_optimizer, run_ranks, train_steps, weights

TOL = 1e-6
TRAINING = ["plain", "clip", "accumulate", "accumulate_clip"]
SCENARIOS = [*TRAINING, "no_overlap", "unused"]
OPTIONS = {"plain": {}, "clip": {"clip": 0.05}, "accumulate": {"accumulation": 2},
           "accumulate_clip": {"clip": 0.05, "accumulation": 2}}


def _reference(clip=None, accumulation=1) -> dict:
    model = make_model().cuda()
    train_steps(model, make_optimizer(model), STEPS, 0, 1, accumulation, clip=clip)
    return weights(model)


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def _check(runs, world):
    for scenario in TRAINING:
        reference = _reference(**OPTIONS[scenario])
        for rank in range(world):
            result = runs[rank][scenario]
            assert "failed" not in result, result.get("failed")
            assert _diff(result["weights"], reference) <= TOL, (scenario, rank)
            overlap = result["distributed"]["overlap"]  # the reductions started during backward
            assert overlap["buckets_in_backward"] > 0 and overlap["dropped_steps"] == 0, (scenario, rank, overlap)
    branchy = Branchy().cuda()
    branch_run(branchy, make_optimizer(branchy), 0, 1)
    for rank in range(world):
        off, on = runs[rank]["no_overlap"], runs[rank]["accumulate_clip"]
        assert "failed" not in off, off.get("failed")
        assert _diff(off["weights"], on["weights"]) == 0.0  # overlap changes no bit
        unused = runs[rank]["unused"]
        assert "failed" not in unused, unused.get("failed")
        assert _diff(unused["weights"], weights(branchy)) <= TOL
        assert [s["dropped"] for s in unused["per_step"]] == [False, False, False, True, False]
    # each rank holds the state of the parameters it owns, wherever the placement put it
    state = [sum(p["state_bytes"] for p in runs[r]["plain"]["optimizer"]["placements"].values())
             for r in range(world)]
    assert all(s > 0 for s in state), state


@pytest.mark.cuda
def test_two_gloo_ranks_on_one_gpu_train_like_one_process(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check(run_ranks(2, SCENARIOS, tmp_path, limit=300, timeout=60, device="cuda"), 2)


@pytest.mark.cuda
@pytest.mark.multigpu
def test_two_nccl_ranks_on_two_gpus_train_like_one_process(tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check(run_ranks(2, SCENARIOS, tmp_path, limit=300, timeout=60, backend="nccl"), 2)
