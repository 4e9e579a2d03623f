"""TrainStreamCache in model.generate(): the same tokens as DynamicCache (greedy and sampling,
resident_layers none / some / all, page boundaries, batch 3 with padding, growth past
max_tokens, reset then a new prompt), and the models and modes it refuses."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("ts_kvcache")

from trainstream.integrations.kvcache import TrainStreamCache  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

LAYERS = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def _prompts(batch=3, length=11, seed=0, pad=(0, 3, 5)):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, count in enumerate(pad[:batch]):  # left padding, as batched generation uses
        ids[row, :count] = 0
        mask[row, :count] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, inputs, cache, new=9, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames past_key_values to cache
        return model.generate(**inputs, max_new_tokens=new, past_key_values=cache, pad_token_id=0,
                              **({"do_sample": False} | kwargs))


@pytest.mark.parametrize("resident, page_tokens", [(0, 4), (2, 1), (LAYERS, 256), ([3], 3), (0, 256)])
def test_greedy_tokens_match_dynamic_cache(model, resident, page_tokens):
    inputs = _prompts()
    want = _generate(model, inputs, DynamicCache())
    cache = TrainStreamCache(model, max_tokens=14, resident_layers=resident, page_tokens=page_tokens)
    got = _generate(model, inputs, cache)  # 11 + 9 tokens: grows past max_tokens=14
    assert torch.equal(got, want)
    kv = cache.kv
    assert kv.seq_length() == got.shape[1] - 1  # the last token is sampled, never cached
    kv.check_invariants()
    if resident == 0 and page_tokens == 4:
        assert kv.stats["prefetched"] > 0 and kv.stats["pages"] == LAYERS * 5  # 19 tokens: 4 full pages, 1 partly
        assert kv.stats["reallocations"] >= 1


@pytest.mark.parametrize("resident, chunk", [(0, 4), (2, 5), (LAYERS, 3)])
def test_chunked_prefill_matches_dynamic_cache(model, resident, chunk):
    """transformers' prefill_chunk_size: the prompt reaches the cache in several updates before decoding
    (what the 4x-batch benchmark uses so the prefill's MLP fits); chunks that cross page boundaries."""
    inputs = _prompts()
    want = _generate(model, inputs, DynamicCache())
    cache = TrainStreamCache(model, max_tokens=14, resident_layers=resident, page_tokens=4)
    lengths, update = [], cache.kv.update
    cache.kv.update = lambda layer, k, v: (lengths.append(k.shape[-2]) if layer == 0 else None) or update(layer, k, v)
    got = _generate(model, inputs, cache, prefill_chunk_size=chunk)
    assert torch.equal(got, want)
    prompt = inputs["input_ids"].shape[1]
    assert lengths[: -(got.shape[1] - prompt - 1)] == [min(chunk, prompt - i) for i in range(0, prompt, chunk)]
    assert cache.kv.seq_length() == got.shape[1] - 1
    cache.kv.check_invariants()


def test_reset_then_a_new_prompt_matches(model):
    cache = TrainStreamCache(model, max_tokens=32, resident_layers=1, page_tokens=3)
    for seed, batch in [(1, 3), (2, 2)]:
        inputs = _prompts(batch=batch, seed=seed)
        want = _generate(model, inputs, DynamicCache())
        cache.reset()
        assert cache.get_seq_length() == 0
        assert torch.equal(_generate(model, inputs, cache), want)
    held = cache.kv.memory()
    assert held["host_bytes"] > 0
    cache.release()
    assert cache.kv.memory() == {"device_bytes": 0, "host_bytes": 0}


def test_sampling_matches_dynamic_cache_with_the_same_seed(model):
    """Sampling, two sequences per prompt (generate expands the still empty cache's batch)."""
    inputs = _prompts(seed=4)
    options = {"do_sample": True, "top_k": 20, "temperature": 0.9, "num_return_sequences": 2}
    torch.manual_seed(5)
    want = _generate(model, inputs, DynamicCache(), **options)
    torch.manual_seed(5)
    cache = TrainStreamCache(model, max_tokens=24, resident_layers=2, page_tokens=2)
    got = _generate(model, inputs, cache, **options)
    assert got.shape[0] == 6 and torch.equal(got, want)


def test_the_plan_is_an_event_of_a_wrapped_models_session(model, monkeypatch):
    from trainstream._events import EventLog

    class Session:
        events = EventLog()

    monkeypatch.setattr(model, "_trainstream_session", Session(), raising=False)
    cache = TrainStreamCache(model, max_tokens=16, resident_layers=[0, 1], page_tokens=4)
    _generate(model, _prompts(batch=2), cache, new=3)
    cache.reset()
    _generate(model, _prompts(batch=3), cache, new=3)  # a new batch: planned again
    messages = [e.message for e in Session.events if e.kind == "kvcache"]
    assert len(messages) == 2
    assert messages[0].startswith("KV cache: 2 of 4 layers in VRAM (as asked)")
    assert "layers [2, 3] in host pages of 4 tokens, run in 2 device slots" in messages[0]


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="generate(cache=) is transformers 5's keyword")
def test_cache_keyword_of_transformers_5(model):
    inputs = _prompts(seed=6)
    want = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=0)
    cache = TrainStreamCache(model, max_tokens=16, resident_layers=0, page_tokens=4)
    assert torch.equal(model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=cache), want)


