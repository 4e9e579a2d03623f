"""GPU behaviour of wrap(): overlap, lower VRAM, the same numbers as the CPU path,
and the automatic placements. Run on a GPU machine (tools/gpu_run.sh)."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import trainstream
from ts_testing import batches, loss_of, max_param_diff, tiny_llama, train

pytestmark = pytest.mark.cuda


def _mid_llama(layers=8, hidden=1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=4096,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _train(model, opt, data, device="cuda"):
    return train(model, opt, data, device)


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_cuda_path_matches_cpu_path(mode):
    cpu_model = tiny_llama()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    data = batches(10)
    cpu_model, cpu_opt = trainstream.wrap(cpu_model, lr=2e-3)
    gpu_model, gpu_opt = trainstream.wrap(gpu_model, lr=2e-3, optimizer_mode=mode, offload=True)
    cpu_losses = _train(cpu_model, cpu_opt, data, "cpu")
    gpu_losses = _train(gpu_model, gpu_opt, data)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-3)
    assert max_param_diff(gpu_model.cpu(), cpu_model) < 2e-4  # fp32 GPU matmuls differ from CPU ones


def test_matches_stock_adamw_with_fp32_master_on_bf16_model():
    """Stock mixed precision (fp32 weights, autocast, fused AdamW) against a bf16 model
    wrapped by trainstream (fp32 master on the host): the updates agree up to bf16 noise. Both use the
    math attention kernel: two kernels alone move these losses apart by more than the tolerance by
    step 8 (H200, docs/results/gpu-tests-h200-2026-12-01-g.log)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    reference = _mid_llama(layers=2, hidden=256).cuda()
    initial = [p.detach().clone() for p in reference.parameters()]
    ours = copy.deepcopy(reference).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    ours, opt = trainstream.wrap(ours, lr=1e-3, offload=True, attention="math")
    data = batches(8, vocab=4096, seq=64)
    ref_losses = []
    for ids in data:
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
            loss = loss_of(reference, ids.cuda())
            loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    losses = _train(ours, opt, data)
    assert losses == pytest.approx(ref_losses, rel=2e-2)
    masters = opt.state_dict()["state"]
    moved = torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(reference.parameters(), initial)])
    apart = torch.cat([(masters[i]["master_param"].cuda() - p.detach()).flatten()
                       for i, p in enumerate(reference.parameters())])
    # The fp32 masters moved the same way: the disagreement is small next to the update itself.
    assert apart.norm() / moved.norm() < 0.1, (apart.norm().item(), moved.norm().item())


def test_host_updates_overlap_backward():
    model = _mid_llama().cuda().to(torch.bfloat16)
    model, opt = trainstream.wrap(model, lr=1e-4, offload=True)
    session = model._trainstream_session
    data = batches(4, vocab=4096, batch=8, seq=512)
    _train(model, opt, data[:2])
    updates_before = session.engine.host.updates
    ids = data[2].cuda()
    loss = loss_of(model, ids)
    loss.backward()  # returns once the autograd engine has launched everything
    during = session.engine.host.updates - updates_before
    torch.cuda.synchronize()
    opt.step()
    session.synchronize()
    total = session.engine.host.updates - updates_before
    assert total == len(list(model.parameters()))
    assert during > 0, "no host update ran while backward was still in flight"


def test_peak_vram_is_lower_than_stock_by_the_optimizer_state():
    def peak(wrapped: bool) -> int:
        model = _mid_llama().cuda().to(torch.bfloat16)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if wrapped:
            model, opt = trainstream.wrap(model, lr=1e-4, offload=True)
            _train(model, opt, batches(3, vocab=4096, batch=4, seq=256))
        else:
            master = [p.detach().float().requires_grad_() for p in model.parameters()]
            opt = torch.optim.AdamW(master, lr=1e-4, fused=True)
            for ids in batches(3, vocab=4096, batch=4, seq=256):
                loss_of(model, ids.cuda()).backward()
                for m, p in zip(master, model.parameters()):
                    m.grad = p.grad.float()
                    p.grad = None
                opt.step()
                opt.zero_grad()
                for m, p in zip(master, model.parameters()):
                    p.data.copy_(m)
        torch.cuda.synchronize()
        value = torch.cuda.max_memory_allocated()
        del model, opt
        torch.cuda.empty_cache()
        return value

    values = sum(p.numel() for p in _mid_llama().parameters())
    stock, ours = peak(False), peak(True)
    assert stock - ours >= 0.9 * values * 12  # fp32 master + two fp32 moments no longer in VRAM


