"""What a PyTorch user does to a model and optimizer around wrap(): edits, frozen parameters,
layouts, copies, unwrap and wrap again. Each behaves as with torch.optim.AdamW, or is refused."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import trainstream
from ts_testing import batches, loss_of, max_param_diff, tiny_llama


def _train(model, opt, data):
    for ids in data:
        loss_of(model, ids).backward()
        opt.step()
        opt.zero_grad()


def _torch_run(model, data, lr=1e-2, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    _train(model, opt, data)
    return opt


def test_load_state_dict_after_wrap_is_what_the_next_update_starts_from():
    data = batches(4)
    checkpoint = tiny_llama(seed=5).state_dict()
    ours, opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    _train(ours, opt, data[:2])
    ours.load_state_dict(checkpoint)
    _train(ours, opt, data[2:])

    reference = tiny_llama()
    ref_opt = _torch_run(reference, data[:2])
    reference.load_state_dict(checkpoint)
    _torch_run(reference, data[2:], opt=ref_opt)
    assert max_param_diff(ours, reference) < 1e-5


def test_an_in_place_edit_of_a_weight_is_kept_by_the_next_update():
    data = batches(2)
    ours, opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    reference = tiny_llama()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for model, optimizer in ((ours, opt), (reference, ref_opt)):
        _train(model, optimizer, data[:1])
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.zero_()
        _train(model, optimizer, data[1:])
    edited = ours.model.layers[0].mlp.up_proj.weight
    assert edited.abs().max() < 0.05  # one small update away from zero, not back to the old values
    assert max_param_diff(ours, reference) < 1e-5


def test_a_frozen_parameter_in_the_optimizer_is_skipped_then_trains_when_unfrozen():
    data = batches(4)
    models = []
    for wrapped in (True, False):
        model = tiny_llama()
        frozen = model.model.layers[1].self_attn.q_proj.weight
        frozen.requires_grad_(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen one included, as users do
        if wrapped:
            model, opt = trainstream.wrap(model, opt)
        start = frozen.detach().clone()
        _train(model, opt, data[:2])
        assert torch.equal(frozen.detach(), start)
        frozen.requires_grad_(True)
        _train(model, opt, data[2:])
        assert not torch.equal(frozen.detach(), start)
        models.append(model)
    assert max_param_diff(*models) < 1e-5


class _Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def test_channels_last_weights_train_like_torch():
    torch.manual_seed(0)
    ours = _Conv().to(memory_format=torch.channels_last)
    reference = copy.deepcopy(ours)
    assert not ours.conv.weight.is_contiguous()
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    for model, optimizer in ((ours, opt), (reference, ref_opt)):
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(ours.conv.weight, reference.conv.weight, rtol=1e-5, atol=1e-6)
    state = opt.state_dict()["state"][0]
    torch.testing.assert_close(state["exp_avg"], ref_opt.state[reference.conv.weight]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_layouts_the_engine_cannot_train_are_refused_at_wrap():
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="sparse=True"):
        trainstream.wrap(sparse, lr=1e-3)
    assert not hasattr(sparse, "_trainstream_session")
    overlapping = torch.nn.Linear(4, 4)
    overlapping.weight = torch.nn.Parameter(torch.zeros(4).expand(4, 4))
    with pytest.raises(ValueError, match="overlap"):
        trainstream.wrap(overlapping, lr=1e-3)


def test_unwrap_then_wrap_again_continues_the_same_training():
    data = batches(6)
    straight, opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    _train(straight, opt, data)

    model, opt2 = trainstream.wrap(tiny_llama(), lr=1e-2)
    _train(model, opt2, data[:3])
    model = trainstream.unwrap(model)
    assert float(opt2.state[model.lm_head.weight]["step"]) == 3.0
    model, again = trainstream.wrap(model, opt2)
    assert again is opt2
    _train(model, again, data[3:])
    for a, b in zip(straight.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_add_param_group_after_wrap_is_refused_clearly():
    _model, opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1


def _hooks(model) -> int:
    """Module hooks of every kind, and parameters' post-accumulate-grad hooks."""
    modules = sum(len(v) for m in model.modules() for k, v in vars(m).items()
                  if k.endswith("hooks") and isinstance(v, dict))
    return modules + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or ()) for p in model.parameters())


@pytest.mark.parametrize("options", [{}, {"param_offload": True}], ids=["resident", "streamed"])
def test_a_deep_copy_of_a_wrapped_model_carries_no_hook(options):
    plain = _hooks(tiny_llama())
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2, **options)
    _train(model, opt, batches(2))
    assert _hooks(model) > plain
    ema = copy.deepcopy(model)
    assert _hooks(ema) == plain  # before: 22-24 inert ones
    assert "_trainstream_session" not in vars(ema) and "__deepcopy__" not in vars(ema)
    model._trainstream_session.synchronize()
    for a, b in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    again = copy.deepcopy(ema)  # a copy of the copy is torch's own
    assert _hooks(again) == plain
    trainstream.unwrap(model)
    assert "__deepcopy__" not in vars(model) and _hooks(copy.deepcopy(model)) == plain


def test_a_deep_copy_goes_through_the_model_s_own_getstate():
    """Module.__getstate__ drops the compiled call model.compile() set (it refers to the original model)."""
    model, _ = trainstream.wrap(tiny_llama(), lr=1e-2)
    model._compiled_call_impl = lambda *args, **kwargs: model(*args, **kwargs)  # as model.compile() sets it
    ema = copy.deepcopy(model)
    assert getattr(ema, "_compiled_call_impl", None) is None and _hooks(ema) == _hooks(tiny_llama())
    model._compiled_call_impl = None  # as Module.__init__ leaves it
    trainstream.unwrap(model)


def test_deepcopy_and_torch_save_of_a_wrapped_model_give_a_plain_model():
    model, opt = trainstream.wrap(tiny_llama(), lr=1e-2)
    _train(model, opt, batches(2))
    ema = copy.deepcopy(model)
    assert getattr(ema, "_trainstream_session", None) is None
    for a, b in zip(ema.parameters(), model.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    loss_of(ema, batches(1)[0]).backward()  # plain autograd: the copy's gradients stay
    assert all(p.grad is not None for p in ema.parameters())
    steps = model._trainstream_session.engine.host.updates
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert getattr(loaded, "_trainstream_session", None) is None
    for a, b in zip(loaded.parameters(), model.parameters()):
        assert torch.equal(a, b)
    loss_of(loaded, batches(1)[0]).backward()
    assert all(p.grad is not None for p in loaded.parameters())
    assert model._trainstream_session.engine.host.updates == steps  # the copies never touched the original


def test_a_gradient_set_by_hand_in_another_layout_is_used_at_step():
    torch.manual_seed(0)
    ours = _Conv().to(memory_format=torch.channels_last)
    reference = copy.deepcopy(ours)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    grad = torch.randn(ours.conv.weight.shape)  # contiguous, the weight is channels_last
    for model, optimizer in ((ours, opt), (reference, ref_opt)):
        model.conv.weight.grad = grad.clone()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(ours.conv.weight, reference.conv.weight, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours.conv.weight, _Conv().to(memory_format=torch.channels_last).conv.weight)
