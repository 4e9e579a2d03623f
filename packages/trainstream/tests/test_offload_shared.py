"""ActivationOffloader: a tensor a block saves more than once is paged once (one host copy, one copy
each way), its users all get it back, and a tensor changed in place between saves is paged again."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream.activations.offload import ActivationOffloader


class _Scale(torch.autograd.Function):
    """x * w, saving x (as a LoRA layer saves its input): two of them on one x save it twice."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class TwoUsers(torch.nn.Module):
    def __init__(self, width=16, users=2):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.scales = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width)) for _ in range(users))

    def forward(self, x):
        h = torch.tanh(self.up(x))
        return x + sum(_Scale.apply(h, w) for w in self.scales)


def _model(depth=3, users=2, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[TwoUsers(users=users) for _ in range(depth)])


def _grads(model, x, retain=False):
    loss = model(x).square().mean()
    loss.backward(retain_graph=retain)
    grads = [p.grad.clone() for p in model.parameters()]
    if retain:
        loss.backward()
        grads += [p.grad.clone() for p in model.parameters()]
    return grads


def _paged(model):
    return ActivationOffloader(list(model), list(range(len(model))), device=torch.device("cpu"), min_bytes=0).attach()


@settings(max_examples=15, deadline=None)
@given(users=st.integers(1, 4), rows=st.integers(1, 6), retain=st.booleans(), seed=st.integers(0, 1000))
def test_a_tensor_saved_twice_is_one_page_and_gradients_are_exact(users, rows, retain, seed):
    model = _model(users=users, seed=seed)
    reference = copy.deepcopy(model)
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))
    offloader = _paged(model)
    got = _grads(model, x, retain)
    expected = _grads(reference, x, retain)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    stats = offloader.stats()
    # tanh saves its output h, and every _Scale finds h paged already: one page, users + 1 holders
    assert stats["shared"] == 3 * users
    offloader.detach()


def test_shared_pages_copy_once_each_way():
    model = _model(users=3)
    x = torch.randn(4, 16)
    offloader = _paged(model)
    _grads(model, x)
    once = offloader.stats()
    single = _model(users=1)
    other = _paged(single)
    _grads(single, x)
    alone = other.stats()
    assert once["d2h_bytes"] == alone["d2h_bytes"] and once["h2d_bytes"] == alone["h2d_bytes"]
    assert once["pages"] == alone["pages"] and (once["shared"], alone["shared"]) == (3 * 3, 3)
    assert offloader.block_bytes == other.block_bytes


def test_a_tensor_changed_in_place_between_saves_is_paged_again():
    offloader = ActivationOffloader([torch.nn.Identity()], [0], device=torch.device("cpu"), min_bytes=0)
    t = torch.randn(8)
    first = offloader._pack(0, t)
    assert offloader._pack(0, t) is first  # unchanged: the same page
    before = t.clone()
    t.add_(1.0)
    second = offloader._pack(0, t)
    assert second is not first
    assert torch.equal(offloader._unpack(first), before)
    assert torch.equal(offloader._unpack(first), before)  # its second user
    assert torch.equal(offloader._unpack(second), t)
    offloader._saved = {}  # a new block's forward: nothing is shared across blocks
    assert offloader._pack(0, t) is not second
