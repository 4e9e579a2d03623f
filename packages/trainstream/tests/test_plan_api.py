"""trainstream.plan() decides, wrap(plan=) applies (issue 41): plan() changes nothing, a plan applies as it is
and twice alike, wrap(**options) is wrap(plan=plan(**options)), and the runtime streams the blocks the planner
priced."""

from __future__ import annotations

import threading

import pytest
import torch
import trainstream
import ts_pinned
import ts_planner
from ts_testing import batches, tiny_llama
from ts_testing import train as _train


def _params(model) -> list:
    return [(id(p), p.data_ptr(), p.device, p.requires_grad, p.detach().clone()) for p in model.parameters()]


def _assert_same(now: list, before: list) -> None:
    assert [x[:4] for x in now] == [x[:4] for x in before]  # same tensors, same storage, device, trainability
    assert all(torch.equal(a[4], b[4]) for a, b in zip(now, before))  # same values


# What a plan decided and priced; the machine's readings (available RAM, and the texts that quote it)
# move between two plans made a moment apart.
_DECIDED = ("decisions", "quantize", "moment_dtype", "streamed_block_indices", "activations", "peak_vram_bytes",
            "host_bytes", "pinned_bytes", "host_state_bytes", "vram", "host", "lower_bound_s")


def _decided(plan: dict) -> dict:
    out = {key: plan.get(key) for key in _DECIDED}
    out["decisions"] = [(d["option"], d["value"]) for d in plan["decisions"]]  # reasons quote the budget
    return out


def _report_plan(model) -> dict:
    plan = dict(trainstream.memory_report(model)["plan"])
    for runtime in ("history", "settled"):  # what the run has done since, not what was planned
        plan.pop(runtime)
    return plan


def test_plan_changes_nothing():
    model = tiny_llama(layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _params(model)
    threads = set(threading.enumerate())
    arena = ts_pinned.default_arena().stats()
    plan = trainstream.plan(model, opt, param_offload=0.5, activation_offload=[1])
    assert isinstance(plan, trainstream.Plan) and plan.fits
    _assert_same(_params(model), before)
    assert set(threading.enumerate()) == threads  # no worker, no copy thread
    assert ts_pinned.default_arena().stats() == arena  # nothing page-locked
    assert getattr(model, "_trainstream_session", None) is None and not opt.state
    with pytest.raises(AttributeError):
        plan.quantize = "nf4"  # frozen


def test_every_auto_option_is_settled_in_the_plan_with_its_reason():
    plan = trainstream.plan(tiny_llama(layers=4), param_offload="auto", host_embedding="auto", stream_packing="auto")
    resolved = dict(plan.resolved)
    for option in ("param_offload", "quantize", "stream_packing", "host_embedding"):
        assert resolved[option] != "auto", option
    assert resolved["moment_dtype"] == "auto"  # the option as given; the plan holds the choice
    assert plan.moment_dtype == torch.float32 and plan.decision("moment_dtype").value == "float32"
    for option in ("host_embedding", "moment_dtype", "param_offload", "quantize"):
        assert plan.decision(option) is not None and plan.decision(option).reason, option
    text = plan.explain()
    assert "moment_dtype='float32'" in text and "param_offload=False" in text
    assert plan.to_dict()["decisions"] == [d.to_dict() for d in plan.decisions]


@pytest.mark.parametrize("options", [{}, {"param_offload": 0.5, "recompute": [0], "max_grad_norm": 0.5},
                                     {"quantize": "nf4", "accumulation_steps": 2}])
def test_wrap_with_options_equals_wrap_with_their_plan(options):
    data = batches(4)
    runs = []
    for planned in (False, True):
        model = tiny_llama(layers=4)
        if options.get("quantize"):
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        if planned:
            model, opt = trainstream.wrap(model, plan=trainstream.plan(model, lr=1e-3, **options))
        else:
            model, opt = trainstream.wrap(model, lr=1e-3, **options)
        runs.append((_train(model, opt, data), _decided(_report_plan(model))))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]  # bit for bit
    assert runs[0][1] == runs[1][1]


