"""Activations: paging to host memory and recompute are bit-exact against keeping everything, compose
with the engine's options, refuse bad input clearly and leak no page."""

from __future__ import annotations

import copy
import gc
import itertools

import pytest
import torch
import trainstream
import ts_pinned
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream.activations.offload import ActivationOffloader
from trainstream.activations.recompute import Recompute
from ts_testing import batches, loss_of, tiny_llama


class Block(torch.nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class Stack(torch.nn.Module):
    def __init__(self, width=32, depth=4, p=0.0, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(Block(width, p) for _ in range(depth))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).logsumexp(-1).mean()


def _run(model, opt, steps=3, seed=0, width=32):
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, width, generator=torch.Generator().manual_seed(seed + step))
        torch.manual_seed(100 + step)  # dropout masks: the same in every run
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model._trainstream_session.synchronize()
    return losses


@pytest.mark.parametrize("options", [
    {"activation_offload": True, "min_offload_bytes": 0},
    {"activation_offload": [1, 3], "min_offload_bytes": 0, "max_grad_norm": 0.1},
    {"recompute": True},
    {"recompute": 0.5, "activation_offload": [2, 3], "min_offload_bytes": 0, "accumulation_steps": 2},
])
def test_paging_and_recompute_train_bit_for_bit_like_keeping(options):
    base = {k: v for k, v in options.items() if k in ("max_grad_norm", "accumulation_steps")}
    kept, kept_opt = trainstream.wrap(Stack(p=0.2), lr=1e-2, **base)
    ours, opt = trainstream.wrap(Stack(p=0.2), lr=1e-2, **options)
    assert _run(ours, opt) == _run(kept, kept_opt)
    for a, b in zip(ours.parameters(), kept.parameters()):
        assert torch.equal(a, b)
    report = trainstream.memory_report(ours)["activations"]
    if options.get("activation_offload"):
        assert report["paging"]["pages"] > 0 and report["paging"]["d2h_bytes"] > 0
        assert report["paging"]["h2d_bytes"] == report["paging"]["d2h_bytes"]
    if options.get("recompute"):
        assert sum(r.calls for r in ours._trainstream_session.activations._recompute.values()) > 0
    trainstream.unwrap(ours)
    trainstream.unwrap(kept)


def test_paging_a_hugging_face_model_is_bit_exact():
    kept, kept_opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    ours, opt = trainstream.wrap(tiny_llama(), lr=1e-2, activation_offload=True, min_offload_bytes=0)
    for ids in batches(3):
        for model, o in ((kept, kept_opt), (ours, opt)):
            loss_of(model, ids).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ours.parameters(), kept.parameters()):
        assert torch.equal(a, b)
    assert trainstream.memory_report(ours)["activations"]["policy"] == ["offload", "offload"]


def test_the_policy_is_reported_per_block():
    model, _ = trainstream.wrap(Stack(depth=4), lr=1e-3, activation_offload=[0], recompute=[2, 3])
    report = trainstream.memory_report(model)["activations"]
    assert report["policy"] == ["offload", "keep", "recompute", "recompute"]
    assert report["offloaded_blocks"] == [0] and report["recompute_blocks"] == [2, 3]
    assert "1 of 4 blocks page" in report["decision"]
    trainstream.unwrap(model)
    assert "forward" not in model.layers[2].__dict__  # unwrap restored the plain forward


@pytest.mark.parametrize(("options", "message"), [
    ({"activation_offload": "sometimes"}, "activation_offload='sometimes' is not valid; use 'auto'"),
    ({"recompute": 1.5}, "recompute=1.5 is not valid"),
    ({"recompute": [0, 0]}, "distinct"),
    ({"activation_offload": [7]}, "the model has 4 blocks, indices [7] do not exist"),
    ({"activation_offload": [1], "recompute": [1, 2]}, "blocks [1] are asked both"),
    ({"prefetch_depth": 0}, "prefetch_depth=0 is not valid"),
    ({"max_inflight_bytes": -1}, "max_inflight_bytes=-1 is not valid"),
    ({"blocks": "layers"}, "blocks='layers' is not valid"),
])
def test_bad_activation_options_are_refused_and_change_nothing(options, message):
    model = Stack(depth=4)
    with pytest.raises(ValueError) as error:
        trainstream.wrap(model, lr=1e-3, **options)
    assert message in str(error.value)
    assert not hasattr(model, "_trainstream_session")
    assert all("forward" not in b.__dict__ for b in model.layers)