def test_offload_auto_moves_state_to_vram_when_it_fits():
    model, opt = trainstream.wrap(tiny_llama().cuda(), lr=1e-3)  # offload="auto" by default
    session = model._trainstream_session
    assert session.adapting
    _train(model, opt, batches(3))
    assert not session.adapting
    report = trainstream.memory_report(model)
    assert report["resident"] is True
    assert any("offload='auto'" in e for e in report["events"])


def test_optimizer_mode_auto_splits_under_a_vram_cap():
    model = _mid_llama().cuda().to(torch.bfloat16)
    values = sum(p.numel() for p in model.parameters())
    free_after_step = 6 * values  # room for about half of the 12 bytes/value state
    weights = values * 2
    cap = weights * 3 + free_after_step  # weights, grads in flight and activations, plus the room
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total / 0.9))
    try:
        model, opt = trainstream.wrap(model, lr=1e-4, optimizer_mode="auto", offload=True)
        _train(model, opt, batches(3, vocab=4096, batch=2, seq=128))
        placements = trainstream.memory_report(model)["optimizer"]["placements"]
        assert "device" in placements and "host" in placements, placements
        _train(model, opt, batches(2, seed=9, vocab=4096, batch=2, seq=128))  # mixed placement keeps training
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_step_time_and_the_bytes_moved_are_what_the_report_says():
    model = _mid_llama(layers=4).cuda().to(torch.bfloat16)
    model, opt = trainstream.wrap(model, lr=1e-4, offload=True)
    data = batches(6, vocab=4096, batch=4, seq=256)
    _train(model, opt, data[:2])
    start_stats = trainstream.transfer_stats()
    updates = model._trainstream_session.engine.host.updates
    start = time.perf_counter()
    _train(model, opt, data[2:])
    per_step = (time.perf_counter() - start) / 4
    assert per_step < 2.0
    report = trainstream.memory_report(model)
    moved = {k: report["transfers"][k] - start_stats[k] for k in start_stats}
    n_params = len(list(model.parameters()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Every bf16 gradient went down once per step and every bf16 weight came back once.
    assert moved == {"d2h_bytes": 4 * weight_bytes, "d2h_copies": 4 * n_params,
                     "h2d_bytes": 4 * weight_bytes, "h2d_copies": 4 * n_params}, moved
    assert report["optimizer"]["host_updates"] - updates == 4 * n_params
    assert report["optimizer"]["placements"] == {"host": {"params": n_params, "values": weight_bytes // 2,
                                                          "state_bytes": report["optimizer"]["placements"]["host"]["state_bytes"]}}


def test_reads_right_after_step_see_the_update_on_cuda():
    """The H200 case of the engine issue: a read right after step() returned the previous weight in 1 of 8 steps."""
    model = _mid_llama(layers=4).cuda().to(torch.bfloat16)
    model, opt = trainstream.wrap(model, lr=1e-3, offload=True)
    params = list(model.parameters())
    for ids in batches(8, vocab=4096, batch=4, seq=256, distinct=None):
        loss_of(model, ids.cuda()).backward()
        opt.step()
        read = [p.detach().clone() for p in params]  # on the compute stream, right after step()
        masters = opt.state_dict()["state"]
        for i, r in enumerate(read):
            assert torch.equal(r, masters[i]["master_param"].cuda().to(torch.bfloat16)), f"parameter {i} read stale"
        opt.zero_grad()


def test_guard_params_costs_little_on_cuda():
    """guard_params=True against False on the same model: the step time may grow by 10 % at most.

    Each model runs runs of 6 steps in a row, timed from the first step's start to the end of the last
    step's host updates (synchronize()), and the two models' runs alternate; the best run of each is
    compared. Steps alternating between the two models (this test until 2026-12-03) measured the wrong
    thing: the unguarded model's host updates, still running after its step() returned, ran inside the
    guarded model's next timed step (the two engines share the host's cores and the GIL), so the guard
    looked 14-31 % dearer than it is."""
    runs = {}
    for guard in (False, True):
        model = _mid_llama(layers=8).cuda().to(torch.bfloat16)
        runs[guard] = (*trainstream.wrap(model, lr=1e-4, offload=True, guard_params=guard), [])
    data = [ids.cuda() for ids in batches(6, vocab=4096, batch=4, seq=512)]
    for _round in range(4):
        for guard in (False, True):
            model, opt, times = runs[guard]
            torch.cuda.synchronize()
            start = time.perf_counter()
            for ids in data:
                loss_of(model, ids).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / len(data))
    for model, _opt, _times in runs.values():
        trainstream.unwrap(model)
    unguarded, guarded = (min(runs[g][2][1:]) for g in (False, True))  # the first run of each warms up
    print(f"best runs: guard_params=False {unguarded:.4f} s/step, True {guarded:.4f} s/step")
    assert guarded < unguarded * 1.10


def test_quantized_base_trains_on_cuda_like_on_cpu():
    """wrap(quantize="nf4") on CUDA: the frozen block linears run through ts-quant's CUDA path (the fused
    kernel on sm_90) and the trainable rest follows the CPU run of the same model within bf16 rounding."""
    import ts_quant

    def frozen_base():
        model = tiny_llama(layers=2, dtype=torch.bfloat16)
        for block in trainstream.find_blocks(model):
            for module in block.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.requires_grad_(False)
        return model

    data = batches(8)
    runs = {}
    for device in ("cpu", "cuda"):
        model = frozen_base()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        model, opt = trainstream.wrap(model, opt, device=device, quantize="nf4")
        runs[device] = _train(model, opt, data, device)
        if device == "cuda":
            layer = next(m for m in model.modules() if isinstance(m, ts_quant.QuantLinear))
            x = torch.zeros(4, layer.in_features, device="cuda", dtype=torch.bfloat16)
            expected = "fused_sm90" if torch.cuda.get_device_capability() == (9, 0) else "dequantize"
            assert ts_quant.linear_path(x, layer.qweight) == expected
        trainstream.unwrap(model)
    assert runs["cuda"][-1] < runs["cuda"][0]
    assert runs["cuda"] == pytest.approx(runs["cpu"], rel=3e-2)


def _eager_llama(layers=4, hidden=512, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=4096,
                         tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(config).cuda().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", [{"activation_offload": True}, {"recompute": True},
                                    {"activation_offload": [0, 1], "recompute": [2, 3], "prefetch_depth": 2}])