def test_a_plan_applied_twice_reports_the_same_plan():
    model = tiny_llama(layers=4)
    plan = trainstream.plan(model, lr=1e-3, param_offload=0.5)
    reports = []
    for _ in range(2):
        model, opt = trainstream.wrap(model, plan=plan)
        _train(model, opt, batches(2))
        reports.append(_report_plan(model))
        trainstream.unwrap(model)
    assert reports[0] == reports[1] == {**reports[0], **plan.to_dict()}


def test_a_plan_applies_only_to_what_it_was_made_for():
    model, other = tiny_llama(layers=2), tiny_llama(layers=2)
    plan = trainstream.plan(model)
    with pytest.raises(ValueError, match="made for another model"):
        trainstream.wrap(other, plan=plan)
    with pytest.raises(ValueError, match=r"pass lr to trainstream\.plan"):
        trainstream.wrap(model, plan=plan, lr=1e-2)
    with pytest.raises(ValueError, match=r"takes what trainstream\.plan"):
        trainstream.wrap(model, plan={"fits": True})
    model.lm_head.weight.requires_grad_(False)  # what trains changed since the plan
    with pytest.raises(ValueError, match="before the model's parameters changed"):
        trainstream.wrap(model, plan=plan)
    assert getattr(model, "_trainstream_session", None) is None


def test_a_refusal_comes_from_plan_before_anything_changes(monkeypatch):
    small = ts_pinned.PageLockBudget(memlock_limit=None, mem_available=10_000, mem_total=20_000, budget=8_000)
    monkeypatch.setattr(ts_pinned, "page_lock_budget", lambda *a, **k: small)
    model = tiny_llama()
    before = _params(model)
    with pytest.raises(trainstream.PlanRefused, match="page-locked host RAM"):
        trainstream.plan(model)
    _assert_same(_params(model), before)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_the_runtime_streams_the_blocks_the_planner_priced(fraction):
    model = tiny_llama(layers=8)
    plan = trainstream.plan(model, param_offload=fraction)
    priced = plan.memory.plan  # ts-planner's own plan: which blocks it counted as streamed
    assert priced is not None and priced.options.streamed_blocks == round(8 * fraction)
    model, _opt = trainstream.wrap(model, plan=plan)
    streamed = trainstream.memory_report(model)["params"]["streaming"]["streamed_blocks"]
    assert streamed == list(priced.streamed) == sorted(ts_planner.spread_order(8)[:round(8 * fraction)])
    trainstream.unwrap(model)


