"""The plan wrap() makes before allocating anything (issue 12): refusal with the numbers and what would
fit, nothing changed after a refusal, memory_report()["plan"], and the planner's invariants as wrap()
applies them (hypothesis)."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import pytest
import torch
import trainstream
import ts_planner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from trainstream.memory.sizing import PLAN_SEQ, ModelFacts, PlanRefused, describe_model, plan_wrap
from trainstream.planning import decide
from ts_testing import batches, loss_of, tiny_llama

GiB = 1 << 30
SHAPES = {  # Qwen2.5's published shapes
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, model_type="qwen2"),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, model_type="qwen2"),
}


def facts(size: str, train: str = "full") -> ModelFacts:
    """What describe_model() would say of a bf16 Qwen2.5 of `size` (no weights built)."""
    shape = ts_planner.ModelShape.from_config(SHAPES[size])
    e = ts_planner.estimate_memory(shape, ts_planner.Options(train=train, seq=1))
    return ModelFacts(shape, train, 16, ts_planner.LORA_TARGETS, "bfloat16", "float32", None,
                      shape.num_hidden_layers, e.trained_params, e.trained_params * (2 if train == "full" else 4),
                      shape.total_params * 2, 0)


def budget(vram_gib: float, host_gib: float, pin: float = 0.8) -> ts_planner.Budget:
    host = int(host_gib * GiB)
    return ts_planner.Budget(vram_bytes=int(vram_gib * GiB), host_bytes=host, pinned_bytes=int(host * pin),
                             headroom=0.10)


def patch_budget(monkeypatch, **fields):
    """wrap()'s budget with `fields` replaced (the machine's otherwise)."""
    real = decide.wrap_budget

    def fake(device, opts, f):
        return dataclasses.replace(real(device, opts, f), **fields)

    monkeypatch.setattr(decide, "wrap_budget", fake)


# ---- refusal ---------------------------------------------------------------------------------------

def test_full_7b_in_too_little_host_ram_is_refused_with_the_numbers_and_what_fits():
    f, b = facts("7b"), budget(80, 64)
    plan = plan_wrap(f, b)
    assert not plan.fits
    state = ts_planner.estimate_memory(f.shape, ts_planner.Options(seq=1, moment_dtype="bfloat16"))
    need = f"{state.host_bytes / GiB:.1f}"
    short = f"{(state.host_bytes - b.host_bytes) / GiB:.1f}"
    assert f"needs {need} GiB of host RAM, 64.0 GiB available ({short} GiB short" in plan.message
    assert "optimizer state" in plan.message
    # bf16 moments were tried ("auto"): only LoRA is left, and LoRA does fit in 64 GiB.
    assert "use LoRA adapters" in plan.message and "moment_dtype" not in plan.message.split("use ")[-1]


def test_fp32_moments_asked_for_are_refused_with_bf16_moments_as_the_fix():
    f = facts("7b")
    fp32 = ts_planner.estimate_memory(f.shape, ts_planner.Options(seq=1)).host_bytes
    bf16 = ts_planner.estimate_memory(f.shape, ts_planner.Options(seq=1, moment_dtype="bfloat16")).host_bytes
    b = budget(80, (fp32 + bf16) / 2 / GiB, pin=1.0)
    plan = plan_wrap(f, b, moment_dtype="float32")
    assert not plan.fits and "use moment_dtype='bf16'" in plan.message
    assert f"needs {fp32 / GiB:.1f} GiB of host RAM, {b.host_bytes / GiB:.1f} GiB available" in plan.message
    assert plan_wrap(f, b).fits  # "auto" finds bf16 itself


def test_lora_14b_bf16_without_quantization_in_24_gb_is_refused_naming_nf4_and_streaming():
    f, b = facts("14b", "lora"), budget(24e9 / GiB, 200)
    plan = plan_wrap(f, b, quantize=None)
    assert not plan.fits
    m = re.search(r"needs ([\d.]+) GiB of VRAM, ([\d.]+) GiB available \(([\d.]+) GiB short; the largest part: frozen "
                  r"weights ([\d.]+) GiB\)", plan.message)
    assert m, plan.message
    state = ts_planner.estimate_memory(f.shape, ts_planner.Options(train="lora", seq=1, recompute=48))
    assert float(m[1]) == pytest.approx(state.allocator_bytes / GiB, abs=0.06)
    assert float(m[2]) == pytest.approx(b.usable_vram / GiB, abs=0.06)
    assert "quantize='nf4'" in plan.message and "param_offload=True" in plan.message
    auto = plan_wrap(f, b, quantize="auto")
    assert auto.fits and auto.quantize in ("int8", "nf4")
    tight = plan_wrap(f, budget(16, 200), quantize="auto")  # NF4's state fits, 2048 tokens do not
    assert tight.fits and not tight.plan.fits and tight.quantize == "nf4"
    assert "fewer tokens per step will, or at 2048 tokens param_offload=True with quantize=None" in tight.message


def _snapshot(model, optimizer):
    tensors = {n: (t, t.data_ptr(), t.clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())
    return tensors, hooks, {k: dict(v) for k, v in optimizer.state.items()}, type(model).__dict__.copy()


def test_wrap_refuses_host_ram_on_the_cpu_and_changes_nothing(monkeypatch):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(model, batches(1)[0]).backward()
    optimizer.step()  # existing state: a refused wrap must not migrate or clear it
    optimizer.zero_grad()
    before = _snapshot(model, optimizer)
    e = ts_planner.estimate_memory(ts_planner.ModelShape.from_model(model),
                                   ts_planner.Options(seq=1, dtype="float32", moment_dtype="float32"))
    patch_budget(monkeypatch, host_bytes=e.host_bytes - 1000)
    with pytest.raises(PlanRefused) as error:
        trainstream.wrap(model, optimizer, moment_dtype="float32")
    assert isinstance(error.value, ValueError) and isinstance(error.value, MemoryError)
    text = str(error.value)
    assert "refused before allocating anything" in text and "of host RAM" in text
    assert "use moment_dtype='bf16'" in text and "check_memory=False" in text
    after = _snapshot(model, optimizer)
    assert getattr(model, "_trainstream_session", None) is None
    assert after[1] == before[1] and after[2].keys() == before[2].keys()
    for name, (tensor, ptr, value) in before[0].items():
        now = after[0][name]
        assert now[0] is tensor and now[1] == ptr and torch.equal(now[2], value), name
    # check_memory=False tries anyway, and says so in the plan event
    wrapped, _ = trainstream.wrap(model, optimizer, moment_dtype="float32", check_memory=False)
    report = trainstream.memory_report(wrapped)
    assert report["plan"]["fits"] is False
    assert any("check_memory=False, so it tries" in line for line in report["events"])
    trainstream.unwrap(wrapped)


def test_wrap_refuses_vram_with_a_monkeypatched_budget(monkeypatch):
    model = tiny_llama()
    patch_budget(monkeypatch, vram_bytes=64 << 10)
    with pytest.raises(ValueError, match=r"needs [\d.]+ GiB of VRAM, [\d.]+ GiB available .*the largest part"):
        trainstream.wrap(model)
    assert getattr(model, "_trainstream_session", None) is None


# ---- the plan in memory_report ---------------------------------------------------------------------

def test_memory_report_has_the_plan_and_the_stalls_of_recent_steps():
    model = tiny_llama()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    for ids in batches(3):
        loss_of(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    report = trainstream.memory_report(model)
    plan = report["plan"]
    for key in ("fits", "quantize", "moment_dtype", "resident_blocks", "streamed_blocks", "activations",
                "peak_vram_bytes", "host_bytes", "lower_bound_s", "choices", "state", "tokens", "message"):
        assert key in plan, key
    assert plan["fits"] and plan["tokens"] == {"batch": 1, "seq": PLAN_SEQ, "fits": True}
    assert set(plan["lower_bound_s"]) == {"total", "compute", "link", "host_optimizer", "disk", "network"}
    assert plan["lower_bound_s"]["total"] == max(plan["lower_bound_s"][k] for k in ("compute", "link", "host_optimizer"))
    assert plan["resident_blocks"] == 2 and plan["streamed_blocks"] == 0 and plan["train"] == "full"
    assert plan["moment_dtype"] == "float32" and plan["quantize"] is None
    assert plan["peak_vram_bytes"] == sum(v for k, v in plan["vram"].items() if k != "cuda_context")
    assert any(line.split(": ", 1)[-1] == plan["message"] for line in report["events"])
    assert plan["target_vram"] == plan["budget"]["usable_vram_bytes"] and plan["settled"] is True
    assert any(plan["message"] in line for line in plan["history"])
    stalls = report["stalls"]
    assert [s["step"] for s in stalls] == [1, 2, 3]
    for s in stalls:
        assert s["link_s"] + s["host_optimizer_s"] + s["disk_s"] + s["none_s"] == pytest.approx(s["step_s"])
        assert min(s["link_s"], s["host_optimizer_s"], s["none_s"]) >= 0 and s["disk_s"] == s["disk_wait_s"] == 0


def test_data_parallel_is_planned_per_rank_with_every_gradient_twice_in_vram(monkeypatch):
    """plan_wrap(state_shared_by=N): this rank's 1/N of the host state, and every gradient twice in VRAM (in
    param.grad until step(), and its bucket's copy); wrap()'s plan passes the data-parallel world to it."""
    f, b = facts("7b"), budget(80, 200)
    alone, ranks = plan_wrap(f, b, quantize=None), plan_wrap(f, b, quantize=None, state_shared_by=4)
    assert ranks.plan.options.state_shared_by == 4
    assert ranks.plan.estimate.vram["gradients"] == 2 * f.trained_bytes > alone.plan.estimate.vram["gradients"]
    host = [p.plan.estimate.host["optimizer_state"] for p in (alone, ranks)]
    assert host[1] == pytest.approx(host[0] / 4, rel=1e-6)
    from trainstream import distributed as tsd

    monkeypatch.setattr(tsd, "world_of", lambda enabled: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args: 0)
    patch_budget(monkeypatch, vram_bytes=80 * GiB)
    planned = trainstream.plan(tiny_llama(), lr=1e-3)
    assert planned.memory.plan.options.state_shared_by == 2
    weights = planned.memory.plan.estimate.vram["trained_weights"]
    assert planned.memory.plan.estimate.vram["gradients"] == 2 * weights  # fp32 weights, fp32 gradients


def test_describe_model_reads_lora_and_plain_models():
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    full = describe_model(base, trainstream.find_blocks(base))
    assert full.shape is not None and full.train == "full" and full.trained_values == 86464
    lora = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    f = describe_model(lora, trainstream.find_blocks(lora))
    assert f.shape is not None, f.mismatch
    assert (f.train, f.lora_rank, f.lora_targets) == ("lora", 4, ("q_proj", "v_proj"))
    plain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    g = describe_model(plain, trainstream.find_blocks(plain))
    assert g.shape is None and g.mismatch
    model, _ = trainstream.wrap(plain)  # a model without a decoder shape: the state is checked alone
    assert trainstream.memory_report(model)["plan"]["model"].startswith("generic")
    trainstream.unwrap(model)


def test_a_model_without_a_decoder_shape_is_refused_on_its_weights_and_state(monkeypatch):
    plain = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    weights = sum(p.numel() * 4 for p in plain.parameters())
    patch_budget(monkeypatch, vram_bytes=weights)  # less the 10 % headroom: the weights do not fit
    with pytest.raises(PlanRefused, match=r"of VRAM for its weights.*param_offload=True"):
        trainstream.wrap(plain, vram_headroom=0.10)
    patch_budget(monkeypatch, host_bytes=1 << 30)  # under the 2 GiB the process itself is counted at
    with pytest.raises(PlanRefused, match=r"of host RAM for the optimizer state"):
        trainstream.wrap(plain)
    assert getattr(plain, "_trainstream_session", None) is None


# ---- invariants (hypothesis) -------------------------------------------------------------------------

_LEVEL = {None: 0, "int8": 1, "nf4": 2}
_CASES = [("14b", "lora", "auto"), ("7b", "full", None), ("7b", "lora", "auto")]
_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _keep(plan) -> int:
    return plan.plan.options.activation_counts(plan.plan.shape.num_hidden_layers)[0]


@_SETTINGS
@given(case=st.sampled_from(_CASES), vram=st.floats(4, 80), more=st.floats(0.5, 60), host=st.floats(8, 400))
@example(case=_CASES[0], vram=16.0, more=2.0, host=200.0)  # 2048 tokens fit first with NF4 at 18 GiB
def test_more_vram_never_quantizes_recomputes_or_refuses_more(case, vram, more, host):
    size, train, quantize = case
    f = facts(size, train)
    small, large = (plan_wrap(f, budget(v, host), quantize=quantize) for v in (vram, vram + more))
    assert _LEVEL[large.quantize] <= _LEVEL[small.quantize]  # what wrap() applies
    assert large.plan.options.quantize == large.quantize
    assert large.plan.options.streamed_blocks <= small.plan.options.streamed_blocks
    # Lexicographic, as the planner prefers: less quantization first, then fewer blocks recomputed or
    # paged (more VRAM may recompute more blocks to drop the quantization, never at the same format).
    if small.plan.fits:
        assert large.plan.fits
        if large.quantize == small.quantize:
            assert _keep(large) >= _keep(small)
    assert large.fits or not small.fits


@_SETTINGS
@given(case=st.sampled_from(_CASES), vram=st.floats(4, 80), host=st.floats(4, 300), more=st.floats(0.5, 200))
def test_more_host_ram_never_refuses_what_less_accepted(case, vram, host, more):
    size, train, quantize = case
    f = facts(size, train)
    small, large = (plan_wrap(f, budget(vram, h), quantize=quantize) for h in (host, host + more))
    assert large.fits or not small.fits


@_SETTINGS
@given(case=st.sampled_from(_CASES), vram=st.floats(4, 80), host=st.floats(4, 300))
def test_a_plan_that_fits_peaks_under_the_usable_vram(case, vram, host):
    size, train, quantize = case
    b = budget(vram, host)
    plan = plan_wrap(facts(size, train), b, quantize=quantize)
    if plan.fits:
        assert plan.state.peak_vram_bytes <= b.usable_vram and plan.state.host_bytes <= b.host_bytes
    if plan.plan.fits:
        assert plan.plan.peak_vram_bytes <= b.usable_vram and plan.plan.host_bytes <= b.host_bytes
        assert plan.fits


# ---- stalls and the picture ----------------------------------------------------------------------------

def test_stalls_from_timings_attributes_every_second_once():
    from trainstream._stalls import stalls_from_timings

    s = stalls_from_timings(1.0, {"link": 0.25, "host_optimizer": 0.5})
    assert (s["link_s"], s["host_optimizer_s"], s["none_s"]) == (0.25, 0.5, 0.25)
    over = stalls_from_timings(1.0, {"link": 1.5, "host_optimizer": 0.5})  # overlapping waits: scaled to the step
    assert over["link_s"] == pytest.approx(0.75) and over["none_s"] == 0.0
    with pytest.raises(ValueError, match="unknown wait cause"):
        stalls_from_timings(1.0, {"compute": 0.1})
    # The worker's disk waits are charged to the disk out of the host-optimizer wait, never beyond it.
    disk = stalls_from_timings(1.0, {"link": 0.25, "host_optimizer": 0.5}, disk_wait_s=0.2)
    assert (disk["host_optimizer_s"], disk["disk_s"], disk["none_s"]) == (0.3, 0.2, 0.25)
    capped = stalls_from_timings(1.0, {"host_optimizer": 0.1}, disk_wait_s=0.7)
    assert (capped["host_optimizer_s"], capped["disk_s"]) == (0.0, 0.1)


def test_observed_channel_times_only_waits_that_can_stall():
    """A compute-stream wait on a copy that already finished (or on no copy) cannot stall: it is passed on
    without the two timing events, which cost the training thread more than such a wait (thousands a
    step on the H200: prefetched pages and weights). A wait on a copy still running is timed."""
    from trainstream.engine.channel import ChannelOwner, ObservedChannel

    class Token:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    class Channel:
        is_cuda = True

        def __init__(self):
            self.waited = []

        def compute_wait(self, token):
            self.waited.append(token)

    class Observer:
        def __init__(self):
            self.timed = []

        def device_wait(self, cause):
            self.timed.append(cause)
            return contextlib.nullcontext()

        host_wait = device_wait

    class Owner(ChannelOwner):
        def __init__(self):
            self.channel = Channel()

    owner, observer = Owner(), Observer()
    channel = owner.channel
    owner.observe(observer)
    assert isinstance(owner.channel, ObservedChannel) and owner.channel.base is channel
    finished, running = Token(True), Token(False)
    for token in (None, finished, running):
        owner.channel.compute_wait(token)
    assert channel.waited == [None, finished, running]  # every wait still reaches the stream
    assert observer.timed == ["link"]  # only the running copy's
    owner.observe(None)
    assert owner.channel is channel  # no view left: nothing refers to the observer


def test_a_slow_host_optimizer_shows_as_host_optimizer_stalls(monkeypatch):
    import time

    import ts_adamw

    real = ts_adamw.adamw_steps  # the host worker's call (one per batch of updates)

    calls = []

    def slow(*args, **kwargs):
        calls.append(len(kwargs["keys"]))
        time.sleep(0.02)
        return real(*args, **kwargs)

    model = tiny_llama()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    monkeypatch.setattr(ts_adamw, "adamw_steps", slow)
    for ids in batches(2):
        loss_of(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    params = len(list(model.parameters()))
    assert sum(calls) == 2 * params  # every update ran, some of them batched into one call
    last = trainstream.memory_report(model)["stalls"][-1]
    # each host call of the last step sleeps 20 ms, and the CPU step waits for them
    first_step = next(i + 1 for i in range(len(calls)) if sum(calls[:i + 1]) == params)  # no call spans two steps
    step_calls = len(calls) - first_step
    assert last["host_optimizer_s"] >= 0.5 * step_calls * 0.02
    assert last["host_adamw_busy_s"] >= step_calls * 0.02
    trainstream.unwrap(model)


def test_plot_memory_without_matplotlib_says_how_to_install_it(monkeypatch):
    import sys

    model, _ = trainstream.wrap(tiny_llama())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'trainstream\[plot\]'"):
        trainstream.plot_memory(model, "never-written.png")


def test_plot_memory_draws_the_plan_and_the_steps(tmp_path):
    pytest.importorskip("matplotlib")
    model = tiny_llama()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    for ids in batches(2):
        loss_of(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    path = trainstream.plot_memory(model, tmp_path / "plan.png")
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ---- on a GPU (the lead's H200 batch) --------------------------------------------------------------------

def _with_fraction(fraction: float):
    device = torch.device("cuda", torch.cuda.current_device())
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = get(device) if get is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return device, old


@pytest.mark.cuda
def test_on_cuda_the_plan_honours_the_memory_fraction_and_bounds_the_step():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device, old = _with_fraction(0.5)
    try:
        total = torch.cuda.get_device_properties(device).total_memory
        model = tiny_llama(dtype=torch.bfloat16)
        model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cuda")
        plan = trainstream.memory_report(model)["plan"]
        assert plan["fits"] and plan["budget"]["vram_bytes"] == int(total * 0.5)
        torch.cuda.reset_peak_memory_stats(device)
        for ids in batches(2, batch=1, seq=64):
            loss_of(model, ids.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
        stalls = trainstream.memory_report(model)["stalls"]
        assert len(stalls) == 2 and stalls[-1]["gpu"]["peak_allocated"] > 0
        trainstream.unwrap(model)
    finally:
        torch.cuda.set_per_process_memory_fraction(old, device)


@pytest.mark.cuda
def test_on_cuda_a_refused_wrap_allocates_nothing():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(dtype=torch.bfloat16), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    device, old = _with_fraction(1e-6)  # about 140 KB: not even the bf16 base fits
    try:
        before = torch.cuda.memory_allocated(device)
        with pytest.raises(PlanRefused, match="of VRAM"):
            trainstream.wrap(model, quantize=None, device="cuda")
        assert torch.cuda.memory_allocated(device) == before
        assert all(p.device.type == "cpu" for p in model.parameters())
    finally:
        torch.cuda.set_per_process_memory_fraction(old, device)
