"""param_offload='auto': the plan made at wrap() picks the fewest streamed blocks with which it fits
(quantize=None), none when quantization decides, and wrap() streams those blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trainstream
from trainstream._options import parse_options
from trainstream.planning import decide as _decide
from ts_testing import batches, loss_of, tiny_llama

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GiB = 1 << 30


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, target_modules=PROJECTIONS))


@pytest.fixture(scope="module")
def lora_7b_on_meta():
    """A Qwen2.5-7B-shaped bf16 LoRA model on the meta device: the plan reads sizes only."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return _lora(model)


def _auto(model, opts):
    """param_offload='auto''s decision (planning/decide.py) on `model` for the CPU, as plan() makes it."""
    from trainstream.memory.blocks import find_blocks
    from trainstream.memory.sizing import describe_model

    blocks = find_blocks(model)
    facts = describe_model(model, blocks)
    inputs = _decide._Inputs(blocks, facts, _decide.wrap_budget(torch.device("cpu"), opts, facts), 0.0)
    return _decide._auto_param_offload(opts, inputs, opts.moment_dtype)


def _with_vram(monkeypatch, vram_gib: float):
    real = _decide.wrap_budget
    monkeypatch.setattr(_decide, "wrap_budget", lambda d, o, f: dataclasses.replace(
        real(d, o, f), vram_bytes=int(vram_gib * GiB), host_bytes=200 * GiB, pinned_bytes=150 * GiB))


def test_less_vram_never_streams_fewer_blocks_and_enough_streams_none(lora_7b_on_meta, monkeypatch):
    opts = parse_options({"param_offload": "auto", "quantize": None})
    counts = []
    for vram in (40, 24, 16, 12, 8):
        _with_vram(monkeypatch, vram)
        chosen, why, implied = _auto(lora_7b_on_meta, opts)
        assert implied is None
        counts.append(0 if chosen is False else len(chosen))
        assert "param_offload='auto'" in why
        if chosen:
            assert chosen == sorted(set(chosen)) and all(0 <= i < 28 for i in chosen)
    assert counts[0] == 0 and 0 < counts[2] < 28  # 40 GiB holds the 15 GB base; 16 GiB streams some of it
    assert counts == sorted(counts)


def test_auto_leaves_the_weights_to_quantize_when_it_is_on(lora_7b_on_meta, monkeypatch):
    """prefer='speed': quantizing is the faster way to fit, so nothing streams while a format fits."""
    _with_vram(monkeypatch, 12)  # NF4 codes of the 7B base fit with every block resident
    for quantize, why_part in (("auto", "quantize='auto' fits the weights"), ("nf4", "none stream")):
        chosen, why, implied = _auto(lora_7b_on_meta, parse_options(
            {"param_offload": "auto", "quantize": quantize, "prefer": "speed"}))
        assert chosen is False and implied is None and why_part in why


def test_prefer_exact_streams_exact_weights_before_quantizing(lora_7b_on_meta, monkeypatch):
    """prefer='exact' (the default): quantize='auto' quantizes only when even streaming every block the
    exact weights do not fit; a fitting stream of exact weights wins over resident codes."""
    opts = parse_options({"param_offload": "auto", "quantize": "auto"})
    assert opts.prefer == "exact"
    _with_vram(monkeypatch, 12)
    chosen, why, implied = _auto(lora_7b_on_meta, opts)
    exact, _, _ = _auto(lora_7b_on_meta, parse_options({"param_offload": "auto", "quantize": None}))
    assert implied is None and chosen == exact and 0 < len(chosen) < 28
    assert "as stored" in why and "prefer='exact'" in why
    _with_vram(monkeypatch, 8)  # no exact stream fits: the NF4 codes stream, and the event says why
    chosen, why, implied = _auto(lora_7b_on_meta, opts)
    assert implied == "nf4" and chosen and "even with every block streamed the exact weights do not fit" in why
    _with_vram(monkeypatch, 40)  # everything fits as it is: nothing streams, nothing to quantize
    chosen, why, implied = _auto(lora_7b_on_meta, opts)
    assert chosen is False and implied is None
    with pytest.raises(ValueError, match="prefer"):
        parse_options({"prefer": "fast"})


