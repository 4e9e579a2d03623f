"""The planner models FSDP2 (``fsdp_shards``) and trainstream's data parallel per rank: what each rank holds,
what it sends over the network, and the network's term in the lower bound."""

from __future__ import annotations

import math

import pytest
import ts_planner
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_planner import Budget, ModelShape, Options, estimate_memory

SHAPE = ModelShape(5120, 13824, 48, 40, 8, 152064)  # the Qwen2.5-14B shape
BUDGET = Budget(vram_bytes=80 << 30, host_bytes=200 << 30, pinned_bytes=160 << 30, network_gbps=40.0)


@pytest.mark.parametrize("shards", [2, 8, 128])
def test_each_fsdp2_rank_holds_its_shards_and_one_block_pair_gathered(shards):
    alone = estimate_memory(SHAPE, Options(train="full"))
    sharded = estimate_memory(SHAPE, Options(train="full", fsdp_shards=shards))
    block = SHAPE.block_params * 2  # bf16
    assert sharded.vram["trained_weights"] == math.ceil(alone.vram["trained_weights"] / shards) + 2 * block
    # The host optimizer's state is an even split by element (as trainstream's data parallel splits it too).
    assert sharded.host["optimizer_state"] == pytest.approx(alone.host["optimizer_state"] / shards, rel=1e-6)
    assert sharded.host_optimizer_params == math.ceil(alone.host_optimizer_params / shards)
    weights = SHAPE.total_params * 2
    trained = alone.trained_params
    # The ZeRO-3 volume: every weight gathered twice, every gradient reduce-scattered once at fp32.
    assert sharded.network_bytes == round((2 * weights + 4 * trained) * (shards - 1) / shards)
    assert alone.network_bytes == 0


def test_trainstream_data_parallel_sends_the_gradients_and_the_weights_once():
    e = estimate_memory(SHAPE, Options(train="full", state_shared_by=4))
    assert e.network_bytes == round(2 * e.trained_params * 2 * 3 / 4)


@pytest.mark.parametrize("train", ["full", "lora"])
@pytest.mark.parametrize("optimizer", ["host", "gpu"])
def test_trainstream_data_parallel_keeps_every_gradient_and_its_bucket_copy_in_vram(train, optimizer):
    """Under data parallel the gradients are reduced at step(): each waits in param.grad, beside its copy in the
    bucket whose reduction started during backward (docs/multi-node.md, "What each rank holds")."""
    alone = estimate_memory(SHAPE, Options(train=train, optimizer=optimizer))
    shared = estimate_memory(SHAPE, Options(train=train, optimizer=optimizer, state_shared_by=4))
    gradients = alone.trained_params * (2 if train == "full" else 4)  # bf16 weights, fp32 adapters
    assert shared.vram["gradients"] == 2 * gradients
    if optimizer == "gpu":
        assert alone.vram["gradients"] == gradients  # one process: every gradient until step(), once
    else:
        assert alone.vram["gradients"] < gradients  # one process: only those in flight to the host


def test_the_network_bounds_a_sharded_step():
    plan = ts_planner.check_plan(SHAPE, BUDGET, Options(train="full", fsdp_shards=128, optimizer="gpu"))
    assert plan.network_s == pytest.approx(plan.estimate.network_bytes / 40e9)
    assert plan.lower_bound_s >= plan.network_s and plan.to_dict()["lower_bound_s"]["network"] == plan.network_s
    assert "network" in plan.explain()
    found = ts_planner.plan_memory(SHAPE, BUDGET, train="full", fsdp_shards=128)
    assert found.fits and found.options.streamed_blocks == 0 and found.options.fsdp_shards == 128


@settings(max_examples=30, deadline=None)
@given(a=st.integers(1, 256), b=st.integers(1, 256), train=st.sampled_from(["full", "lora"]))
def test_more_shards_never_hold_more_per_rank(a, b, train):
    few, many = sorted((a, b))
    small = estimate_memory(SHAPE, Options(train=train, fsdp_shards=many))
    large = estimate_memory(SHAPE, Options(train=train, fsdp_shards=few))
    assert small.allocator_bytes <= large.allocator_bytes and small.host_bytes <= large.host_bytes


def test_fsdp2_with_streaming_or_trainstream_data_parallel_is_refused():
    with pytest.raises(ValueError, match="fsdp_shards"):
        Options(fsdp_shards=4, streamed_blocks=2)
    with pytest.raises(ValueError, match="fsdp_shards"):
        Options(fsdp_shards=4, state_shared_by=4)
    with pytest.raises(ValueError, match="fsdp_shards"):
        Options(fsdp_shards=0)
