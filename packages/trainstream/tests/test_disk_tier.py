"""nvme_path: the optimizer state that does not fit in host RAM lives on disk. Training is bit for bit the
same as with the state in RAM (fp32 and bf16 moments, accumulation, clipping, streamed trained weights,
resume from a checkpoint either way); a budget the state exceeds is refused without a directory and
trains with one; the plan's rule puts the least state there; faults name the path and leave nothing
half-applied; the scratch file never has a name in the directory and is freed at unwrap()."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import trainstream
from hypothesis import given, settings
from hypothesis import strategies as st
from test_activations import Stack, _run
from trainstream.engine import UpdateFailed, updates
from trainstream.memory import disk_plan

WIDTH = 256  # a Block's linears hold 65536+ values: large enough for the disk tier (MIN_DISK_VALUES)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _budget_below(options: dict) -> int:
    """A host budget halfway between the state of Stack(WIDTH) in RAM and with everything eligible on disk:
    refused without nvme_path, some (not all) state on disk with it."""
    in_ram = trainstream.plan(Stack(width=WIDTH), **options).host_state_bytes
    all_on_disk = trainstream.plan(Stack(width=WIDTH), nvme_path="/tmp", host_budget=1, check_memory=False,
                                   **options).host_state_bytes
    assert all_on_disk < in_ram
    return (in_ram + all_on_disk) // 2


def _train(options: dict, steps: int = 4, model=None):
    model, opt = trainstream.wrap(model or Stack(width=WIDTH, p=0.1), lr=1e-2, **options)
    losses = _run(model, opt, steps=steps, width=WIDTH)
    return model, opt, losses


def _state_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["state"][k][f], b["state"][k][f]) for k in a["state"] for f in a["state"][k])


@pytest.mark.parametrize("options", [
    {"moment_dtype": "float32"},
    {"moment_dtype": "bfloat16", "accumulation_steps": 2, "max_grad_norm": 0.05},
    {"moment_dtype": "float32", "max_grad_norm": 0.1, "param_offload": True},  # streamed trained weights
])
def test_state_on_disk_trains_bit_for_bit_like_state_in_ram(tmp_path, options):
    budget = _budget_below(options)
    runs = []
    for extra in ({}, {"nvme_path": tmp_path, "host_budget": budget}):
        model, opt, losses = _train({**options, **extra})
        report = trainstream.memory_report(model)
        runs.append((losses, _params(model), opt.state_dict(), report))
        assert os.listdir(tmp_path) == []  # the scratch file has no name there, even while in use
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert _state_equal(runs[0][2], runs[1][2])
    disk = runs[1][3]["optimizer"]["disk"]
    assert runs[0][3]["optimizer"]["disk"] is None
    assert disk["params"] > 0 and disk["updates"] > 0 and disk["failed"] is None
    assert runs[1][3]["plan"]["host_state_bytes"] <= budget < runs[0][3]["plan"]["host_state_bytes"]
    stalls = runs[1][3]["stalls"]  # the worker's disk waits reach the stall clock, within each step
    assert sum(s["disk_wait_s"] for s in stalls) > 0 and all(s["disk_s"] <= s["step_s"] for s in stalls)
    assert all(s["disk_wait_s"] == 0 for s in runs[0][3]["stalls"])
    assert any("nvme_path" in line for line in runs[1][3]["events"])


def test_a_budget_the_state_exceeds_is_refused_without_a_directory_and_trains_with_one(tmp_path):
    options = {"moment_dtype": "float32"}
    budget = _budget_below(options)
    with pytest.raises(trainstream.PlanRefused, match=r"but only .* can be used \(host_budget=.*nvme_path="):
        trainstream.wrap(Stack(width=WIDTH), lr=1e-2, host_budget=budget, **options)
    plan = trainstream.plan(Stack(width=WIDTH), host_budget=budget, nvme_path=tmp_path, **options)
    assert plan.disk_state and plan.host_state_bytes <= budget
    decision = plan.decision("nvme_path")
    assert decision is not None and str(tmp_path) in decision.value and "scratch file" in decision.reason
    assert "live on disk" in plan.host_message
    # The least state moves: the parameters registered last (backward reaches them first) go first.
    trained = [p for p in Stack(width=WIDTH).parameters() if p.requires_grad]
    eligible = [i for i, p in enumerate(trained) if p.numel() >= disk_plan.MIN_DISK_VALUES]
    assert list(plan.disk_state) == eligible[len(eligible) - len(plan.disk_state):]
    # Too small even with every eligible parameter on disk: refused with the numbers.
    with pytest.raises(trainstream.PlanRefused, match=r"does not fit in host RAM even with .* on disk at"):
        trainstream.plan(Stack(width=WIDTH), host_budget=1 << 20, nvme_path=tmp_path, **options)


@pytest.mark.parametrize("save_from_disk", [True, False])
def test_resume_moves_between_the_tiers_bit_for_bit(tmp_path, save_from_disk):
    options = {"moment_dtype": "float32", "max_grad_norm": 0.2}
    on_disk = {"nvme_path": tmp_path, "host_budget": _budget_below(options)}
    model, opt, _ = _train({**options, **(on_disk if save_from_disk else {})}, steps=3)
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
    trainstream.unwrap(model)
    results = []
    for extra in ({}, on_disk):
        fresh = Stack(width=WIDTH, p=0.1, seed=7)
        fresh.load_state_dict(checkpoint["model"])
        model, opt = trainstream.wrap(fresh, lr=1e-2, **options, **extra)
        opt.load_state_dict(checkpoint["opt"])
        losses = _run(model, opt, steps=3, seed=10, width=WIDTH)
        results.append((losses, _params(model), opt.state_dict()))
        trainstream.unwrap(model)
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert _state_equal(results[0][2], results[1][2])


def test_a_weight_edited_between_steps_reaches_the_master_on_disk(tmp_path):
    options = {"moment_dtype": "float32"}
    runs = []
    for extra in ({}, {"nvme_path": tmp_path, "host_budget": _budget_below(options)}):
        model, opt, _ = _train({**options, **extra}, steps=2)
        with torch.no_grad():
            for p in model.parameters():  # the master follows the user's weight, as torch's AdamW would
                p.mul_(0.5)
        _run(model, opt, steps=2, seed=5, width=WIDTH)
        runs.append(_params(model))
        trainstream.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_directories_are_refused_at_wrap_naming_them(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"nvme_path='{missing}' is not a directory"):
        trainstream.plan(Stack(width=WIDTH), nvme_path=missing)
    with pytest.raises(ValueError, match="nvme_path=3 is not valid"):
        trainstream.plan(Stack(width=WIDTH), nvme_path=3)
    # Root may write anywhere but a read-only filesystem: os.access is what tells either case.
    monkeypatch.setattr(disk_plan.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=f"nvme_path='{tmp_path}' is not writable"):
        trainstream.plan(Stack(width=WIDTH), nvme_path=tmp_path)


def test_a_disk_without_room_is_refused_with_the_numbers(tmp_path, monkeypatch):
    options = {"moment_dtype": "float32", "host_budget": _budget_below({"moment_dtype": "float32"})}
    monkeypatch.setattr("trainstream.planning.decide.disk_free_bytes", lambda path: 4096)
    model = Stack(width=WIDTH)
    with pytest.raises(trainstream.PlanRefused, match=f"at nvme_path='{tmp_path}' but that filesystem has 4.00 KiB free"):
        trainstream.wrap(model, lr=1e-2, nvme_path=tmp_path, **options)
    assert not hasattr(model, "_trainstream_session")


def test_a_full_disk_at_wrap_names_the_directory_and_leaves_the_model_unwrapped(tmp_path):
    # RLIMIT_FSIZE stands in for a full disk (the plan's free-space check sees the real disk's room).
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch, trainstream, ts_adamw
        from test_activations import Stack
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        model = Stack(width={WIDTH})
        before = [p.detach().clone() for p in model.parameters()]
        try:
            trainstream.wrap(model, lr=1e-2, moment_dtype="float32", nvme_path={str(tmp_path)!r},
                             host_budget={_budget_below({"moment_dtype": "float32"})})
        except ts_adamw.DiskIOError as error:
            print("refused:", error)
        assert not hasattr(model, "_trainstream_session")
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    """)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"in '{tmp_path}'" in done.stdout and "refused:" in done.stdout
    assert os.listdir(tmp_path) == []