def test_when_no_quantization_fits_resident_the_codes_stream(lora_7b_on_meta, monkeypatch):
    """Less VRAM than even the NF4 base: quantize='nf4' streams the fewest blocks of codes, and
    quantize='auto' does the same with NF4 (the implied format)."""
    counts = {}
    for vram in (10, 9, 8):  # 12 GiB holds the NF4 base resident (the test above)
        _with_vram(monkeypatch, vram)
        for quantize in ("nf4", "auto"):
            chosen, why, implied = _auto(lora_7b_on_meta, parse_options(
                {"param_offload": "auto", "quantize": quantize, "prefer": "speed"}))
            assert implied == (None if quantize == "nf4" else "nf4")
            assert chosen and "as nf4 codes" in why, why
            counts.setdefault(quantize, []).append(len(chosen))
    assert counts["nf4"] == counts["auto"] == sorted(counts["nf4"])
    assert 0 < counts["nf4"][0] < counts["nf4"][-1] < 28


def test_wrap_streams_the_blocks_auto_chose_and_trains_like_resident(monkeypatch):
    data = batches(3)
    runs = []
    for offload in (False, "auto"):
        model = _lora(tiny_llama(layers=4))
        if offload:
            _with_vram(monkeypatch, 0.02)  # 20 MiB: the plan streams the blocks
        model, opt = trainstream.wrap(model, lr=1e-3, param_offload=offload, quantize=None)
        losses = []
        for ids in data:
            loss = loss_of(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        report = trainstream.memory_report(model)
        runs.append((losses, report))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert runs[1][1]["params"]["streaming"]["streamed_blocks"] == [0, 1, 2, 3]  # the plan at wrap(), 2048 tokens
    assert any("param_offload='auto'" in e for e in runs[1][1]["events"])


def test_local_ranks_sharing_the_streamed_copy_count_it_once_per_machine(lora_7b_on_meta, monkeypatch):
    """Under data parallel the streamed frozen weights are one /dev/shm copy per machine
    (weights/shared_host.py): the plan counts each local rank's share, not a copy per rank."""
    import collections

    import trainstream.distributed as tsd
    from trainstream.memory.blocks import find_blocks
    from trainstream.memory.sizing import describe_model, plan_wrap

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(_decide.shutil, "disk_usage", lambda path: usage(1 << 50, 0, 1 << 50))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    one = parse_options({"param_offload": True})
    assert _decide._streamed_shared_by(one, 1 << 30) == 1  # no process group
    monkeypatch.setattr(tsd, "world_of", lambda distributed: 1 if distributed is False else 8)
    assert _decide._streamed_shared_by(one, 1 << 30) == 4  # 8 ranks, 4 on this machine
    assert _decide._streamed_shared_by(parse_options({"param_offload": True, "distributed": False}), 1 << 30) == 1
    monkeypatch.setattr(_decide.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, (1 << 30) - 1))
    assert _decide._streamed_shared_by(one, 1 << 30) == 1  # no room in /dev/shm: private copies

    facts = describe_model(lora_7b_on_meta, find_blocks(lora_7b_on_meta))
    budget = dataclasses.replace(_decide.wrap_budget(torch.device("cpu"), one, facts), host_bytes=200 * GiB,
                                 pinned_bytes=150 * GiB)
    private, shared = (plan_wrap(facts, budget, quantize=None, streamed_blocks=28, streamed_shared_by=k).plan
                       for k in (1, 4))
    whole = private.estimate.pinned["streamed_weights"]
    assert whole > 10 * GiB and shared.estimate.pinned["streamed_weights"] == -(-whole // 4)
    assert private.host_bytes - shared.host_bytes == whole - -(-whole // 4)
    # param_offload='auto' plans with the same sharing.
    seen = []
    real = _decide.plan_wrap
    monkeypatch.setattr(_decide, "plan_wrap", lambda *a, **k: seen.append(k.get("streamed_shared_by")) or real(*a, **k))
    monkeypatch.setattr(_decide.shutil, "disk_usage", lambda path: usage(1 << 50, 0, 1 << 50))
    _with_vram(monkeypatch, 16)
    _auto(lora_7b_on_meta, parse_options({"param_offload": "auto",
                                                                                   "quantize": None}))
    assert seen and set(seen) == {4}
