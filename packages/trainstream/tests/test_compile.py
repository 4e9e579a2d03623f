"""torch.compile of a wrapped model's blocks: it works, and trains like the uncompiled wrapped model.

What was found (torch 2.13, CPU, backend "aot_eager"; dynamo's graph-break counters): plain blocks
and blocks of quantized LoRA layers compile whole (quantized_linear is a custom op under tracing), one
graph for the first block (its input needs no gradient) and one for all the others; the per-parameter
engine hooks run outside the graphs (post-accumulate-grad hooks fire from autograd, after the compiled
backward; the forward waits skip under tracing, the root guard orders the updates). Graph breaks, not
errors, where dynamo cannot trace: selective recompute (dynamo's checkpoint HOP refuses side effects
inside it, and transformers' decoder layers carry the ``kernels`` package's forward wrapper, which sets a
global while tracing; dynamo falls back for it), which runs eagerly inside the compiled block, with the
same losses. Blocks recomputed whole compile the forward inside an eager checkpoint instead, and paged
blocks their forward inside the eager paging hooks (a whole-block compile traced those hooks into the
graph and failed in backward): no graph break. Blocks whose weights stream compile their forward inside
the eager fetch hooks, which are the block's (a compiled forward is one backward node; the hook on its
output's gradient runs before it): no graph break either. A whole wrapped model compiles too
(``torch.compile(model)``), with one graph break at the root guard and, with streamed blocks, one around
each streamed block's fetch hooks, which never trace.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import trainstream
from ts_testing import batches, loss_of, tiny_llama

STEPS = 2
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py


def _lora(model):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def _layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def _train(model, compile_backend, device="cpu", steps=STEPS, compile_after=0, **options):
    """Losses of `steps` steps; the blocks compiled (in place: the module and its hooks stay the same
    objects) before step `compile_after`."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model, opt = trainstream.wrap(model, opt, device=device, **options)
    losses = []
    for step, ids in enumerate(batches(steps)):
        if compile_backend and step == compile_after:
            assert trainstream.compile_blocks(model, backend=compile_backend) == list(range(len(_layers(model))))
        loss = loss_of(model, ids.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model._trainstream_session.synchronize()
    return model, losses


def _losses(forward, opt, steps=3):
    losses = []
    for ids in batches(steps):
        loss = loss_of(forward, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _eager_then_compiled(run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations
        return run(False), run(True)


CASES = {
    "full": (False, {}),
    "lora-nf4": (True, {"quantize": "nf4"}),
    "recompute": (False, {"recompute": True}),
    "activation-paging": (False, {"activation_offload": True, "min_offload_bytes": 0}),  # tiny tensors page too
    "streamed-lora-nf4": (True, {"quantize": "nf4", "param_offload": True}),
    "streamed-full": (False, {"param_offload": True}),  # the trained weights stream with their blocks
    "streamed-recompute": (False, {"param_offload": True, "recompute": True}),
}


def _case_model(case, **kwargs):
    """The case's model: 4 blocks where they stream, more than fit at once (prefetch 1: 3), so each is
    evicted after forward and fetched again for backward."""
    lora, options = CASES[case]
    model = tiny_llama(layers=4 if "param_offload" in options else 2, **kwargs)
    return _lora(model) if lora else model


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_train_like_uncompiled(case):
    lora, options = CASES[case]
    model = _case_model(case)
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations under checkpointing
        _, eager = _train(model, None, **options)
        compiled_model, compiled = _train(twin, "aot_eager", **options)
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-7)
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0, "dynamo compiled nothing: the test proves nothing"
    assert compiled[-1] < compiled[0] or STEPS < 2 or lora  # it trained (LoRA's B starts at zero)
    assert all(type(layer).__name__ != "OptimizedModule" for layer in _layers(compiled_model))
    if "activation_offload" in options:  # pages were made, and brought back in the compiled backward
        assert trainstream.memory_report(compiled_model)["activations"]["paging"]["h2d_bytes"] > 0
    if "param_offload" in options:  # fetched for forward and again for the compiled backward
        streaming = trainstream.memory_report(compiled_model)["params"]["streaming"]
        assert streaming["evictions"] > 0 and streaming["fetches"] > 4  # block 0 again for its backward


def test_quantized_lora_blocks_compile_whole():
    # quantized_linear was a graph break per call (a nanobind call dynamo cannot trace) and each block
    # a recompile (guards on the forward waits' engine state) until the recompile limit gave up.
    model = tiny_llama(layers=4)
    model.config.use_cache = False  # a cache puts each layer's index in the guards
    model = _lora(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _train(model, "aot_eager", steps=3, quantize="nf4")
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["frames"]["ok"] > 0
    assert counters["stats"]["unique_graphs"] <= 2  # the first block's and the others'


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_train_like_uncompiled_on_cuda(case, backend):
    _, options = CASES[case]
    model = _case_model(case, dtype=torch.bfloat16)
    twin = copy.deepcopy(model)
    _, eager = _train(model, None, device="cuda", **options)
    _, compiled = _train(twin, backend, device="cuda", **options)
    # inductor fuses and reorders bf16 arithmetic: close, not equal
    tol = dict(rel=1e-6, abs=1e-7) if backend == "aot_eager" else dict(rel=2e-2, abs=2e-2)
    assert compiled == pytest.approx(eager, **tol)


def test_streamed_blocks_compile_their_forward_without_a_graph_break():
    # A streamed block's fetch hooks were its modules', so a compiled block (one backward node) could not
    # fetch where backward needed it (it failed in backward, a saved weight overwritten by the next fetch).
    from trainstream.activations.compiled_forward import CompiledForward

    model = tiny_llama(layers=4)
    model.config.use_cache = False
    model = _lora(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model, _ = _train(model, "aot_eager", steps=3, quantize="nf4", param_offload=[0, 2])
    layers = _layers(model)
    assert [isinstance(layer.__dict__.get("forward"), CompiledForward) for layer in layers] == [True, False, True, False]
    assert [layer._compiled_call_impl is not None for layer in layers] == [False, True, False, True]
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["frames"]["ok"] > 0


def test_compiled_streamed_blocks_unwrap_copy_and_load_like_plain_ones():
    # unwrap() gives the weights back as ordinary tensors under the compiled forward (it stays, as a compiled
    # block would); a copy gets the plain forward; a state loaded between steps is what the next step reads.
    from trainstream.activations.compiled_forward import CompiledForward

    model = tiny_llama(layers=4)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = trainstream.wrap(model, opt, param_offload=True)
    trainstream.compile_blocks(model, backend="aot_eager")
    _losses(model, opt, steps=2)
    ids = batches(1)[0]
    twin = copy.deepcopy(model)
    assert all(not isinstance(layer.__dict__.get("forward"), CompiledForward) for layer in _layers(twin))
    saved = copy.deepcopy(model.state_dict())
    _losses(model, opt, steps=1)
    model.load_state_dict(saved)
    with torch.no_grad():
        torch.testing.assert_close(loss_of(model, ids), loss_of(twin, ids), rtol=0, atol=0)
    trainstream.unwrap(model)
    assert all(isinstance(layer.__dict__.get("forward"), CompiledForward) for layer in _layers(model))
    with torch.no_grad():
        torch.testing.assert_close(loss_of(model, ids), loss_of(twin, ids), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["block", "model"])
def test_a_streamed_block_compiled_by_hand_or_in_a_compiled_model_trains_like_eager(how):
    # block.compile() and torch.compile(model) trace the block's hooks; the fetch hooks never trace, so they
    # run eagerly at graph breaks, and the fetches happen where they must.
    def run(compiled):
        model = tiny_llama(layers=4)
        model.config.use_cache = False
        model = _lora(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        model, opt = trainstream.wrap(model, opt, quantize="nf4", param_offload=True)
        forward = model
        if compiled and how == "block":
            _layers(model)[0].compile(backend="aot_eager")  # evicted after forward (3 fit), fetched for backward
        elif compiled:
            forward = torch.compile(model, backend="aot_eager")
        losses = _losses(forward, opt)
        streaming = trainstream.memory_report(model)["params"]["streaming"]
        assert streaming["evictions"] > 0 and streaming["fetches"] > 4
        return losses

    eager, compiled = _eager_then_compiled(run)
    assert compiled == eager
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0


def test_skip_streamed_leaves_the_streamed_blocks_eager():
    model, _ = trainstream.wrap(_lora(tiny_llama(layers=4)), None, quantize="nf4", param_offload=[0, 2])
    assert trainstream.compile_blocks(model, skip_streamed=True, backend="aot_eager") == [1, 3]
    layers = _layers(model)
    assert [layer._compiled_call_impl is not None or "forward" in layer.__dict__ for layer in layers] == [
        False, True, False, True]


def test_the_resident_blocks_of_a_streamed_model_compile_and_train_like_eager():
    def run(compiled):
        model = _lora(tiny_llama(layers=4))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        model, opt = trainstream.wrap(model, opt, quantize="nf4", param_offload=[0, 2])
        if compiled:
            assert trainstream.compile_blocks(model, skip_streamed=True, backend="aot_eager") == [1, 3]
            assert [layer._compiled_call_impl is not None for layer in _layers(model)] == [False, True, False, True]
        return _losses(model, opt)

    eager, compiled = _eager_then_compiled(run)
    assert compiled == eager
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0


def test_compile_blocks_refuses_bad_input_before_compiling_anything():
    model = tiny_llama()
    with pytest.raises(ValueError, match="mode='fast': one of 'default'"):
        trainstream.compile_blocks(model, "fast")
    with pytest.raises(ValueError, match="'reduce-overhead' captures CUDA graphs"):
        trainstream.compile_blocks(model, "reduce-overhead")
    with pytest.raises(ValueError, match="no blocks found"):
        trainstream.compile_blocks(torch.nn.Linear(2, 2))
    assert all(layer._compiled_call_impl is None for layer in _layers(model))


def test_a_compile_orders_the_pending_updates_and_survives_a_dynamo_reset():
    # guard_params=False: step() leaves the ordering of each update to the next forward (engine/guard.py).
    model = tiny_llama()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = trainstream.wrap(model, opt, guard_params=False)
    session = model._trainstream_session
    ids = batches(1)[0]

    def step():
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()
        return [s for s in session.engine.slots if s.written is not None]

    assert step() and not session.guard.compiled  # eager: updates pending until the next forward
    torch._dynamo.reset()  # drops dynamo's callbacks: the next forward registers the guard's again
    with torch.no_grad():
        loss_of(model, ids)
    assert step()  # layer 0's waits ran eagerly last time: the root guard leaves its updates to them
    _layers(model)[0].compile(backend="aot_eager", dynamic=False)
    with torch.no_grad():
        loss_of(model, ids)  # compiles layer 0, whose waits then skip: the callback ordered every update first
    assert session.guard.compiled
    assert not [s for s in session.engine.slots if s.written is not None]


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_blocks_compiled_mid_run_read_every_update(mode):
    # The first compiled forward skips the per-module waits: what orders the updates of the eager step
    # before it is the compile callback (and from then on the root guard). With guard_params=False
    # step() leaves that ordering to the forward; aot_eager keeps the bits.
    model = tiny_llama(dtype=torch.bfloat16)
    twin = copy.deepcopy(model)
    options = dict(optimizer_mode=mode, offload=True, guard_params=False)
    _, eager = _train(model, None, device="cuda", steps=4, **options)
    _, compiled = _train(twin, "aot_eager", device="cuda", steps=4, compile_after=2, **options)
    assert compiled == eager


def test_a_compiled_wrapped_model_trains_like_the_eager_one():
    # torch.compile(model) (what Trainer's torch_compile does): the root guard runs eagerly (one graph
    # break at the top), everything below it compiles, quantized LoRA layers included.
    def run(compiled):
        model = tiny_llama(layers=3)
        model.config.use_cache = False
        model = _lora(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        model, opt = trainstream.wrap(model, opt, quantize="nf4")
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        return _losses(forward, opt)

    eager, compiled = _eager_then_compiled(run)
    assert compiled == eager
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0 and breaks <= 1, dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_recomputed_blocks_compile_their_forward_under_an_eager_checkpoint(dropout):
    # Compiling a recomputed block whole put the checkpoint inside the graph: dynamo's checkpoint
    # operator refused the global the kernels package's wrapper sets, and the block ran eagerly.
    # Against blocks that keep their activations: with dropout, the recomputation inside backward
    # must draw the forward's masks again.
    def run(compiled):
        model = tiny_llama(layers=3).train()
        for layer in _layers(model):
            layer.self_attn.attention_dropout = dropout  # read from the config at construction
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = trainstream.wrap(model, opt, recompute=compiled)
        if compiled:
            trainstream.compile_blocks(model, backend="aot_eager")
            wrappers = [layer.__dict__["forward"] for layer in _layers(model)]
        losses = _losses(model, opt)
        if compiled:
            assert all(w.calls == 3 and w.compiled is not None for w in wrappers)  # checkpointed every step
        return losses

    kept, compiled = _eager_then_compiled(run)
    assert compiled == kept
    counters = torch._dynamo.utils.counters
    assert counters["frames"]["ok"] > 0
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2  # the first block's and the others'


def test_an_unwrapped_recomputed_block_stays_compiled():
    model, _ = trainstream.wrap(tiny_llama(layers=2), None, recompute=True)
    trainstream.compile_blocks(model, backend="aot_eager")
    trainstream.unwrap(model)
    assert all("forward" not in layer.__dict__ for layer in _layers(model))
    assert all(layer._compiled_call_impl is not None for layer in _layers(model))


def test_paged_blocks_compile_their_forward_and_a_copy_gets_the_plain_one():
    # A whole-block compile traced the paging's saved-tensor hooks into the graph; backward then failed
    # in its bookkeeping ("'Page' object is not callable": a weak reference rebuilt as a strong one).
    from trainstream.activations.compiled_forward import CompiledForward

    model = tiny_llama(layers=2)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = trainstream.wrap(model, opt, activation_offload=[1], min_offload_bytes=0)
    trainstream.compile_blocks(model, backend="aot_eager")
    layers = _layers(model)
    assert layers[0]._compiled_call_impl is not None and "forward" not in layers[0].__dict__  # not paged: whole
    assert isinstance(layers[1].__dict__["forward"], CompiledForward)
    _losses(model, opt, steps=2)
    assert trainstream.memory_report(model)["activations"]["paging"]["h2d_bytes"] > 0
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0, dict(torch._dynamo.utils.counters["graph_break"])
    twin = copy.deepcopy(model)
    assert not isinstance(_layers(twin)[1].__dict__.get("forward"), CompiledForward)
    with torch.no_grad():
        ids = batches(1)[0]
        torch.testing.assert_close(loss_of(twin, ids), loss_of(model, ids))


def test_selectively_recomputed_blocks_keep_the_whole_block_compile():
    model, _ = trainstream.wrap(tiny_llama(layers=2), None, recompute=True, recompute_variant="selective")
    trainstream.compile_blocks(model, backend="aot_eager")
    assert all(layer._compiled_call_impl is not None for layer in _layers(model))
    assert all(layer.__dict__["forward"].compiled is None for layer in _layers(model))
    with pytest.raises(ValueError, match="only recompute_variant='full'"):
        _layers(model)[0].__dict__["forward"].compile(backend="aot_eager")


def test_a_recomputed_compiled_block_runs_eagerly_under_a_function_mode():
    # The attention chooser watches a new input signature's first forward through a TorchFunctionMode.
    # A compiled forward traced under it saved other tensors than its recomputation in backward, traced
    # without it (H200, 14B LoRA at 1 x 2048: "66 tensors saved during forward, 56 during recomputation").
    def run(compiled):
        model = tiny_llama(layers=3)
        model.config._attn_implementation = "sdpa"  # what the chooser watches
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        # a named backend is checked under the same mode; "auto" could time another backend in each run
        model, opt = trainstream.wrap(model, opt, recompute=True, attention="math")
        if compiled:
            trainstream.compile_blocks(model, backend="aot_eager")
        return _losses(model, opt)

    kept, compiled = _eager_then_compiled(run)
    assert compiled == kept
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0  # the later forwards ran compiled


def test_a_compiled_wrapped_model_pages_like_the_eager_one():
    # torch.compile(model) traces into the blocks' paging hooks unless they run eagerly: dynamo's replay of
    # their weak-reference bookkeeping stored the pages themselves, and backward failed on them.
    def run(compiled):
        model = tiny_llama(layers=2)
        model.config.use_cache = False
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = trainstream.wrap(model, opt, activation_offload=True, min_offload_bytes=0)
        losses = _losses(torch.compile(model, backend="aot_eager") if compiled else model, opt)
        assert trainstream.memory_report(model)["activations"]["paging"]["h2d_bytes"] > 0
        return losses

    eager, compiled = _eager_then_compiled(run)
    assert compiled == eager
    assert torch._dynamo.utils.counters["frames"]["ok"] > 0