def test_hugging_face_gradient_checkpointing_and_recompute_are_not_both_used():
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ValueError, match="gradient_checkpointing_disable"):
        trainstream.wrap(model, lr=1e-3, recompute=True)
    model.gradient_checkpointing_disable()
    model, _ = trainstream.wrap(model, lr=1e-3, recompute=True)
    trainstream.unwrap(model)


def test_a_copy_of_a_recomputing_model_runs_the_plain_forward():
    model, opt = trainstream.wrap(Stack(), lr=1e-3, recompute=True)
    _run(model, opt, steps=1)
    twin = copy.deepcopy(model)
    assert not any(isinstance(b.__dict__.get("forward"), Recompute) for b in twin.layers)
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(twin(x), model(x))


def _page_bytes() -> int:
    return ts_pinned.pinned_stats()["by_tag"].get("activations", 0)


def test_an_exception_mid_backward_leaks_no_page():
    model, opt = trainstream.wrap(Stack(), lr=1e-3, activation_offload=True, min_offload_bytes=0)
    _run(model, opt, steps=1)
    gc.collect()
    model._trainstream_session.activations.sweep()
    assert _page_bytes() == 0  # every page of the finished step went back to the arena

    def explode(*_):
        raise RuntimeError("boom in backward")

    handle = model.layers[1].register_full_backward_hook(explode)
    loss = model(torch.randn(4, 8, 32))
    assert _page_bytes() > 0  # pages are out
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    handle.remove()
    del loss
    gc.collect()
    opt.zero_grad()
    model._trainstream_session.activations.sweep()
    assert _page_bytes() == 0
    _run(model, opt, steps=1)  # and training goes on


def test_the_offloader_alone_on_a_plain_model():
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    offloader = ActivationOffloader(list(model.layers), [0, 1, 2, 3], device=torch.device("cpu"), min_bytes=0).attach()
    x = torch.randn(4, 8, 32)
    model(x).backward()
    reference(x).backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert offloader.stats()["pages"] >= 4 * 3
    offloader.detach()


class _Copied:
    """A copy's completion token on the recording channel below (complete at once, as on the CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _RecordingChannel:
    """The CPU channel, with a token per device-to-host copy (keyed by the host memory it wrote) and a
    record of what each page's fetch was ordered after."""

    is_cuda = False

    def __init__(self, inner):
        self.inner, self.stats = inner, inner.stats
        self.written: dict[int, _Copied] = {}
        self.fetches: list[tuple[int, object]] = []

    def mark_compute(self):
        return None

    def to_host(self, src, dst, after):
        self.inner.to_host(src, dst, after)
        self.written[dst.data_ptr()] = token = _Copied()
        return token

    def to_new_device_tensor(self, src, shape, stride, dtype, after):
        self.fetches.append((src.data_ptr(), after))
        return self.inner.to_new_device_tensor(src, shape, stride, dtype, None)

    def compute_wait(self, token) -> None:
        pass


def test_a_page_comes_back_only_after_its_copy_to_the_host():
    """Backward can reach the last paged block while its pages' D2H copies are in flight: each fetch is
    ordered after the copy that wrote its host block (on the H200 a fetch that was not read stale bytes)."""
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    offloader = ActivationOffloader(list(model.layers), [0, 1, 2, 3], device=torch.device("cpu"), min_bytes=0,
                                    prefetch_depth=2).attach()
    channel = offloader.channel = _RecordingChannel(offloader.channel)
    x = torch.randn(4, 8, 32)
    model(x).backward()
    reference(x).backward()
    offloader.detach()
    assert len(channel.fetches) == offloader.stats()["pages"] >= 4 * 3
    for host, after in channel.fetches:
        assert after is not None and after is channel.written[host]
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=12),
       order=st.randoms(use_true_random=False))