def test_the_plan_prices_the_moments_the_engine_keeps():
    model = tiny_llama(layers=2)
    plan = trainstream.plan(model, moment_dtype="auto")
    assert plan.memory.plan.options.moment_dtype == str(plan.moment_dtype).removeprefix("torch.")
    model, _opt = trainstream.wrap(model, plan=plan)
    assert model._trainstream_session.moment_dtype == plan.moment_dtype
    trainstream.unwrap(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_state_bytes_are_what_the_engine_holds(dtype):
    # A 16-bit weight's host state has an upload buffer beside its gradient buffer; CPU models are
    # usually fp32, where the two are one, so this checks the bf16 case explicitly.
    model = tiny_llama(layers=2, dtype=dtype)
    plan = trainstream.plan(model)
    model, opt = trainstream.wrap(model, plan=plan)
    _train(model, opt, batches(1))
    session = model._trainstream_session
    session.synchronize()
    held = sum(s.state_bytes() for s in session.engine.active)
    assert plan.host_state_bytes == session.host_state_bytes == held
    trainstream.unwrap(model)


def test_the_plan_prices_the_optimizer_state_where_offload_auto_will_put_it():
    """offload='auto' on a GPU moves the optimizer state to VRAM once it fits beside the settled peak: the plan
    prices it there exactly then (the planner's own fit rule), and on the host otherwise or when asked."""
    import dataclasses

    from trainstream._options import parse_options
    from trainstream.memory.sizing import ModelFacts
    from trainstream.planning import decide

    shape = ts_planner.ModelShape(1536, 8960, 28, 12, 2, 151936, tie_word_embeddings=True, qkv_bias=True)
    trained = ts_planner.estimate_memory(shape, ts_planner.Options(seq=1)).trained_params
    facts = ModelFacts(shape, "full", 16, ts_planner.LORA_TARGETS, "bfloat16", "float32", None, 28, trained,
                       2 * trained, 2 * shape.total_params, 0)
    gib = 1 << 30
    gpu = ts_planner.Budget(vram_bytes=80 * gib, host_bytes=200 * gib, pinned_bytes=150 * gib, device_bytes=80 * gib)

    def priced(budget, **options):
        opts = parse_options({"quantize": None, **options})
        plan, _ = decide._memory_plan(torch.device("cuda"), opts, decide._Inputs([], facts, budget, 0.0), [], "float32")
        return plan.plan.options.optimizer

    assert priced(gpu) == "gpu"  # 1.5B's state (about 18 GiB with its gradients) fits in 80 GiB
    assert priced(dataclasses.replace(gpu, vram_bytes=24 * gib)) == "host"  # beside a 2048-token step it does not
    assert priced(gpu, offload=True) == "host"  # offload=True keeps it on the host
    assert priced(gpu, optimizer_mode="gpu") == "host"  # mapped: in host memory, read over the link
    assert priced(dataclasses.replace(gpu, device_bytes=None)) == "host"  # a CPU run: nothing moves


def test_the_schedule_of_run_time_transitions():
    from trainstream._schedule import ATTENTION_AGREE_STEPS, PEER_SETUP_STEP, StepFacts, due

    def facts(step, **kw):
        return StepFacts(**{"step": step, "period": 0.1, "settled": False, "adapting": False, "trial": False,
                            "world": 1, **kw})

    assert due(facts(1)) == [] and due(facts(1, period=None, trial=True)) == []
    assert due(facts(PEER_SETUP_STEP)) == ["peer_pools"]
    assert due(facts(2, adapting=True)) == []  # waits for the settled policy
    assert due(facts(2, adapting=True, settled=True, trial=True)) == ["optimizer_placement"]  # not both
    assert due(facts(5, trial=True)) == ["mapped_trial"]
    assert due(facts(ATTENTION_AGREE_STEPS, world=2)) == ["attention_agreement"]
    assert due(facts(ATTENTION_AGREE_STEPS + 1, world=2)) == []


def test_transitions_run_are_in_the_report():
    model, opt = trainstream.wrap(tiny_llama(layers=2), lr=1e-3)
    _train(model, opt, batches(2))
    plan = trainstream.memory_report(model)["plan"]
    assert plan["transitions"] == []  # on the CPU nothing adapts: one process, nothing to move
    trainstream.unwrap(model)


def test_a_run_time_transition_is_a_new_plan_with_what_it_changed(monkeypatch):
    """offload='auto' moving the state into VRAM after the policy settled (driven on the CPU: the VRAM readings
    stubbed, "device" placement is the model's device): memory_report's plan gains the transition with the
    placements before and after, the plan made at wrap() is unchanged, and the step trained as torch's."""
    import trainstream._session as session_module

    model, opt = trainstream.wrap(tiny_llama(layers=2), lr=1e-3)
    reference = tiny_llama(layers=2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    session = model._trainstream_session
    applied = session.plan
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(session_module, "vram_budget", lambda device, headroom: 2**40)
    session.adapting = True  # as on a GPU with offload="auto"
    data = batches(1)  # one step: the CPU twin channel has no stream for the fused device launch after the move
    _train(model, opt, data)
    _train(reference, ref_opt, data)
    plan = trainstream.memory_report(model)["plan"]
    values = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert plan["transitions"] == [{
        "step": 1, "transition": "optimizer_placement", "reason": plan["transitions"][0]["reason"],
        "changes": {"optimizer_placement": {"before": {"host": values}, "after": {"device": values}}}}]
    assert "fits beside the measured peak" in plan["transitions"][0]["reason"]
    assert session.plan.history and not applied.history  # Plan -> Plan: the applied one is not changed
    assert session.plan.decisions == applied.decisions
    session.synchronize()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    trainstream.unwrap(model)
