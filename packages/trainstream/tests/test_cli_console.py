"""What `trainstream` shows on a console: the plan's events, a progress bar that no event line lands on, a short
summary; no JSON without --json, and on a CPU none of the GPU's vocabulary."""

from __future__ import annotations

import re

import pytest
import torch
from trainstream import cli

BAR = re.compile(r"\d+/\d+ \[")  # tqdm's "3/4 [00:01<00:00, ...]"
EVENT = re.compile(r"^trainstream \w+: ")
# Words of GPU features that are off on a CPU: a CPU run's console must not need them.
GPU_WORDS = ("page-lock", "pinned", "guard_params", "peer", "link", "streamed", "paged", "mapped", "GPU driver")


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: a carriage return moves back to the line's start, and later
    characters overwrite earlier ones (a cleared bar leaves spaces, which are stripped)."""
    lines, line, col = [], [], 0
    for char in text:
        if char == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif char == "\r":
            col = 0
        else:
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
    if line:
        lines.append("".join(line).rstrip())
    return lines


def _with_events_during_training(monkeypatch):
    """Adds an event after every optimizer step, as a GPU run's switches and trials come mid-run."""
    real = cli._wrap

    def wrap(model, optimizer, args, device):
        model, optimizer = real(model, optimizer, args, device)
        session, step = model._trainstream_session, optimizer.step

        def stepped(*a, **k):
            result = step(*a, **k)
            session.events.add("switch", f"a decision made during step {session.steps}")
            return result

        monkeypatch.setattr(optimizer, "step", stepped)
        return model, optimizer

    monkeypatch.setattr(cli, "_wrap", wrap)


def test_no_event_shares_a_line_with_the_progress_bar(capsys, monkeypatch):
    _with_events_during_training(monkeypatch)
    assert cli.main(["--steps", "4", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    lines = screen(printed.err)
    events = [line for line in lines if "a decision made during step" in line]
    assert len(events) == 4 and all(EVENT.match(line) for line in events), lines
    both = [line for line in screen(printed.err + printed.out) if BAR.search(line) and "trainstream " in line]
    assert not both, both
    assert any(BAR.search(line) and "4/4" in line for line in lines)  # the bar, drawn again after each event


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run's output")
def test_the_plain_demo_is_a_short_console_summary_in_cpu_words(capsys):
    assert cli.main(["--steps", "3"]) == 0
    printed = capsys.readouterr()
    lines = screen(printed.out) + screen(printed.err)
    assert len(lines) <= 60, "\n".join(lines)
    assert not any("{" in line for line in lines), "no JSON without --json PATH"
    out = printed.out
    assert re.search(r"done: loss [\d.]+ -> [\d.]+ in 3 steps, median step [\d.]+ (ms|s)", out)
    assert "  optimizer state   host " in out and "  decided           " in out and "--json PATH" in out
    assert "sample " not in out  # no tokenizer: no generation
    events = [line for line in lines if EVENT.match(line)]
    assert any(line.startswith("trainstream plan: ") for line in events)
    jargon = [(word, line) for line in events for word in GPU_WORDS if word in line]
    assert not jargon, jargon


def test_the_json_report_is_written_only_when_asked(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["--steps", "2", "--json", str(out)]) == 0
    assert out.exists() and '"report"' in out.read_text()
    printed = capsys.readouterr()
    assert "{" not in printed.out and "{" not in printed.err


def test_the_demo_leaves_the_trainstream_logger_as_it_found_it():
    import logging

    logger = logging.getLogger("trainstream")
    before = (list(logger.handlers), logger.level)
    assert cli.main(["--steps", "1"]) == 0
    assert (list(logger.handlers), logger.level) == before


def test_the_lora_demo_s_console_without_the_gguf_file(capsys, monkeypatch):
    """`--model` with the built-in tiny decoder standing in for the GGUF file: the same console (events, bar,
    summary with the held-out perplexity), and peft's deprecation warning about transformers 5 not shown."""
    import warnings

    pytest.importorskip("peft")

    class Bytes:  # a tokenizer of the built-in text's bytes (the tiny decoder's 256 ids)
        eos_token_id = None

        def __call__(self, text):
            return {"input_ids": list(text.encode("utf-8"))}

        def decode(self, ids, skip_special_tokens=False):
            return bytes(ids).decode("utf-8", errors="replace")

    monkeypatch.setattr(cli, "smollm2_gguf", lambda: "stand-in.gguf")
    monkeypatch.setattr(cli, "load_gguf", lambda path: (cli.build_model("tiny", torch.float32), Bytes()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["--model", "smollm2", "--steps", "2", "--seq", "16", "--device", "cpu"]) == 0
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    printed = capsys.readouterr()
    lines = screen(printed.out) + screen(printed.err)
    assert len(lines) <= 60 and not any("{" in line for line in lines), lines
    assert re.search(r"done: loss [\d.]+ -> [\d.]+ in 2 steps, .*; held-out perplexity [\d.]+ -> [\d.]+", printed.out)
    assert [line.split(":")[0] for line in printed.out.splitlines() if line.startswith("sample ")] == \
        ["sample before training", "sample after training"]  # with a tokenizer: a sample before and after
    assert any(BAR.search(line) and "2/2" in line for line in screen(printed.err))
