"""recompute_variant='selective': recomputed blocks keep their matmul outputs and recompute the rest;
training is bit for bit that of keeping everything (dropout included), and backward redoes no matmul."""

from __future__ import annotations

import pytest
import torch
import trainstream
from test_activations import Stack, _run
from torch.utils._python_dispatch import TorchDispatchMode
from ts_testing import batches, loss_of, tiny_llama


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("variant", ["full", "selective"])
def test_recomputed_blocks_train_bit_for_bit_like_kept_ones(variant):
    runs = []
    for options in ({"recompute": False, "activation_offload": False},
                    {"recompute": [0, 2], "activation_offload": False, "recompute_variant": variant}):
        model, opt = trainstream.wrap(Stack(p=0.1), lr=1e-3, **options)
        runs.append((_run(model, opt, steps=4), _params(model)))
        trainstream.unwrap(model)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_ops(options):
    model, opt = trainstream.wrap(tiny_llama(layers=2), lr=1e-3, activation_offload=False, **options)
    ids = batches(1)[0]
    loss = loss_of(model, ids)
    with _Count() as counted:
        loss.backward()
    opt.zero_grad()
    events = trainstream.memory_report(model)["events"]
    trainstream.unwrap(model)
    return counted.ops, events


def test_selective_recompute_redoes_the_cheap_ops_but_no_matmul():
    kept, _ = _backward_ops({"recompute": False})
    full, _ = _backward_ops({"recompute": True})
    selective, events = _backward_ops({"recompute": True, "recompute_variant": "selective"})
    products = ("mm", "addmm", "bmm")

    def matmuls(ops):
        return sum(ops.get(name, 0) for name in products)

    assert matmuls(full) > matmuls(kept)  # full recompute runs the block's forward matmuls again
    assert matmuls(selective) == matmuls(kept)  # selective takes them from what forward kept
    cheap = ("mul", "add", "pow", "rsqrt", "mean", "silu", "cat", "neg")
    assert sum(selective.get(n, 0) for n in cheap) > sum(kept.get(n, 0) for n in cheap)  # those run again
    assert any("recompute_variant='selective'" in e for e in events)


def test_a_bad_variant_is_refused():
    with pytest.raises(ValueError, match="recompute_variant='partial' is not valid"):
        trainstream.wrap(Stack(), lr=1e-3, recompute=True, recompute_variant="partial")