def test_paging_and_recompute_are_bit_exact_on_cuda(dtype, policy):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        data = batches(4, vocab=4096, batch=4, seq=512)  # activations well above the other allocations
        runs = {}
        for name, options in (("keep", {"activation_offload": False, "recompute": False}),
                              ("policy", {"recompute": False, "activation_offload": False, **policy,
                                          "min_offload_bytes": 0})):
            model, opt = trainstream.wrap(_eager_llama(dtype=dtype), lr=1e-3, offload=True, **options)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            losses = _train(model, opt, data)
            runs[name] = (losses, [p.detach().clone() for p in model.parameters()],
                          torch.cuda.max_memory_allocated(), trainstream.memory_report(model)["activations"])
            trainstream.unwrap(model)
        assert runs["policy"][0] == runs["keep"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs["policy"][1], runs["keep"][1]))
        assert runs["policy"][2] < runs["keep"][2]  # the activations really left VRAM
        paging = runs["policy"][3]["paging"]
        if "activation_offload" in policy:
            assert paging["d2h_bytes"] == paging["h2d_bytes"] > 0
    finally:
        torch.use_deterministic_algorithms(False)


def test_paged_activations_leave_no_page_behind_on_cuda():
    import gc

    import ts_pinned

    model, opt = trainstream.wrap(_eager_llama(), lr=1e-3, offload=True, activation_offload=True)
    _train(model, opt, batches(2, vocab=4096, batch=2, seq=256))
    gc.collect()
    model._trainstream_session.activations.offloader.synchronize()
    assert ts_pinned.pinned_stats()["by_tag"].get("activations", 0) == 0
    trainstream.unwrap(model)


