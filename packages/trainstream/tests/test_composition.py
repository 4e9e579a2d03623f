"""Parallel wrappers wrap() does not compose with are refused before anything changes (issue 43, item 2):
a model under DistributedDataParallel (two reductions of every gradient), DTensor parameters outside FSDP2,
a model whose blocks fully_shard() sharded but not its root, and fully_shard() or a parameter replaced after
wrap() (the optimizer would train tensors the forward no longer reads: refused at the next forward). A model
fully_shard() sharded composes. One process, a gloo group of one rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import trainstream
from ts_testing import tiny_llama


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group for the test, destroyed after it (other tests see none)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _hooks(model) -> int:
    return sum(len(v) for m in model.modules() for k, v in vars(m).items() if k.endswith("hooks") and isinstance(v, dict))


def _refused_unchanged(model, match):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hooks = _hooks(model)
    with pytest.raises(ValueError, match=match):
        trainstream.plan(model, lr=1e-3)
    with pytest.raises(ValueError, match=match):
        trainstream.wrap(model, lr=1e-3)
    assert getattr(model, "_trainstream_session", None) is None and _hooks(model) == hooks
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_model_under_ddp_is_refused_with_the_module_to_pass(group):
    model = torch.nn.parallel.DistributedDataParallel(tiny_llama())  # before: every gradient reduced twice
    _refused_unchanged(model, r"under DistributedDataParallel.*Pass the module inside \(model\.module\)")
    model, _ = trainstream.wrap(model.module, lr=1e-3)  # the way out works
    trainstream.unwrap(model)


def _fully_sharded(model, root: bool = True):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if root:
        fully_shard(model)
    return model


def test_a_model_whose_root_fully_shard_did_not_shard_is_refused(group):
    model = _fully_sharded(tiny_llama(), root=False)  # the root's parameters' gradients would not be reduced
    _refused_unchanged(model, "its root is not: call fully_shard\\(model\\) on the root as well")


def test_a_model_sharded_by_fully_shard_trains_like_fsdp2_with_torch_adamw(group):
    """Before: accepted, then "mixed torch.Tensor and DTensor" inside the first step(). Now the engine trains
    the local shards (distributed/fsdp.py; 2 and 4 ranks in test_fsdp.py); here the Hugging Face model."""
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name in ("torch", "trainstream"):
        torch.manual_seed(0)
        model = _fully_sharded(tiny_llama())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if name == "trainstream":
            model, opt = trainstream.wrap(model, opt, max_grad_norm=1.0)
            assert any("FSDP2" in e for e in trainstream.memory_report(model)["events"])
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            if name == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if name == "trainstream":
            trainstream.unwrap(model)
            assert all(type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"])
        runs[name] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    for n, p in runs["torch"].items():
        assert (p - runs["trainstream"][n]).abs().max() < 1e-5, n
    torch.manual_seed(0)
    initial = dict(tiny_llama().named_parameters())
    assert all((p - initial[n]).abs().max() > 1e-4 for n, p in runs["trainstream"].items()), "trained nothing"


def test_dtensor_parameters_are_refused_by_name(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = tiny_llama()
    mesh = init_device_mesh("cpu", (1,))
    model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Replicate()]))
    _refused_unchanged(model, "parameter 'lm_head.weight' is a DTensor")


def test_fully_shard_after_wrap_is_refused_at_the_next_forward(group):
    from torch.distributed.fsdp import fully_shard

    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    fully_shard(model)  # before: trained nothing, weights bit-identical to the initial ones, no error
    with pytest.raises(RuntimeError, match=r"replaced after wrap\(\) \(by fully_shard\(\)"):
        model(input_ids=ids, labels=ids)
    trainstream.unwrap(model)


def test_a_parameter_assigned_anew_after_wrap_is_refused_at_the_next_forward():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()  # the sites as wrapped: no refusal
    opt.step()
    opt.zero_grad()
    first = next(n for n, p in model.named_parameters() if p.requires_grad)
    module_name, _, name = first.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().clone()))
    with pytest.raises(RuntimeError, match=f"parameter '{name}' was replaced after wrap"):
        model(input_ids=ids, labels=ids)
    trainstream.unwrap(model)