def test_a_failed_read_is_reported_at_the_next_step_and_changes_nothing(tmp_path, monkeypatch):
    # One slot per host call: queued updates of one tier otherwise share a DiskState.step (and its failure), and
    # how many are queued when the worker wakes depends on the machine's load.
    monkeypatch.setattr(updates, "BATCH_MAX_ITEMS", 1)
    options = {"moment_dtype": "float32", "nvme_path": tmp_path,
               "host_budget": _budget_below({"moment_dtype": "float32"})}
    model, opt, _ = _train(options, steps=2)
    tier = model._trainstream_session.engine.disk
    before = _params(model)
    saved = opt.state_dict()
    tier.state._file._fail_next("short", "read")  # the first segment of the next disk update: nothing updated
    x = torch.randn(4, 8, WIDTH, generator=torch.Generator().manual_seed(3))
    model(x).backward()
    with pytest.raises(UpdateFailed, match=r"host AdamW update of .* failed") as info:
        opt.step()
        model._trainstream_session.synchronize()
    assert "unexpected end of file" in str(info.value) and tier.directory in str(info.value)
    model._trainstream_session.synchronize()  # step() may raise before the worker reached the other updates
    disk_slots = [s for s in model._trainstream_session.engine.slots if s.disk is not None]
    failed = [s for s in disk_slots if s.step == saved["state"][s.index]["step"].item()]
    assert failed and len(failed) < len(disk_slots)  # the other buckets' updates went on
    for slot in failed:  # named, their weights and state as they were, and the tier still usable
        assert slot.label in str(info.value)
        assert torch.equal(slot.param.detach(), before[slot.index])
        state = tier.read(slot)
        assert torch.equal(state[1], saved["state"][slot.index]["exp_avg"].reshape(-1))
    assert tier.state.failed is None
    opt.zero_grad()
    _run(model, opt, steps=1, seed=20, width=WIDTH)  # trains on
    trainstream.unwrap(model)