def test_paged_pages_land_in_memory_no_queued_kernel_still_uses():
    """Many steps of a deep bf16 model, every block paged two ahead: pages come back while
    backward's kernels are queued, into memory the allocator just reused (before the fix, pages
    were allocated on the compute stream and filled from the H2D stream: NaN at 4 x 2048)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        data = batches(8, vocab=4096, batch=8, seq=512)
        runs = {}
        for name, options in (("keep", {"activation_offload": False}),
                              ("paged", {"activation_offload": True, "prefetch_depth": 2, "min_offload_bytes": 0})):
            model, opt = trainstream.wrap(_eager_llama(layers=8, dtype=torch.bfloat16), lr=1e-3, offload=True,
                                          recompute=False, **options)
            runs[name] = (_train(model, opt, data), [p.detach().clone() for p in model.parameters()])
            trainstream.unwrap(model)
        assert runs["paged"][0] == runs["keep"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs["paged"][1], runs["keep"][1]))
    finally:
        torch.use_deterministic_algorithms(False)


def test_auto_fits_a_capped_gpu_and_trains_exactly_like_keeping():
    """Activations larger than the VRAM left: 'auto' probes, tries, settles, never runs out of
    memory, and the numbers equal the uncapped run's bit for bit."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        data = batches(7, vocab=4096, batch=8, seq=512)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model, opt = trainstream.wrap(_eager_llama(layers=8, dtype=torch.bfloat16), lr=1e-3, offload=True,
                                      activation_offload=False, recompute=False)
        base = torch.cuda.memory_allocated() - start
        keep = _train(model, opt, data)
        keep_params = [p.detach().clone() for p in model.parameters()]
        activations = torch.cuda.max_memory_allocated() - start - base
        trainstream.unwrap(model)
        del model, opt
        torch.cuda.empty_cache()
        # A budget (after the 10 % headroom) of the weights plus 40 % of the activations.
        cap = (torch.cuda.memory_allocated() + base + 0.4 * activations) / 0.9
        torch.cuda.set_per_process_memory_fraction(cap / total)
        model, opt = trainstream.wrap(_eager_llama(layers=8, dtype=torch.bfloat16), lr=1e-3, offload=True)
        losses = _train(model, opt, data)
        report = trainstream.memory_report(model)["activations"]
        assert report["tuning"]["phase"] == "settled", report["tuning"]
        assert report["policy"].count("keep") < 8
        assert losses == keep
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), keep_params))
        trainstream.unwrap(model)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.05}, {"accumulation_steps": 2}])
def test_resident_state_updates_in_one_fused_launch_like_torch_adamw(options):
    """After offload='auto' moves the state to VRAM, no per-tensor hook is left and step() updates
    every parameter in one fused launch; the numbers follow torch's AdamW (fp32 model)."""
    torch.manual_seed(0)
    model = tiny_llama().cuda()
    twin = copy.deepcopy(model)
    ours, opt = trainstream.wrap(model, lr=1e-3, **options)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.0)
    opt.param_groups[0]["weight_decay"] = 0.0
    data = batches(8, seed=3)
    micro = options.get("accumulation_steps", 1)
    for i, ids in enumerate(data):
        ids = ids.cuda()
        loss_of(ours, ids).div(micro).backward()
        loss_of(twin, ids).div(micro).backward()
        if (i + 1) % micro == 0:
            if "max_grad_norm" in options:
                torch.nn.utils.clip_grad_norm_(twin.parameters(), options["max_grad_norm"])
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    ours._trainstream_session.synchronize()
    slots = ours._trainstream_session.engine.active
    assert all(s.placement == "device" and s.hook is None for s in slots)
    assert max_param_diff(ours, twin) < 1e-5
    trainstream.unwrap(ours)


