"""Gradient buckets (engine/buckets.py, issue 13): host-placed gradients leave a bucket at a time, and training is
bit for bit what one gradient at a time gives: parameters a forward skips, two backward passes before step(),
accumulation, clipping, bf16 moments."""

from __future__ import annotations

import pytest
import torch
import trainstream
import ts_pinned
from engine_testing import assert_consistent, same_state, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream.engine import SlotState, updates
from trainstream.engine.buckets import GradBuckets
from trainstream.engine.slots import ParamSlot

LAYERS = 8


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected backward failure")


class Gated(torch.nn.Module):
    """Eight small linears; those in ``skip`` sit out a forward (no gradient for them in that pass); with
    ``fail_before`` set, backward raises on its way into that layer (the later layers have their gradients)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(LAYERS))
        self.skip: set[int] = set()
        self.fail_before: int | None = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == self.fail_before:
                x = _FailsInBackward.apply(x)
            if i not in self.skip:
                x = torch.tanh(layer(x))
        return x.square().mean()


def _train(monkeypatch, bucket_items: int, plan: list[tuple[set, int]], **options):
    """One optimizer step per (skipped layers, backward passes) of `plan`, with buckets of at most
    `bucket_items` slots (1: each gradient alone); accumulation_steps is the most passes a step has, unless
    given (a step of fewer passes takes what accumulated at step()). Returns (state, D2H launches, pending
    after each backward)."""
    monkeypatch.setattr(updates, "BATCH_MAX_ITEMS", bucket_items)
    options = {"accumulation_steps": max(passes for _, passes in plan), **options}
    model, opt = trainstream.wrap(Gated(), lr=1e-2, **options)
    engine = model._trainstream_session.engine
    generator = torch.Generator().manual_seed(1)
    pending = []
    for skip, passes in plan:
        for _ in range(passes):
            model.skip = skip
            model(torch.randn(4, 16, generator=generator)).backward()
            pending.append(engine.buckets.has_pending())
        opt.step()
        opt.zero_grad()
    state, launches = snapshot(model), engine.d2h_launches
    trainstream.unwrap(model)
    return state, launches, pending


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("options", [
    {},
    {"moment_dtype": torch.bfloat16},
    {"max_grad_norm": 0.05},
    {"accumulation_steps": 2},
])
def test_buckets_train_bit_for_bit_like_one_gradient_at_a_time(monkeypatch, options):
    passes = options.get("accumulation_steps", 1)
    plan = [(set(), passes), ({2, 5}, passes), (set(), passes), ({0}, passes)]
    alone, alone_launches, _ = _train(monkeypatch, 1, plan, **options)
    bucketed, launches, pending = _train(monkeypatch, 64, plan, **options)
    assert _same(alone, bucketed)
    assert alone_launches == 2 * LAYERS * 4 - 2 * 3  # one per gradient: 16 tensors a step, 3 skipped layers
    assert launches == 4  # the 16 tensors are one bucket: one launch a step
    assert not any(pending)  # a bucket a skipped layer left short was taken when its backward pass ended


def test_a_second_backward_pass_without_accumulation_is_refused_with_buckets(monkeypatch):
    """With a layer skipped the bucket is never full: it is taken when the pass ends, so the next pass (no
    accumulation_steps declared) is refused at its first gradient, the same with buckets as without."""
    for items in (1, 64):
        with pytest.raises(RuntimeError, match="more than accumulation_steps=1 before step"):
            _train(monkeypatch, items, [({3}, 2)], accumulation_steps=1)
    state, _, pending = _train(monkeypatch, 64, [({3}, 1), (set(), 1)], accumulation_steps=1)
    assert not any(pending)
    assert [s["step"] for s in state] == [1 if i == 3 else 2 for i in range(LAYERS) for _ in ("weight", "bias")]


@settings(max_examples=12, deadline=None)
@given(plan=st.lists(st.tuples(st.sets(st.integers(0, LAYERS - 1), max_size=3), st.integers(1, 2)),
                     min_size=1, max_size=4),
       items=st.integers(2, 20))
def test_any_skips_passes_and_bucket_sizes_train_like_one_at_a_time(plan, items):
    with pytest.MonkeyPatch.context() as monkeypatch:
        alone, _, _ = _train(monkeypatch, 1, plan)
        bucketed, _, pending = _train(monkeypatch, items, plan)
    assert _same(alone, bucketed)
    assert not any(pending)


def test_a_hook_called_outside_backward_takes_the_gradient_at_once():
    """No backward pass to end: the gradient is not left waiting for one."""
    model, _opt = trainstream.wrap(Gated(), lr=1e-2)
    engine = model._trainstream_session.engine
    param = model.layers[4].weight
    param.grad = torch.ones_like(param)
    engine._on_grad(param)
    slot = engine.by_param[id(param)]
    assert not engine.buckets.has_pending() and slot.state in (SlotState.QUEUED, SlotState.IDLE) and slot.step <= 1
    assert param.grad is None
    engine.synchronize()
    assert slot.step == 1
    trainstream.unwrap(model)


def test_buckets_hold_consecutive_host_slots_within_the_call_limits(monkeypatch):
    monkeypatch.setattr(updates, "BATCH_MAX_VALUES", 100)
    monkeypatch.setattr(updates, "BATCH_MAX_ITEMS", 3)
    arena = ts_pinned.default_arena()
    slots = []
    for i, (numel, placement, hooked) in enumerate([(30, "host", True), (30, "host", True), (50, "host", True),
                                                    (10, "device", False), (10, "host", True), (10, "host", True),
                                                    (10, "host", True), (10, "host", True), (200, "host", True)]):
        slot = ParamSlot(torch.nn.Parameter(torch.zeros(numel)), i, {})
        slot.allocate(placement, torch.float32, arena)
        slot.hook = object() if hooked else None
        slots.append(slot)
    buckets = GradBuckets()
    assert not buckets.valid
    buckets.build(slots)
    # 30 + 30 fit, + 50 would pass 100 values; the device slot has no hook; three items at most;
    # 200 values alone (a tensor above the limit is a bucket of its own).
    assert [[s.index for s in b.slots] for b in buckets.buckets] == [[0, 1], [2, 4, 5], [6, 7], [8]]
    assert buckets.of(slots[3]) is None
    full = [buckets.arrive(buckets.of(s), s) for s in (slots[0], slots[8], slots[1])]
    assert full[0] is None and full[1] == [slots[8]] and full[2] == [slots[0], slots[1]]
    buckets.arrive(buckets.of(slots[6]), slots[6])
    assert buckets.has_pending() and buckets.take_pending() == [slots[6]] and not buckets.has_pending()


def test_a_backward_pass_that_raises_leaves_its_gradients_to_zero_grad(monkeypatch):
    """Autograd runs no final callback when backward raises: the complete gradients of a partly filled bucket
    are taken by zero_grad(), as they were one at a time during that pass, and the next pass (a layer
    skipped, so its bucket stays short) is taken when it ends again."""

    def run(items: int):
        monkeypatch.setattr(updates, "BATCH_MAX_ITEMS", items)
        model, opt = trainstream.wrap(Gated(), lr=1e-2)
        engine = model._trainstream_session.engine
        generator = torch.Generator().manual_seed(2)
        pending = []
        for fail_before, skip in ((4, set()), (None, {3}), (2, set()), (None, {6})):
            model.fail_before, model.skip = fail_before, skip
            try:
                model(torch.randn(4, 16, generator=generator)).backward()
            except RuntimeError as error:
                assert "injected backward failure" in str(error)
            pending.append(engine.buckets.has_pending())
            if fail_before is None:
                opt.step()
            opt.zero_grad()
            assert not engine.buckets.has_pending()
        state = snapshot(model)
        trainstream.unwrap(model)
        return state, pending

    alone, _ = run(1)
    bucketed, pending = run(64)
    assert _same(alone, bucketed)
    assert pending == [True, False, True, False]  # right after backward: waiting after the failed passes only
    assert [s["step"] for s in bucketed][-2:] == [4, 4]  # layer 7 trained in every pass, failed or not


def test_a_pass_after_one_that_raised_is_taken_when_it_ends():
    """A backward pass that raised ran no final callback; the next pass, before any step() or zero_grad(),
    still has its partly filled bucket taken when it ends (the forward in between says no pass is running)."""
    model, opt = trainstream.wrap(Gated(), lr=1e-2)
    engine = model._trainstream_session.engine
    model.fail_before = 4
    with pytest.raises(RuntimeError, match="injected backward failure"):
        model(torch.randn(4, 16)).backward()
    assert engine.buckets.has_pending()
    model.fail_before, model.skip = None, {3}
    model(torch.randn(4, 16)).backward()  # adds to the failed pass's gradients, as autograd does
    assert not engine.buckets.has_pending()
    opt.step()
    opt.zero_grad()
    assert_consistent(model)
    trainstream.unwrap(model)
