"""The fused device update at step() (state in VRAM, no hooks), on the CPU: the CUDA launch is
replaced by a fake that runs ts-adamw's host step per tensor with the same arguments, and the CUDA
stream/event calls by no-ops. What is tested is the engine's Python side: which values each launch
gets (hyper-parameters read at step(), per group), which weights it writes (user edits and replaced
``.data`` followed), the step counts, and the refusals."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from trainstream.engine import ParamSlot, SlotState, UpdateEngine


def _load_fake_cuda():
    """tools/bench/_fake_cuda.py (shared with tools/bench/step_overhead.py), by path."""
    path = pathlib.Path(__file__).resolve().parents[3] / "tools" / "bench" / "_fake_cuda.py"
    spec = importlib.util.spec_from_file_location("trainstream_fake_cuda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fake_cuda = _load_fake_cuda()


@pytest.fixture
def launches(monkeypatch):
    """Fake CUDA: each fused launch is recorded (its kwargs and tensor count) and applied on the host."""
    return fake_cuda.install(monkeypatch.setattr, apply=True)


class _Events:
    def __init__(self):
        self.lines = []

    def add(self, kind, text):
        self.lines.append((kind, text))


def _setup(groups_of: list[int], *, max_grad_norm=None, guard_params=True, seed=0):
    """fp32 weights in groups of the given sizes, a torch.optim.AdamW twin, and an engine with every
    slot placed on the 'device'."""
    torch.manual_seed(seed)
    params, groups = [], []
    for n in groups_of:
        members = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(n)]
        params += members
        groups.append(members)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW([{"params": twins[sum(groups_of[:i]):sum(groups_of[:i + 1])]}
                             for i in range(len(groups_of))], lr=1e-2, weight_decay=0.01)
    slots, index = [], 0
    for group in opt.param_groups:
        for p in group["params"]:
            slots.append(ParamSlot(param=p, index=index, group=group, name=f"w{index}"))
            index += 1
    engine = UpdateEngine(slots, torch.device("cpu"), torch.float32, None, _Events(), max_grad_norm=max_grad_norm,
                          accumulation_steps=1, seed=0, guard_params=guard_params, placement="device",
                          step_hook=None)
    engine.channel = fake_cuda.FakeChannel()
    for s in slots:
        engine.activate(s)
    assert all(s.placement == "device" and s.hook is None for s in slots)
    return engine, opt, ref, params, twins


def _grads(params, twins, step, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    for i, (p, t) in enumerate(zip(params, twins)):
        if i in skip:
            p.grad = t.grad = None
            continue
        grad = torch.randn(p.shape, generator=g)
        p.grad, t.grad = grad.clone(), grad.clone()


def _assert_matches(params, twins):
    for i, (p, t) in enumerate(zip(params, twins)):
        torch.testing.assert_close(p.detach(), t.detach(), msg=f"parameter {i}")


@pytest.mark.parametrize("clip", [False, True])
def test_a_group_edited_between_steps_is_honoured_for_every_slot(launches, clip):
    engine, opt, ref, params, twins = _setup([4, 3], max_grad_norm=1e9 if clip else None)
    schedule = [(1e-2, (0.9, 0.999), 0.01), (3e-2, (0.8, 0.99), 0.1), (5e-3, (0.8, 0.99), 0.0)]
    for step, (lr, betas, wd) in enumerate(schedule):
        for o in (opt, ref):  # a scheduler editing only the second group
            o.param_groups[1].update(lr=lr, betas=betas, weight_decay=wd)
        _grads(params, twins, step)
        engine.step()
        ref.step()
        _assert_matches(params, twins)
        assert all(p.grad is None for p in params)
    by_lr = {}
    for launch in launches:
        by_lr.setdefault(launch["lr"], 0)
        by_lr[launch["lr"]] += launch["count"]
    assert by_lr == {1e-2: 4 * 3 + 3, 3e-2: 3, 5e-3: 3}  # the edited group, all of its slots, each step
    assert len(launches) == 2 * len(schedule)  # one fused launch per group per step
    assert [s.step for s in engine.slots] == [3] * 7
    engine.close()


def test_a_bad_value_in_one_group_is_refused_naming_that_group(launches):
    engine, opt, ref, params, twins = _setup([2, 3])
    _grads(params, twins, 0)
    engine.step()
    ref.step()
    opt.param_groups[1]["lr"] = float("nan")
    _grads(params, twins, 1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"the param group of parameter 2 \(w2\): lr=nan is not valid"):
        engine.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))  # nothing changed, no group
    assert [s.step for s in engine.slots] == [1] * 5
    opt.param_groups[1]["lr"] = 1e-2
    engine.step()  # the same gradients train once the value is fixed
    ref.step()
    _assert_matches(params, twins)
    engine.close()


def test_user_edits_and_replaced_storage_are_followed(launches):
    engine, _opt, ref, params, twins = _setup([3])
    _grads(params, twins, 0)
    engine.step()
    ref.step()
    with torch.no_grad():
        params[0].mul_(0.5)  # in place: the master follows
        twins[0].mul_(0.5)
        fresh = torch.randn(3, 5)
        params[1].data = fresh.clone()  # new storage: the next update writes there
        twins[1].data = fresh.clone()
    for step in (1, 2):
        _grads(params, twins, step)
        engine.step()
        ref.step()
        _assert_matches(params, twins)
    assert sum("changed outside the optimizer" in text for _, text in engine.events.lines) == 2
    engine.close()


def test_a_parameter_without_gradient_keeps_its_own_step_count(launches):
    engine, _opt, ref, params, twins = _setup([3])
    for step, skip in enumerate([(), (1,), (), ()]):
        _grads(params, twins, step, skip)
        engine.step()
        ref.step()
        _assert_matches(params, twins)
    assert [s.step for s in engine.slots] == [4, 3, 4]
    assert sorted(launch["step"] for launch in launches[-2:]) == [3, 4]  # two step counts, two launches


def test_loaded_state_is_what_the_next_launch_starts_from(launches):
    engine, _opt, ref, params, twins = _setup([2])
    for step in range(2):
        _grads(params, twins, step)
        engine.step()
        ref.step()
    saved = [s.export() for s in engine.slots]
    for s, state in zip(engine.slots, saved):
        s.load(7, state["exp_avg"], state["exp_avg_sq"], state["master_param"])
    for p in twins:
        ref.state[p]["step"] = torch.tensor(7.0)
    _grads(params, twins, 2)
    engine.step()
    ref.step()
    assert launches[-1]["step"] == 8
    _assert_matches(params, twins)
    assert all(s.state is SlotState.IDLE and s.step == 8 for s in engine.slots)


@pytest.mark.cuda
@pytest.mark.parametrize("guard_params", [True, False])
def test_gradient_memory_reused_right_after_step_does_not_change_the_update(guard_params):
    """On a GPU: the fused launch's gradients are held (guard) or stream-recorded (no guard) until it
    has read them; filling fresh same-size tensors with NaN right after step() (the allocator hands
    back the freed gradient blocks) leaves the training equal to torch's AdamW."""
    import copy

    from ts_testing import batches, loss_of, max_param_diff, tiny_llama

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import trainstream

    torch.manual_seed(0)
    model = tiny_llama().cuda()
    twin = copy.deepcopy(model)
    ours, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0),
                                 guard_params=guard_params)
    ref_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.0)
    for ids in batches(6, seed=5):
        ids = ids.cuda()
        loss_of(ours, ids).backward()
        loss_of(twin, ids).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        junk = [torch.full_like(p, float("nan")) for p in twin.parameters()]  # reuses freed gradient blocks
        del junk
        if not guard_params:
            ours._trainstream_session.synchronize()
    ours._trainstream_session.synchronize()
    slots = ours._trainstream_session.engine.active
    assert all(s.placement == "device" and s.hook is None for s in slots)
    assert max_param_diff(ours, twin) < 1e-5
    trainstream.unwrap(ours)


def test_mapped_slots_with_fused_mapped_update_in_one_launch_at_step_without_hooks(launches):
    """offload='auto''s placement trial: mapped slots without per-tensor hooks train like torch's AdamW
    through step()'s fused launch (one per group); back on host they get their hooks again."""
    import ts_pinned

    engine, _opt, ref, params, twins = _setup([3, 2])
    engine.arena = ts_pinned.PinnedArena(slab_bytes=64 << 10)  # private: page-locked state for "mapped"
    engine.fused_mapped = True
    engine.place(engine.slots, "mapped")
    assert all(s.placement == "mapped" and s.hook is None for s in engine.slots)
    for step in range(3):
        _grads(params, twins, step)
        engine.step()
        ref.step()
        _assert_matches(params, twins)
    assert len(launches) == 2 * 3 and all(launch["count"] in (2, 3) for launch in launches)
    engine.fused_mapped = False
    engine.place(engine.slots, "host")
    assert all(s.placement == "host" and s.hook is not None for s in engine.slots)
    engine.close()
