"""plot_memory(): the plan is priced at the batch the steps trained, only visible parts get legend entries, the
host-RAM lines are labelled, every axis starts at zero and the lower bound is drawn on the step times' axis (or
left out with a note saying why). The Figure's Axes are inspected (memory_figure: plot_memory's figure, unsaved);
the drawing tests skip without matplotlib."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import trainstream
import ts_planner
from trainstream import _plot
from ts_testing import batches, loss_of, tiny_llama

BATCH, SEQ = 3, 24


def _trained(steps: int = 2, accumulation: int = 1, batch: int = BATCH, seq: int = SEQ):
    model = tiny_llama()
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()),
                                        accumulation_steps=accumulation)
    data = iter(batches(steps * accumulation, batch=batch, seq=seq))
    for _ in range(steps):
        for _ in range(accumulation):
            loss_of(model, next(data)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.fixture
def figure():
    """memory_figure(model) for a wrapped model, closed after the test."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    made = []

    def draw(model):
        made.append(_plot.memory_figure(model))
        return made[-1]

    yield draw
    for fig in made:
        plt.close(fig)


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def test_each_step_records_the_batch_it_trained_and_its_forwards():
    model, optimizer = _trained(accumulation=2)
    stalls = trainstream.memory_report(model)["stalls"]
    assert [(s["tokens"], s["forwards"]) for s in stalls] == [([BATCH, SEQ], 2)] * 2
    assert _plot.trained_tokens(stalls) == ((BATCH, SEQ), 2)
    for ids in batches(2, batch=2, seq=12):
        loss_of(model, ids).backward()
    with torch.no_grad():  # an evaluation forward trains nothing: neither its shape nor its count is recorded
        model(input_ids=batches(1, batch=1, seq=8)[0])
    optimizer.step()
    last = trainstream.memory_report(model)["stalls"][-1]
    assert (last["tokens"], last["forwards"]) == ([2, 12], 2)
    trainstream.unwrap(model)


def test_the_plan_is_priced_at_the_batch_trained(figure):
    model, _ = _trained()
    report = trainstream.memory_report(model)
    assert report["plan"]["tokens"]["batch"] == 1 and report["plan"]["tokens"]["seq"] == 2048  # wrap()'s
    plan, what = _plot.plan_at(model, report["plan"], (BATCH, SEQ))
    assert (plan["batch"], plan["seq"]) == (BATCH, SEQ) and "the batch trained" in what
    priced = model._trainstream_session.plan.memory.plan
    again = ts_planner.check_plan(priced.shape, priced.budget, dataclasses.replace(priced.options, batch=BATCH, seq=SEQ))
    assert plan["vram"] == again.to_dict()["vram"] and plan["vram"] != report["plan"]["vram"]
    ax_plan = figure(model).axes[0]
    assert f"plan at {BATCH} x {SEQ} tokens (the batch trained)" in ax_plan.get_title()
    assert "2048" not in ax_plan.get_title()
    trainstream.unwrap(model)


def test_before_any_step_the_title_says_the_tokens_are_wrap_s_assumption(figure):
    model, _ = trainstream.wrap(tiny_llama())
    fig = figure(model)
    assert "1 x 2048 tokens (wrap()'s assumption: no training step yet)" in fig.axes[0].get_title()
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    trainstream.unwrap(model)


def test_only_visible_parts_have_legend_entries_and_the_host_ram_lines_are_labelled(figure):
    model, _ = _trained()
    fig = figure(model)
    ax_plan, ax_mem, ax_wait = fig.axes
    plan, _ = _plot.plan_at(model, trainstream.memory_report(model)["plan"], (BATCH, SEQ))
    top = ax_plan.get_ylim()[1] / 1.15
    for where, parts in (("vram", plan["vram"]), ("host", plan["host"])):
        for name, value in parts.items():
            shown = name.replace("_", " ") in _legend(ax_plan)
            visible = value / _plot.GiB >= _plot.VISIBLE * top and name != "cuda_context"
            assert shown == visible, (where, name, value, _legend(ax_plan))
    # This tiny model's gradients are a few hundred KiB beside 2 GiB of runtime: drawn, they could not be seen.
    assert plan["vram"]["gradients"] > 0 and "gradients" not in _legend(ax_plan)
    assert "runtime" in _legend(ax_plan)
    for patch in (p for p in ax_plan.patches if not p.get_label().startswith("_")):
        assert patch.get_height() >= _plot.VISIBLE * top
    # On the CPU nothing crosses a link: no "link" bar, no legend entry.
    assert all(s["link_s"] == 0 for s in trainstream.memory_report(model)["stalls"])
    assert "link" not in _legend(ax_wait) and "nothing (compute, data, your code)" in _legend(ax_wait)
    host_budget = [t for t in _legend(ax_plan) if t.startswith("host RAM budget ")]
    assert host_budget and host_budget[0].endswith("GiB"), _legend(ax_plan)
    assert "host RSS" in _legend(ax_mem) and "host RAM (plan)" in _legend(ax_mem)
    planned = [line for line in ax_mem.get_lines() if line.get_label() == "host RAM (plan)"]
    assert planned[0].get_ydata()[0] == pytest.approx(plan["host_bytes"] / _plot.GiB)
    trainstream.unwrap(model)


def test_every_axis_starts_at_zero(figure):
    model, _ = _trained()
    fig = figure(model)
    assert [ax.get_ylim()[0] for ax in fig.axes] == [0, 0, 0]
    trainstream.unwrap(model)


def test_the_lower_bound_is_on_the_step_times_axis_at_the_batch_trained(figure):
    model, _ = _trained()
    ax_wait = figure(model).axes[2]
    assert ax_wait.get_ylabel() == "ms"
    plan, _ = _plot.plan_at(model, trainstream.memory_report(model)["plan"], (BATCH, SEQ))
    bound = [line for line in ax_wait.get_lines() if line.get_label().startswith("lower bound ")]
    assert len(bound) == 1 and f"(plan at {BATCH} x {SEQ} tokens)" in bound[0].get_label()
    assert bound[0].get_ydata()[0] == pytest.approx(plan["lower_bound_s"]["total"] * 1e3)  # ms, as the bars
    assert bound[0].get_label() in _legend(ax_wait)
    assert "lower bound" not in figure(model).axes[0].get_title()  # no longer a number in another panel's title
    trainstream.unwrap(model)


def test_with_accumulation_the_lower_bound_is_left_out_with_a_note(figure):
    model, _ = _trained(accumulation=2)
    ax_wait = figure(model).axes[2]
    assert not [line for line in ax_wait.get_lines() if line.get_label().startswith("lower bound")]
    notes = [t.get_text() for t in ax_wait.texts]
    assert any("no lower bound: 2 training forwards a step" in note for note in notes), notes
    trainstream.unwrap(model)


def test_a_model_without_a_decoder_shape_gets_a_note_instead_of_a_bound(figure):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + self.linear(x)

    model = torch.nn.Sequential(*[Block() for _ in range(3)])
    model, optimizer = trainstream.wrap(model, torch.optim.AdamW(model.parameters()))
    for _ in range(2):
        model(torch.randn(2, 5, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    fig = figure(model)
    notes = [t.get_text() for t in fig.axes[2].texts]
    assert any(note.startswith("no lower bound: the plan has no decoder shape") for note in notes), notes
    assert [ax.get_ylim()[0] for ax in fig.axes] == [0, 0, 0]
    trainstream.unwrap(model)