def test_beam_search_is_refused(model):
    cache = TrainStreamCache(model, max_tokens=16, resident_layers=1, page_tokens=4)
    with pytest.raises(ValueError, match="greedy and sampling generation only: beam search"):
        _generate(model, _prompts(), cache, num_beams=2)


def test_beam_search_in_the_generation_config_is_refused_at_construction(model, monkeypatch):
    monkeypatch.setattr(model.generation_config, "num_beams", 3)
    with pytest.raises(ValueError, match="num_beams=3"):
        TrainStreamCache(model, max_tokens=16)


def test_sliding_window_models_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=50, sliding_window=8)
    with pytest.raises(ValueError, match=r"full attention in every layer; layers \[0, 1\].*sliding_attention"):
        TrainStreamCache(MistralForCausalLM(config), max_tokens=16)


def test_bad_arguments_name_the_valid_values(model):
    with pytest.raises(ValueError, match="page_tokens=0 must be an integer >= 1"):
        TrainStreamCache(model, max_tokens=16, page_tokens=0)
    with pytest.raises(ValueError, match='resident_layers=9 is not valid; use "auto", an integer from 0 to 4'):
        TrainStreamCache(model, max_tokens=16, resident_layers=9)
    with pytest.raises(ValueError, match="needs a transformers model"):
        TrainStreamCache(torch.nn.Linear(2, 2), max_tokens=16)


def test_auto_plan_leaves_room_for_the_models_own_forward(model):
    """The first forward's MLP and residual tensors for every prompt token, and the last token's
    logits, are what "auto" leaves free before taking vram_fraction of the rest."""
    cache = TrainStreamCache(model, max_tokens=16)
    _generate(model, _prompts(), cache, new=2)
    per_token = (3 * 128 + 4 * 64) * 4  # float32: intermediate 128, hidden 64
    assert cache.kv.plan["working_bytes"] == 3 * 11 * per_token + 2 * 3 * 97 * 4
    assert "working_bytes" not in TrainStreamCache(model, max_tokens=16, resident_layers=2).kv.plan


def test_auto_plan_leaves_room_for_eager_attention_scores(model):
    """Eager attention materializes its scores (float32, scores and softmax) against up to max_tokens
    keys: the working estimate counts them; with SDPA it does not."""
    model.config._attn_implementation = "eager"
    try:
        cache = TrainStreamCache(model, max_tokens=16)
        _generate(model, _prompts(), cache, new=2)
    finally:
        model.config._attn_implementation = "sdpa"
    per_token = (3 * 128 + 4 * 64) * 4
    scores = 2 * 3 * 4 * 11 * 16 * 4  # batch 3, 4 heads, 11 prompt tokens, 16 keys at most
    assert cache.kv.plan["working_bytes"] == 3 * 11 * per_token + 2 * 3 * 97 * 4 + scores


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resident", [0, 2, LAYERS])
def test_cuda_greedy_tokens_match_dynamic_cache(model, resident, dtype):
    """The cache returns exactly torch.cat's values (test_cuda.py); tokens then match unless SDPA
    treated the strided views differently from DynamicCache's contiguous tensors."""
    gpu = LlamaForCausalLM(model.config).to("cuda", dtype).eval()
    gpu.load_state_dict(model.state_dict())
    inputs = {k: v.cuda() for k, v in _prompts().items()}
    want = _generate(gpu, inputs, DynamicCache(), new=40)
    cache = TrainStreamCache(gpu, max_tokens=32, resident_layers=resident, page_tokens=8)
    assert torch.equal(_generate(gpu, inputs, cache, new=40), want)
    if resident == 0:
        assert cache.kv.stats["prefetched"] > 0
