"""Parallel wrappers wrap() does not compose with are refused before anything changes (issue 43, item 2):
a model under DistributedDataParallel (two reductions of every gradient), FSDP2's fully_shard (DTensor
shards), and fully_shard() or a parameter replaced after wrap() (the optimizer would train tensors the
forward no longer reads: refused at the next forward). One process, a gloo group of one rank."""

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


def test_a_model_sharded_by_fully_shard_is_refused(group):
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # before: accepted, then "mixed torch.Tensor and DTensor" inside the first step()
    _refused_unchanged(model, "sharded by FSDP")


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