def test_each_bucket_reads_the_next_one_ahead_after_the_first_step(tmp_path):
    options = {"moment_dtype": "float32", "nvme_path": tmp_path,
               "host_budget": _budget_below({"moment_dtype": "float32"})}
    model, _opt, _ = _train(options, steps=3)
    tier = model._trainstream_session.engine.disk
    buckets = set(tier._next)
    assert len(buckets) > 1 and all(tier._next[b] in buckets for b in buckets)  # a cycle: step after step
    assert tier.state._ready  # the last bucket of step 3 read the first one of step 4 ahead
    trainstream.unwrap(model)


def test_unwrap_frees_the_scratch_file(tmp_path):
    options = {"moment_dtype": "float32", "nvme_path": tmp_path,
               "host_budget": _budget_below({"moment_dtype": "float32"})}
    model, _opt, _ = _train(options, steps=1)
    tier = model._trainstream_session.engine.disk
    assert not tier.state.closed and tier.state.nbytes > 0
    trainstream.unwrap(model)
    assert tier.state.closed and os.listdir(tmp_path) == []


def test_data_parallel_and_fsdp2_refuse_the_disk_tier_for_now(tmp_path, monkeypatch):
    from trainstream import distributed as tsd

    monkeypatch.setattr(tsd, "world_of", lambda enabled: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)
    with pytest.raises(ValueError, match="nvme_path= is not supported under data parallel"):
        trainstream.plan(Stack(width=WIDTH), nvme_path=tmp_path)


# ---- the rule ------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300_000), min_size=1, max_size=12), fraction=st.floats(0.05, 1.2),
       moments=st.sampled_from([torch.float32, torch.bfloat16]), bf16=st.booleans())
def test_the_rule_moves_the_least_state_last_registered_first(sizes, fraction, moments, bf16):
    params = [torch.empty(n, dtype=torch.bfloat16 if bf16 else torch.float32) for n in sizes]
    mb = torch.empty((), dtype=moments).element_size()
    in_ram = [p.numel() * (4 + 2 * mb + p.element_size() * (1 if not bf16 else 2)) for p in params]
    budget = int(sum(in_ram) * fraction)
    choice = disk_plan.choose_disk_state(params, in_ram, moments, budget)
    eligible = [i for i, p in enumerate(params) if p.numel() >= disk_plan.MIN_DISK_VALUES]
    chosen = list(choice.on_disk)
    assert chosen == eligible[len(eligible) - len(chosen):]  # a suffix of the eligible, in order
    ram = sum(in_ram) + sum(disk_plan.ram_bytes_on_disk(params[i]) - in_ram[i] for i in chosen)
    values = sum(params[i].numel() for i in chosen)
    assert choice.ram_bytes == ram + disk_plan.staging_bytes(values, moments)
    assert choice.disk_bytes == sum(disk_plan.disk_state_bytes(params[i], mb) for i in chosen)
    if sum(in_ram) <= budget:
        assert chosen == []
    elif choice.ram_bytes > budget:
        assert chosen == eligible  # nothing more could move: the caller refuses
    else:  # the least: without the last one chosen it would not fit
        fewer = chosen[1:]
        ram_fewer = sum(in_ram) + sum(disk_plan.ram_bytes_on_disk(params[i]) - in_ram[i] for i in fewer)
        staging = disk_plan.staging_bytes(sum(params[i].numel() for i in fewer), moments)
        assert ram_fewer + staging > budget


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config).to(torch.bfloat16)


