"""Bad input raises ValueError naming the problem, before any memory changes."""

from __future__ import annotations

import pytest
import torch
import ts_adamw

GOOD = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "step": 1}


def _state(n=64, moments=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.rand(n, generator=gen).to(moments), torch.rand(n, generator=gen).to(moments))


def _snapshot(*tensors):
    return [t.clone() for t in tensors]


BAD_CASES = {
    "numel": lambda p, g, m, v: ((p, g[:-1], m, v), {}),
    "param dtype": lambda p, g, m, v: ((p.double(), g, m, v), {}),
    "grad dtype": lambda p, g, m, v: ((p, g.double(), m, v), {}),
    "mixed moments": lambda p, g, m, v: ((p, g, m, v.bfloat16()), {}),
    "fp16 moments": lambda p, g, m, v: ((p, g, m.half(), v.half()), {}),
    "non-contiguous": lambda p, g, m, v: ((p, g, m, v), {"param_out": torch.empty(128)[::2]}),
    "strided grad": lambda p, g, m, v: ((p, torch.randn(128)[::2], m, v), {}),
    "param_out dtype": lambda p, g, m, v: ((p, g, m, v), {"param_out": torch.empty(64, dtype=torch.int32)}),
    "param_out numel": lambda p, g, m, v: ((p, g, m, v), {"param_out": torch.empty(63)}),
    "negative lr": lambda p, g, m, v: ((p, g, m, v), {"lr": -1e-3}),
    "nan lr": lambda p, g, m, v: ((p, g, m, v), {"lr": float("nan")}),
    "beta1": lambda p, g, m, v: ((p, g, m, v), {"beta1": 1.0}),
    "beta2": lambda p, g, m, v: ((p, g, m, v), {"beta2": -0.1}),
    "eps": lambda p, g, m, v: ((p, g, m, v), {"eps": -1.0}),
    "weight decay": lambda p, g, m, v: ((p, g, m, v), {"weight_decay": -0.1}),
    "step zero": lambda p, g, m, v: ((p, g, m, v), {"step": 0}),
    "step float": lambda p, g, m, v: ((p, g, m, v), {"step": 1.5}),
    "threads": lambda p, g, m, v: ((p, g, m, v), {"threads": 0}),
    "grad scale": lambda p, g, m, v: ((p, g, m, v), {"grad_scale": float("inf")}),
    "not a tensor": lambda p, g, m, v: ((p, [1.0], m, v), {}),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("fn", ["sync", "async"])
def test_bad_input_raises_and_changes_nothing(case, fn):
    p, g, m, v = _state()
    before = _snapshot(p, g, m, v)
    args, extra = BAD_CASES[case](p, g, m, v)
    step = ts_adamw.adamw_step if fn == "sync" else ts_adamw.adamw_step_async
    with pytest.raises(ValueError):
        step(*args, **{**GOOD, **extra})
    for a, b in zip((p, g, m, v), before):
        assert torch.equal(a, b)


def test_messages_name_the_argument():
    p, g, m, v = _state()
    with pytest.raises(ValueError, match=r"grads\[0\] has 63 elements"):
        ts_adamw.adamw_step(p, g[:-1], m, v, **GOOD)
    with pytest.raises(ValueError, match="contiguous"):
        ts_adamw.adamw_step(p, torch.randn(128)[::2], m, v, **GOOD)
    with pytest.raises(ValueError, match="lr=-1"):
        ts_adamw.adamw_step(p, g, m, v, **{**GOOD, "lr": -1.0})


def test_tensors_that_require_grad_are_accepted():
    p, g, m, v = _state()
    p.requires_grad_(True)
    ts_adamw.adamw_step(p, g, m, v, **GOOD)
    assert not torch.equal(m, _state()[2])


def test_cuda_entry_point_raises_clearly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    p, g, m, v = _state()
    with pytest.raises(RuntimeError, match="CUDA"):
        ts_adamw.cuda_adamw_step([p], [g], [m], [v], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                 weight_decay=0.0, step=1)


@pytest.mark.parametrize("kwargs", [{"amsgrad": True}, {"capturable": True}, {"differentiable": True},
                                    {"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": -1e-8}, {"weight_decay": -1.0},
                                    {"moment_dtype": torch.float16}, {"threads": 0}])
def test_optimizer_rejects_unsupported_options(kwargs):
    with pytest.raises(ValueError):
        ts_adamw.AdamW([torch.nn.Parameter(torch.zeros(3))], **kwargs)


def test_optimizer_step_with_one_bad_param_changes_nothing():
    good = torch.nn.Parameter(torch.randn(10))
    bad = torch.nn.Parameter(torch.randn(2, 5).t())  # not contiguous: the engine writes it in place
    opt = ts_adamw.AdamW([{"params": [good]}, {"params": [bad], "lr": 1e-2}])
    good.grad, bad.grad = torch.randn(10), torch.randn(5, 2)
    before = (good.detach().clone(), bad.detach().clone())
    with pytest.raises(ValueError):
        opt.step()
    assert torch.equal(good.detach(), before[0]) and torch.equal(bad.detach(), before[1])
    assert len(opt.state) == 0
    opt.param_groups[0]["amsgrad"] = True
    opt.param_groups[1]["params"] = []
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    assert len(opt.state) == 0
