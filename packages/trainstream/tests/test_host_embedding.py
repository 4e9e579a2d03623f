"""host_embedding (weights/host_embedding.py): a frozen, untied input embedding lives in page-locked host
memory and the GPU gathers the rows it looks up over the link. Bit-exact against the table in VRAM (H200);
which embeddings qualify, the refusals, and the plan's pricing run on the CPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import trainstream
import ts_pinned
from trainstream.weights.host_embedding import HostEmbedding, host_embedding_candidate
from ts_testing import batches, tiny_llama, train

peft = pytest.importorskip("peft")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _lora(seed=0, dtype=torch.bfloat16, tie=False):
    torch.manual_seed(seed)
    base = tiny_llama(seed, layers=2, dtype=dtype)
    if tie:
        base.lm_head.weight = base.model.embed_tokens.weight
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_which_embeddings_qualify():
    embedding, why = host_embedding_candidate(_lora())
    assert embedding is not None and why == ""
    assert host_embedding_candidate(_lora(tie=True)) == (None, "the input embedding's weight is shared (tied to the "
                                                              "output layer)")
    trained = tiny_llama()  # a full fine-tune trains its embedding
    assert host_embedding_candidate(trained)[1] == "the input embedding is trained"
    assert host_embedding_candidate(torch.nn.Linear(2, 2))[0] is None


def test_on_the_cpu_nothing_moves_and_true_is_refused_with_the_reason():
    model, _ = trainstream.wrap(_lora(), lr=1e-3)  # "auto"
    assert "host_embedding" not in trainstream.memory_report(model)["params"]
    trainstream.unwrap(model)
    with pytest.raises(ValueError, match="host_embedding=True cannot apply: the model trains on the CPU"):
        trainstream.wrap(_lora(), lr=1e-3, host_embedding=True)
    with pytest.raises(ValueError, match="host_embedding='yes' is not valid; use one of 'auto', True, False"):
        trainstream.wrap(_lora(), lr=1e-3, host_embedding="yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU driver nothing is page-locked")
def test_install_refuses_a_table_that_is_not_page_locked():
    embedding = _lora().get_input_embeddings()
    before = embedding.weight.detach().clone()
    table = HostEmbedding(embedding, torch.device("cpu"), ts_pinned.default_arena())
    with pytest.raises(RuntimeError, match="page-lock budget cannot hold the input embedding"):
        table.install()
    table.remove()
    assert "forward" not in embedding.__dict__ and torch.equal(embedding.weight, before)


def test_the_plan_moves_the_table_from_vram_to_page_locked_host_memory():
    import ts_planner

    shape = ts_planner.ModelShape.from_config(dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                                                   num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                                   tie_word_embeddings=False))
    base = ts_planner.Options(batch=1, seq=512, train="lora", quantize="nf4")
    off = ts_planner.estimate_memory(shape, base)
    on = ts_planner.estimate_memory(shape, ts_planner.Options(**{**base.__dict__, "embedding_on_host": True}))
    table = 152064 * 5120 * 2
    assert off.vram["frozen_weights"] - on.vram["frozen_weights"] == table
    assert on.pinned["embedding"] == table and off.pinned["embedding"] == 0
    assert on.h2d_bytes - off.h2d_bytes == 512 * 5120 * 2  # the rows looked up
    with pytest.raises(ValueError, match="embedding_on_host is for a frozen embedding"):
        ts_planner.Options(train="full", embedding_on_host=True)


# ---- on a GPU ---------------------------------------------------------------------------------


def _params(model):
    return [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("extra", [{}, {"param_offload": True, "recompute": True}])
def test_cuda_training_is_bit_exact_against_the_table_in_vram(extra):
    runs = []
    for on in (False, True):
        model, opt = trainstream.wrap(_lora().cuda(), lr=1e-3, host_embedding=on, **extra)
        weight = model.get_input_embeddings().weight
        assert weight.device.type == ("cpu" if on else "cuda")
        losses = train(model, opt, batches(4), device="cuda")
        runs.append((losses, _params(model), trainstream.memory_report(model)["params"].get("host_embedding")))
        trainstream.unwrap(model)
        assert model.get_input_embeddings().weight.device.type == "cuda"  # back where it was
        assert "forward" not in model.get_input_embeddings().__dict__
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert runs[0][2] is None and runs[1][2]["lookups"] == 4 and runs[1][2]["rows_read"] == 4 * 2 * 16


@pytest.mark.cuda
@cuda
def test_cuda_lookups_of_cpu_ids_copies_and_pickles_behave_like_a_plain_embedding():
    reference = _lora().cuda()
    model, _ = trainstream.wrap(_lora().cuda(), lr=1e-3, host_embedding=True)  # a prototype: asked for
    assert "host_embedding" in trainstream.memory_report(model)["params"]
    ids = torch.randint(0, 97, (3, 11))
    expected = reference.get_input_embeddings()(ids.cuda())
    embedding = model.get_input_embeddings()
    assert torch.equal(embedding(ids.cuda()), expected)
    assert torch.equal(embedding(ids), expected)  # ids on the CPU: looked up there, uploaded
    assert torch.equal(embedding(ids.cuda().int()), expected)
    clone = copy.deepcopy(model)  # a copy is a plain model: its table is an ordinary CPU tensor
    assert torch.equal(clone.get_input_embeddings().cuda()(ids.cuda()), expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded.get_input_embeddings().cuda()(ids.cuda()), expected)
    trainstream.unwrap(model)


@pytest.mark.cuda
@cuda
def test_cuda_an_id_out_of_range_is_raised_by_the_next_lookup():
    model, _ = trainstream.wrap(_lora().cuda(), lr=1e-3, host_embedding=True)
    embedding = model.get_input_embeddings()
    out = embedding(torch.tensor([[1, 97, 2]], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    with pytest.raises(IndexError, match=r"outside \[0, 97\)"):
        embedding(torch.tensor([[1]], device="cuda"))
    assert embedding(torch.tensor([[1]], device="cuda")).shape == (1, 1, 64)  # the flag was cleared
    trainstream.unwrap(model)