def test_live_pages_never_share_host_memory_and_come_back_intact(shapes, order):
    offloader = ActivationOffloader([torch.nn.Identity()], [0], device=torch.device("cpu"), min_bytes=0)
    tensors = [torch.randn(*s) for s in shapes]
    pages = [offloader._pack(0, t) for t in tensors]
    spans = sorted((p.host.data_ptr(), p.host.data_ptr() + p.host.numel()) for p in pages)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap between live pages
    indices = list(range(len(pages)))
    order.shuffle(indices)
    for i in indices:
        assert torch.equal(offloader._unpack(pages[i]), tensors[i])


@pytest.mark.parametrize("policy", [{"activation_offload": True, "min_offload_bytes": 0}, {"recompute": True}])
def test_policies_compose_with_lora_on_a_quantized_base_autocast_and_the_chunked_loss(policy):
    peft = pytest.importorskip("peft")
    from trainstream.integrations.huggingface import decoder_and_head

    def lora_model():
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]))
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)  # adapters that already change the output
        return model

    runs = []
    for options in ({}, policy):
        model, opt = trainstream.wrap(lora_model(), lr=1e-2, quantize="int8", **options)
        assert trainstream.memory_report(model)["params"]["quantize"] == "int8"
        decoder, head = decoder_and_head(model)
        losses = []
        for ids in batches(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                hidden = decoder(input_ids=ids).last_hidden_state
            loss = trainstream.causal_lm_loss(hidden, head.weight, ids, chunk_size=5)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model._trainstream_session.synchronize()
        runs.append((losses, [p.detach().clone() for p in model.parameters() if p.requires_grad]))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_pages_come_from_the_reserved_pool_after_the_first_step(monkeypatch):
    # A fresh arena: the process-wide one holds free space fragmented by earlier tests, where a
    # page may not fit although the free total does.
    arena = ts_pinned.PinnedArena(slab_bytes=64 << 10)  # small slabs: the pages need the pool to grow
    monkeypatch.setattr(trainstream._session.ts_pinned, "default_arena", lambda: arena)
    model, opt = trainstream.wrap(Stack(width=64), lr=1e-3, activation_offload=True, min_offload_bytes=0)
    _run(model, opt, steps=1, width=64)  # the first step measures; step() grows the pool
    offloader = model._trainstream_session.activations.offloader
    assert offloader.arena is arena and offloader.counters["pool_grown"] > 0
    fallbacks = arena.stats()["arena_fallbacks"]
    _run(model, opt, steps=3, seed=5, width=64)
    assert arena.stats()["arena_fallbacks"] == fallbacks  # no page allocated on its own
    assert any("more page-locked memory for activation pages" in e for e in trainstream.memory_report(model)["events"])
    trainstream.unwrap(model)


class _NormedBlock(torch.nn.Module):
    """A block whose forward writes buffers: BatchNorm's running statistics and its batch count."""

    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width)

    def forward(self, x):
        return x + self.norm(self.up(x).transpose(1, 2)).transpose(1, 2)


class _NormedStack(Stack):
    def __init__(self, width=32, depth=3, seed=0):
        super().__init__(width, depth, 0.0, seed)
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(_NormedBlock(width) for _ in range(depth))


@pytest.mark.parametrize("variant", ["full", "selective"])
def test_recomputed_blocks_update_running_statistics_once_per_step(variant):
    """Before: the recomputation in backward ran BatchNorm's update again (num_batches_tracked 10 after 5 steps,
    as torch.utils.checkpoint does); now the buffers equal a run that keeps its activations."""
    runs = []
    for options in ({"recompute": False}, {"recompute": True, "recompute_variant": variant}):
        model, opt = trainstream.wrap(_NormedStack(), lr=1e-3, **options)
        losses = _run(model, opt, steps=5)
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items() if "norm" in k}))
        trainstream.unwrap(model)
    assert runs[1][0] == runs[0][0]
    assert runs[0][1]["layers.0.norm.num_batches_tracked"] == 5
    assert all(torch.equal(runs[1][1][k], v) for k, v in runs[0][1].items())