@pytest.mark.parametrize("options", [{}, {"recompute": True}, {"activation_offload": True, "min_offload_bytes": 0}])
def test_streamed_frozen_weights_are_bit_exact_and_stay_off_the_gpu(options):
    """param_offload on a bf16 base with a trained head: the same numbers as keeping the weights,
    while VRAM holds only the resident blocks' weights."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        data = batches(4, vocab=4096, batch=2, seq=256)
        runs = {}
        for name, extra in (("resident", {}), ("streamed", {"param_offload": True, "weights_prefetch_depth": 2})):
            model = _eager_llama(layers=8, hidden=1024, dtype=torch.bfloat16)
            for layer in model.model.layers:
                layer.requires_grad_(False)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            chosen = {"recompute": False, "activation_offload": False, **options, **extra}
            ours, opt = trainstream.wrap(model, lr=1e-3, offload=True, **chosen)
            after_wrap = torch.cuda.memory_allocated() - base
            runs[name] = (_train(ours, opt, data), [p.detach().clone().cpu() for p in ours.parameters()], after_wrap)
            trainstream.unwrap(ours)
            del ours, opt, model
            torch.cuda.empty_cache()
        assert runs["streamed"][0] == runs["resident"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs["streamed"][1], runs["resident"][1]))
        block_bytes = 12 * 1024 * 1024 * 2 + 4 * 1024 * 1024 * 2  # one layer's bf16 weights, about
        assert runs["resident"][2] - runs["streamed"][2] > 4 * block_bytes  # most blocks left the GPU
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.cuda
def test_offload_auto_measures_mapped_against_host_when_the_state_does_not_fit(monkeypatch):
    """The state 'does not fit' (its device size is inflated): offload='auto' tries CUDA AdamW over
    mapped host memory against host AdamW, logs the decision, and trains like torch's AdamW either way."""
    import trainstream._session as session_module

    monkeypatch.setattr(session_module, "device_state_bytes", lambda slot: 1 << 50)
    torch.manual_seed(0)
    model = _mid_llama(layers=2, hidden=256).cuda()
    twin = copy.deepcopy(model)
    model, opt = trainstream.wrap(model, lr=1e-3, offload="auto", mapped_trial=True)  # a prototype: asked for
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.01)
    placements = []
    for ids in batches(14, vocab=4096, batch=2, seq=64):
        for m, o in ((model, opt), (twin, ref)):
            loss_of(m, ids.cuda()).backward()
            o.step()
            o.zero_grad()
        placements.append({s.placement for s in model._trainstream_session.engine.active})
    events = trainstream.memory_report(model)["events"]
    assert any("trying CUDA AdamW over mapped host memory" in e for e in events), events
    decided = [e for e in events if "stays:" in e or "back to host AdamW" in e]
    assert len(decided) == 1, events
    assert {"mapped"} in placements and model._trainstream_session.trial is None
    assert max_param_diff(model, twin) < 1e-4
    trainstream.unwrap(model)


@pytest.mark.cuda
@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_streamed_quantized_codes_train_like_resident_ones_on_cuda(quantize):
    """The codes and scales of streamed blocks visit the GPU in the blocks' buffers (new addresses at
    each visit: ts-quant's per-weight plans are rebuilt); training equals keeping them resident. One
    attention kernel for both runs: attention="auto" measures each run anew and may pin another."""
    peft = pytest.importorskip("peft")

    def lora():
        torch.manual_seed(0)
        model = _mid_llama(layers=4, hidden=512).to(torch.bfloat16)
        return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))

    runs = []
    for offload in (False, True):
        # both quantized where the model is (the CPU), then moved or streamed: the same codes
        model, opt = trainstream.wrap(lora(), lr=1e-3, quantize=quantize, param_offload=offload, device="cuda",
                                      attention="default")
        losses = _train(model, opt, batches(4, vocab=4096, batch=2, seq=128))
        runs.append((losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
