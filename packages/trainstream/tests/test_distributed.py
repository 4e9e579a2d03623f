"""Data parallel on the CPU with gloo: 2 and 3 spawned ranks train exactly like one process on the
global batch (plain, clipping, accumulation with clipping), each keeps its share of the optimizer
state, checkpoints move between world sizes, and mismatched models or a dead rank give errors on
every rank instead of a hang. Gradient reductions start during backward (and the cases where they
cannot be used are redone at step(), training the same). Each world size is one spawn running every scenario (distributed_testing)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import trainstream
import trainstream.distributed as tsd
from distributed_testing import (
    HAND_SET_STEPS,
    SAVE_AT,
    STEPS,
    Branchy,
    branch_run,
    discard_run,
    hand_set,
    make_model,
    make_optimizer,
    run_ranks,
    train_steps,
    unfreeze_run,
    weights,
)

TOL = 1e-6
TRAINING = ["plain", "clip", "accumulate", "accumulate_clip"]
OVERLAP = ["no_overlap", "unused"]  # on 2 and 3 ranks
OPTIONS = {"plain": {}, "clip": {"clip": 0.05}, "accumulate": {"accumulation": 2},
           "accumulate_clip": {"clip": 0.05, "accumulation": 2}}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def two(out):
    return run_ranks(2, [*TRAINING, *OVERLAP, "mid_window", "hand_set", "discard", "rewrap", "unfreeze", "forced_off", "mismatch_shape",
                         "mismatch_settings", "attention_agree", "bf16_moments"], out)


@pytest.fixture(scope="module")
def three(out, two):  # `two` wrote the checkpoint that "resume" loads
    _save_in_one_process(out / "dcp-1process")  # the sharded checkpoint "resume_dcp_alone" loads
    return run_ranks(3, [*TRAINING, *OVERLAP, "resume", "resume_optimizer_only", "resume_dcp", "resume_dcp_alone",
                         "bf16_moments", "rank_dies"], out)


def _save_in_one_process(folder) -> None:
    """save_checkpoint() of one process after SAVE_AT steps on the global batches: every field saved whole."""
    model = make_model()
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1)
    try:
        train_steps(model, optimizer, SAVE_AT, 0, 1)
        tsd.save_checkpoint(model, optimizer, folder)
    finally:
        trainstream.unwrap(model)


def _reference(clip=None, accumulation=1) -> dict:
    """Stock torch AdamW (and torch's clipping) in one process on the whole global batch."""
    model = make_model()
    train_steps(model, make_optimizer(model), STEPS, 0, 1, accumulation, clip=clip)
    return weights(model)


def _result(runs, scenario, rank):
    result = runs[rank][scenario]
    assert "failed" not in result, result.get("failed")
    return result


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("scenario", TRAINING)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_like_one_process_on_the_global_batch(two, three, world, scenario):
    runs = two if world == 2 else three
    reference = _reference(**OPTIONS[scenario])
    first = _result(runs, scenario, 0)["weights"]
    untrained = weights(make_model())
    assert _max_diff(first, untrained) > 1e-3  # it trained
    assert _max_diff(first, reference) <= TOL
    for rank in range(1, world):
        assert _max_diff(_result(runs, scenario, rank)["weights"], first) == 0.0  # the ranks agree exactly
    assert all(_result(runs, scenario, rank)["session_freed"] for rank in range(world))  # no cycle left


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_moments_of_split_parameters_are_the_bits_of_one_process(two, three, world):
    """Stochastically rounded bf16 moments: a parameter split between ranks rounds each piece with the bits its
    values draw in one process (ts-adamw's offsets), so the masters, moments and weights are those of one
    process bit for bit, given the same gradients (distributed_testing._bf16_moments)."""
    runs = two if world == 2 else three
    results = [_result(runs, "bf16_moments", rank) for rank in range(world)]
    # A cut falls inside a parameter: some rank keeps a piece that starts after its value 0.
    assert any(span is not None and span[0] > 0 for r in results for span in r["dp"]["spans"].values())
    untrained = weights(make_model())
    for rank, result in enumerate(results):
        dp, alone = result["dp"], result["alone"]
        assert _max_diff(alone["weights"], untrained) > 1e-3  # it trained
        assert sorted(dp["state"]) == sorted(alone["state"]) == list(range(8))  # every parameter's state, joined
        for index, fields in alone["state"].items():
            assert fields["exp_avg"].dtype == fields["exp_avg_sq"].dtype == torch.bfloat16
            assert sorted(dp["state"][index]) == sorted(fields), index
            for name, value in fields.items():
                assert torch.equal(dp["state"][index][name], value), (rank, index, name)
        for name, value in alone["weights"].items():
            assert torch.equal(dp["weights"][name], value), (rank, name)


def test_a_parameter_unfrozen_during_training_is_trained_by_its_owner(two):
    model = make_model()
    unfreeze_run(model, make_optimizer(model), 0, 1)  # stock AdamW skips it while frozen, as the engine does
    reference = weights(model)
    results = [_result(two, "unfreeze", r) for r in range(2)]
    assert sum(6 in r["owned"] for r in results) == 1  # parameter 6 (4.weight): state on its owner only
    for r in results:
        assert _max_diff(r["weights"], reference) <= TOL


def _single_process_state_bytes() -> tuple[int, list[int]]:
    model = make_model()
    model, _ = trainstream.wrap(model, make_optimizer(model), threads=1)
    try:
        report = trainstream.memory_report(model)["optimizer"]["placements"]["host"]
        numels = [s.numel for s in model._trainstream_session.engine.active]
    finally:
        trainstream.unwrap(model)
    return report["state_bytes"], numels


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_keeps_only_its_share_of_the_host_state(two, three, world):
    """The trained values are split evenly (the largest tensor, 512 of 916 values, is split too): each rank keeps
    1/world of the host state to one value, and every value of every parameter is kept by exactly one rank."""
    runs = two if world == 2 else three
    total, numels = _single_process_state_bytes()
    assert max(numels) > sum(numels) / world  # whole tensors could not balance this model
    spans = [_result(runs, "plain", r)["spans"] for r in range(world)]
    for index, numel in enumerate(numels):
        kept = sorted((0, numel) if span is None else span for rank in spans for i, span in rank.items() if i == index)
        assert kept[0][0] == 0 and kept[-1][1] == numel, (index, kept)  # every value kept ...
        assert all(a[1] == b[0] for a, b in itertools.pairwise(kept)), (index, kept)  # ... by exactly one rank
    assert sum(span is not None for rank in spans for span in rank.values()) >= 2  # some parameter is split
    state = [_result(runs, "plain", r)["optimizer"]["placements"]["host"]["state_bytes"] for r in range(world)]
    per_value = total / sum(numels)  # the model is fp32: every value's state has the same size
    assert sum(state) == total
    for rank, nbytes in enumerate(state):
        assert abs(nbytes - total / world) <= per_value, (rank, nbytes, total)
        assert _result(runs, "plain", rank)["host_state_bytes"] == nbytes  # planned and page-locked: its share
        info = _result(runs, "plain", rank)["distributed"]
        assert (info["world"], info["rank"], info["backend"]) == (world, rank, "gloo")
        assert info["owned_params"] == len(spans[rank])
        assert info["owned_values"] == round(nbytes / per_value)
        assert any("data parallel over" in line for line in _result(runs, "plain", rank)["events"])


def test_a_checkpoint_from_two_ranks_resumes_on_three(out, three):
    saved = torch.load(out / "checkpoint-2ranks.pt", weights_only=True)
    assert sorted(saved["optimizer"]["state"]) == list(range(8))  # the full state, gathered from both ranks
    reference = _reference()
    for rank in range(3):
        assert _max_diff(_result(three, "resume", rank)["weights"], reference) <= TOL
        # Without model.load_state_dict the weights come from the saved masters, on every rank.
        assert _max_diff(_result(three, "resume_optimizer_only", rank)["weights"], reference) <= TOL


def test_a_sharded_checkpoint_from_two_ranks_resumes_on_three_and_in_one_process(out, two, three):
    """save_checkpoint / load_checkpoint (torch.distributed.checkpoint): each rank wrote only the state it owned
    (DCP's metadata says which file holds each tensor), and the run resumes on 3 ranks and in one process as the
    gathered checkpoint does."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = out / "dcp-2ranks"
    metadata = FileSystemReader(str(folder)).read_metadata()
    where = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    for rank in range(2):
        for index, span in _result(two, "plain", rank)["spans"].items():
            for field in ("exp_avg", "exp_avg_sq", "master_param"):
                key = f"optimizer.state.{index}.{field}" + ("" if span is None else f"@{span[0]}")  # a piece: its values
                assert where[key] == f"__{rank}_0.distcp"  # its owner's file only
    assert sorted({where[k] for k in where if k.startswith("optimizer.state.")}) == ["__0_0.distcp", "__1_0.distcp"]
    reference = _reference()
    for rank in range(3):
        assert _max_diff(_result(three, "resume_dcp", rank)["weights"], reference) <= TOL
        # One process's checkpoint (whole fields): each rank reads the values of its pieces out of them.
        assert _max_diff(_result(three, "resume_dcp_alone", rank)["weights"], reference) <= TOL
    model = make_model(seed=7)
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1)
    try:
        tsd.load_checkpoint(model, optimizer, folder)
        train_steps(model, optimizer, STEPS, 0, 1, start=SAVE_AT)
        assert _max_diff(weights(model), reference) <= TOL
    finally:
        trainstream.unwrap(model)


def test_a_checkpoint_from_two_ranks_resumes_in_one_process(out, two):
    saved = torch.load(out / "checkpoint-2ranks.pt", weights_only=True)
    model = make_model(seed=7)
    model, optimizer = trainstream.wrap(model, make_optimizer(model), threads=1)
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        train_steps(model, optimizer, STEPS, 0, 1, start=SAVE_AT)
        assert _max_diff(weights(model), _reference()) <= TOL
    finally:
        trainstream.unwrap(model)


def test_state_carried_from_another_split_is_refused_at_wrap():
    """unwrap() under data parallel leaves a split parameter's piece (with its span) in the optimizer; wrapped where
    this rank keeps other values of it (here: one process, the whole parameter), the piece is refused, not applied."""
    model = make_model()
    optimizer = trainstream.OffloadAdamW(model.parameters(), lr=1e-2)
    weight = model[2].weight
    piece = torch.zeros(100)
    optimizer.state[weight] = {"step": torch.tensor(3.0), "exp_avg": piece, "exp_avg_sq": piece.clone(),
                               "master_param": weight.detach().reshape(-1)[:100].clone(), "span": (0, 100)}
    before = weight.detach().clone()
    with pytest.raises(ValueError, match=r"carries the state of values \(0, 100\) of parameter 2 .* all of them"):
        trainstream.wrap(model, optimizer, threads=1)
    assert not hasattr(model, "_trainstream_session") and torch.equal(weight, before)


def test_a_mismatched_model_is_refused_on_every_rank(two):
    for rank in range(2):
        error = _result(two, "mismatch_shape", rank)["error"]
        assert error is not None and error.startswith("ModelMismatch"), error
        assert "parameter 6 differs" in error and "[4, 16]" in error and "[5, 16]" in error, error
        error = _result(two, "mismatch_settings", rank)["error"]
        assert error is not None and "settings differ" in error and "max_grad_norm=1.0" in error, error


def test_a_rank_that_dies_raises_on_the_others(three):
    assert three[2]["rank_dies"] == {"exit": True}
    for rank in range(2):
        result = _result(three, "rank_dies", rank)
        assert result["error"] is not None and result["error"].startswith("DistributedError"), result
        assert f"rank {rank} of 3" in result["error"]
        assert result["seconds"] < 10.0 + 5.0  # within the collectives' timeout, no hang


def test_after_a_rank_stalls_the_others_raise_then_tear_down_within_the_timeout(out):
    from distributed_testing import STALL_S

    timeout = 2.0
    (out / "stall").mkdir()
    runs = run_ranks(2, ["rank_stalls"], out / "stall", timeout=timeout)
    assert runs[1]["rank_stalls"] == {"exit": True}
    result = _result(runs, "rank_stalls", 0)
    assert result["error"] is not None and "rank 0 of 2" in result["error"], result
    assert timeout <= result["raised_s"] < timeout + 2.0, result
    assert result["again"] is not None and "earlier collective failed" in result["again"], result
    assert result["again_s"] < 0.5, result  # refused at once, not another timeout
    # unwrap() and destroy_process_group() wait at most for the backend's margin, not for the stalled rank
    # (asleep STALL_S) nor the process group's 60 s timeout.
    assert result["teardown_s"] < tsd.collectives.BACKEND_TIMEOUT_MARGIN_S + 2.0 < STALL_S - timeout, result


def test_the_distributed_switch_without_a_process_group():
    assert not dist.is_initialized()
    assert tsd.active_world() == 1
    assert tsd.setup([], torch.device("cpu"), None) is None  # None: off without a process group
    assert tsd.setup([], torch.device("cpu"), None, enabled=False) is None
    with pytest.raises(ValueError, match="init_process_group"):
        tsd.setup([], torch.device("cpu"), None, enabled=True)
    with pytest.raises(ValueError, match="distributed='yes' is not valid"):
        tsd.setup([], torch.device("cpu"), None, enabled="yes")


def test_wrap_distributed_false_trains_each_rank_alone_and_memory_report_says_which(two):
    for rank in range(2):
        assert _result(two, "plain", rank)["report_distributed"] == _result(two, "plain", rank)["distributed"]
        assert _result(two, "plain", rank)["report_distributed"]["world"] == 2
        assert _result(two, "forced_off", rank)["has_report"] is False
    # Off: no rank-0 broadcast, no averaging: each rank keeps its own seed's model and its own batches.
    assert _max_diff(_result(two, "forced_off", 0)["weights"], _result(two, "forced_off", 1)["weights"]) > 1e-3


def test_wrap_refuses_a_distributed_value_that_is_not_a_switch():
    import trainstream

    with pytest.raises(ValueError, match="distributed='yes' is not valid"):
        trainstream.wrap(make_model(), make_optimizer(make_model()), distributed="yes")


# ---- reductions started during backward -------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_starts_the_reductions_during_backward(two, three, world):
    runs = two if world == 2 else three
    for scenario in TRAINING:
        for rank in range(world):
            overlap = _result(runs, scenario, rank)["distributed"]["overlap"]
            last = overlap["last_step"]
            assert overlap["enabled"] and overlap["armed"], (scenario, rank, overlap)
            # Armed after the first step; from then on every bucket starts in backward, none at step().
            assert last["overlapped"] and last["buckets_in_backward"] > 0 and last["buckets_at_step"] == 0
            assert overlap["buckets_in_backward"] == (STEPS - 1) * last["buckets_in_backward"], overlap
            assert overlap["buckets_at_step"] == 0 and overlap["dropped_steps"] == 0, overlap
            assert _result(runs, scenario, rank)["calls_after_unwrap"] == 0  # a backward after unwrap()


@pytest.mark.parametrize("world", [2, 3])
def test_with_or_without_overlap_the_weights_are_the_same_bits(two, three, world):
    runs = two if world == 2 else three
    for rank in range(world):
        off = _result(runs, "no_overlap", rank)
        assert off["distributed"]["overlap"]["buckets_in_backward"] == 0
        assert not off["distributed"]["overlap"]["armed"]
        assert _max_diff(off["weights"], _result(runs, "accumulate_clip", rank)["weights"]) == 0.0


@pytest.mark.parametrize("world", [2, 3])
def test_a_parameter_without_gradient_on_some_ranks_trains_like_one_process(two, three, world):
    runs = two if world == 2 else three
    model = Branchy()
    branch_run(model, make_optimizer(model), 0, 1)
    reference = weights(model)
    per_rank = [_result(runs, "unused", rank) for rank in range(world)]
    for rank, result in enumerate(per_rank):
        assert _max_diff(result["weights"], reference) <= TOL
        steps = result["per_step"]
        # Step 1: only rank 0's share takes the branch; the other ranks start the branch's bucket and
        # the ones after it at step(), with zeros, and the reductions are used. Step 3: no rank has
        # the branch's gradient: the reductions are dropped and redone without it.
        assert [s["overlapped"] for s in steps] == [False, True, True, False, False], steps
        assert [s["dropped"] for s in steps] == [False, False, False, True, False], steps
        assert steps[2]["buckets_at_step"] == 0 and steps[2]["buckets_in_backward"] > 0
        if rank == 0:
            assert steps[1]["buckets_at_step"] == 0
        else:
            assert steps[1]["buckets_at_step"] > 0 and steps[1]["buckets_in_backward"] < steps[2]["buckets_in_backward"]
        assert steps[3]["buckets_at_step"] > 0
        assert any("no gradient on any rank" in line for line in result["events"])


def test_a_step_before_the_accumulation_window_completes_reduces_at_step(two):
    reference = _reference()
    for rank in range(2):
        result = _result(two, "mid_window", rank)  # accumulation_steps=2, step() after each backward
        assert _max_diff(result["weights"], reference) <= TOL
        assert all(s["buckets_in_backward"] == 0 for s in result["per_step"]), result["per_step"]
        assert all(s["overlapped"] and s["buckets_at_step"] > 0 for s in result["per_step"][1:])


def test_gradients_changed_by_hand_after_backward_are_the_ones_reduced(two):
    model = make_model()
    train_steps(model, make_optimizer(model), HAND_SET_STEPS, 0, 1, after_backward=lambda step: hand_set(model, step))
    reference = weights(model)
    for rank in range(2):
        result = _result(two, "hand_set", rank)
        assert _max_diff(result["weights"], reference) <= TOL
        steps = result["per_step"]
        # Dropped at step 2 (edited in place) and 5 (replaced); after a drop, 2 steps without overlap.
        assert [s["dropped"] for s in steps] == [False, False, True, False, False, True, False], steps
        assert [s["overlapped"] for s in steps] == [False, True, False, False, False, False, False], steps
        assert steps[2]["buckets_in_backward"] > 0 and steps[5]["buckets_in_backward"] > 0
        assert any("changed or replaced after they were copied" in line for line in result["events"])


def test_after_close_and_unwrap_the_first_wraps_hooks_start_nothing(two):
    reference = _reference()
    for rank in range(2):
        result = _result(two, "rewrap", rank)
        assert result["started_before_close"] > 0 and not result["armed_after_close"]
        assert result["first_calls_after_unwrap"] == 0
        assert result["second"]["buckets_in_backward"] > 0 and result["second"]["dropped_steps"] == 0
        assert _max_diff(result["weights"], reference) <= TOL


def test_zero_grad_before_the_window_completes_starts_its_count_again(two):
    model = make_model()
    discard_run(model, make_optimizer(model), 0, 1)
    reference = weights(model)
    for rank in range(2):
        result = _result(two, "discard", rank)
        assert _max_diff(result["weights"], reference) <= TOL
        # Step 2 had a dropped backward before its 2: the reductions started at the window's real end.
        assert [s["overlapped"] for s in result["per_step"]] == [False, True, True, True, True], result["per_step"]
        assert result["per_step"][2]["buckets_at_step"] == 0


def test_attention_auto_pins_one_kernel_on_every_rank(two):
    """Rank 0 alone would pin flash, rank 1 math (their fake timers); after step 1 both take the mean
    of both ranks' timings (flash 2.0, math 1.5 ms) and pin math, with the event saying so."""
    results = [r["attention_agree"] for r in two]
    for r in results:
        assert "failed" not in r, r.get("failed")
        (label,) = r["attention"]["timings_ms"]
        assert r["attention"]["timings_ms"][label] == {"flash": 2.0, "math": 1.5}
        assert r["attention"]["chosen"][label] == r["attention"]["backend"] == "math"
        assert r["events"] and "mean over the 2 ranks" in r["events"][0]
    assert results[0]["last"] == results[1]["last"]  # the same kernel ran the last forward on both


_IMPORT_ORDER = """
import os, sys, tempfile, warnings, torch.distributed as dist
store = os.path.join(tempfile.mkdtemp(), "store")
if sys.argv[1] == "after":
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import trainstream
if sys.argv[1] == "before":
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
print([str(w.message) for w in caught if "init_process_group" in str(w.message)])
dist.destroy_process_group()
"""


@pytest.mark.parametrize("order", ["before", "after"])
def test_importing_trainstream_after_init_process_group_warns(order):
    """docs/distributed.md: imported after the group exists, trainstream says to import it first."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORT_ORDER, order], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    warned = eval(done.stdout.strip().splitlines()[-1])
    if order == "after":
        assert len(warned) == 1 and "Import trainstream before init_process_group()" in warned[0]
    else:
        assert warned == []


def test_the_collectives_timeout_is_an_option(out):
    """wrap(distributed_timeout=) sets the wait (before: only the module constant); bad values are refused."""
    (out / "timeout").mkdir()
    runs = run_ranks(2, ["rank_stalls_option"], out / "timeout", timeout=30.0)  # the constant: 30 s
    result = _result(runs, "rank_stalls_option", 0)
    assert result["error"] is not None and "timeout 1.5 s" in result["error"], result
    assert 1.5 <= result["raised_s"] < 3.5, result
    for bad in (0, -1.0, float("nan"), True, "60"):
        with pytest.raises(ValueError, match="distributed_timeout"):
            trainstream.plan(make_model(), distributed_timeout=bad)


def test_a_rank_that_skips_step_is_refused_naming_each_ranks_step(out):
    """Before: the skipping rank's next step paired with the others' step after it, with no warning, and the
    run hung at the end. Now the flags exchange carries the count of training forwards and every rank
    refuses at once."""
    (out / "skip").mkdir()
    runs = run_ranks(2, ["skips_step"], out / "skip", timeout=10.0)
    for rank in (0, 1):
        result = runs[rank]["skips_step"]
        assert result["error"] is not None, rank
        assert "rank 0 at step 2 after 2 training forwards, rank 1 at step 2 after 3" in result["error"], result["error"]
        assert "skipped step()" in result["error"]
        assert result["seconds"] < 10.0  # refused at the exchange, not by a timeout