def test_a_hugging_face_bf16_full_fine_tune_on_disk_matches_ram_and_its_bound_has_the_disk(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("TRAINSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "state").mkdir()
    options = {"moment_dtype": "float32", "accumulation_steps": 2, "max_grad_norm": 1.0}
    in_ram = trainstream.plan(_llama(), **options).host_state_bytes
    budget = in_ram * 3 // 4
    plan = trainstream.plan(_llama(), nvme_path=tmp_path / "state", host_budget=budget, **options)
    bound = plan.to_dict()["lower_bound_s"]
    assert plan.disk_state and bound["disk"] > 0 and bound["total"] >= bound["disk"]
    assert any("disk at" in text and "GB/s" in text for _kind, text in plan.notes)  # the measured rates
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for extra in ({}, {"nvme_path": tmp_path / "state", "host_budget": budget}):
        model, opt = trainstream.wrap(_llama(), lr=1e-3, **options, **extra)
        for _ in range(3):
            for micro in range(2):  # accumulation_steps=2
                model(input_ids=ids[micro:micro + 1], labels=ids[micro:micro + 1]).loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append(_params(model))
        trainstream.unwrap(model)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_trainstream_plan_puts_the_least_state_on_disk_that_fits(tmp_path, monkeypatch, capsys):
    """Issue 46's workstation: a 7B full fine-tune on a 24 GiB GPU with 64 GiB of RAM is refused in RAM alone
    and fits with --nvme-path, the disk's time in its bound."""
    import json

    import ts_planner
    from trainstream._plan_cli import PLAN_SIZES, plan_main

    monkeypatch.setattr(ts_planner, "disk_rates", lambda path: ts_planner.DiskRates(1.5, 2.0, True, str(path), 1, 4.0))
    args = ["--full", "--size", "7b", "--vram-gb", "24", "--host-gb", "64", "--json"]
    assert plan_main(args) == 3
    refused = json.loads(capsys.readouterr().out)
    assert refused["disk"] is None and not refused["fits"]
    assert plan_main([*args, "--nvme-path", str(tmp_path)]) == 0
    data = json.loads(capsys.readouterr().out)
    share = data["disk"]["share"]
    assert data["fits"] and 0 < share < 1 and data["disk_state_share"] == share
    assert data["host_bytes"] <= data["budget"]["host_bytes"]
    assert data["lower_bound_s"]["disk"] == pytest.approx(data["disk_bytes"] / 1.5e9)
    assert data["lower_bound_s"]["total"] == data["lower_bound_s"]["disk"]  # the disk paces this step
    # The least share: a little less does not fit.
    shape = ts_planner.ModelShape.from_config({**PLAN_SIZES["7b"], "model_type": "qwen2"})
    budget = ts_planner.Budget(vram_bytes=24 << 30, host_bytes=64 << 30,
                               pinned_bytes=data["budget"]["pinned_bytes"])
    less = ts_planner.plan_memory(shape, budget, train="full", optimizer="host", disk_state_share=share * 0.97)
    assert not less.fits


def test_a_model_too_small_for_the_disk_tier_is_told_so(tmp_path):
    small = Stack(width=64)  # no parameter reaches MIN_DISK_VALUES
    in_ram = trainstream.plan(small, moment_dtype="float32").host_state_bytes
    with pytest.raises(trainstream.PlanRefused, match="nvme_path cannot help: no trained parameter has 65536"):
        trainstream.plan(small, moment_dtype="float32", nvme_path=tmp_path, host_budget=in_ram // 2)
    plan = trainstream.plan(small, moment_dtype="float32", nvme_path=tmp_path, host_budget=in_ram // 2,
                            check_memory=False)
    assert plan.disk_state == () and "takes no state" in plan.host_message and "live on disk" not in plan.host_message
