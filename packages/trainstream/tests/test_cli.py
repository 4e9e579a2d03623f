"""The README's main job: `trainstream` with no arguments trains the built-in decoder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainstream import cli
from trainstream._demo_text import byte_batches


def test_default_run_trains_and_reports(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["--steps", "12", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "trainstream optimizer: optimizer_mode='cpu'" in printed.err  # the plan's events, before training
    assert "done: loss" in printed.out and "memory report" in printed.out
    assert "  optimizer state   host " in printed.out
    assert '"pinned"' not in printed.out and len(printed.out.splitlines()) < 40  # a summary, not the JSON report
    assert "12/12 [" in printed.err  # the progress bar reached the end
    result = json.loads(out.read_text())
    assert len(result["losses"]) == 12
    assert result["losses"][-1] < result["losses"][0]
    assert result["report"]["optimizer"]["steps"] == 12


def test_attention_flag_reaches_wrap(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert cli.main(["--steps", "2", "--attention", "math", "--json", str(out)]) == 0
    attention = json.loads(out.read_text())["report"]["attention"]
    assert attention["mode"] == "math"
    assert cli.main(["--steps", "2", "--json", str(out)]) == 0  # not given: wrap()'s default ("default" on the CPU)
    assert json.loads(out.read_text())["report"]["attention"]["mode"] == "default"


def test_byte_batches_are_reproducible_and_in_range():
    a = list(byte_batches(3, 40, 4, seed=5))
    b = list(byte_batches(3, 40, 4, seed=5))
    assert all((x == y).all() for x, y in zip(a, b))
    assert all(x.shape == (3, 40) and int(x.max()) < 256 for x in a)


def _refused(argv, capsys, monkeypatch):
    """main(argv) must stop in argparse (exit code 2) before building a model; returns stderr."""
    def no_work(*args, **kwargs):
        raise AssertionError("a model was built before the options were checked")

    monkeypatch.setattr(cli, "build_model", no_work)
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, not nan"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, not -1"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0"),
    (["--lr", "fast"], "argument --lr: takes a finite number > 0, not 'fast'"),
    (["--max-grad-norm", "-1"], "argument --max-grad-norm: must be a finite number > 0, not -1"),
    (["--max-grad-norm", "0"], "argument --max-grad-norm: must be a finite number > 0"),
    (["--vram-gb", "-5"], "argument --vram-gb: takes a size in (0, 1e6] GiB: a number of GiB (24, 22.35) or one "
                          "with its unit (24GiB, 24GB), not '-5'"),
    (["--vram-gb", "1e300"], "argument --vram-gb: takes a size in (0, 1e6] GiB"),
    (["--vram-gb", "0"], "argument --vram-gb: takes a size in (0, 1e6] GiB"),
    (["--vram-gb", "24 XB"], "argument --vram-gb: takes a size in (0, 1e6] GiB"),
    (["--device", "tpu"], "argument --device: takes cpu, cuda or cuda:N, not 'tpu'"),
    (["--device", "cpu:0"], "argument --device: takes cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "argument --device: takes cpu, cuda or cuda:N"),
    (["--steps", "0"], "argument --steps: must be an integer >= 1, not 0"),
    (["--batch", "0"], "argument --batch: must be an integer >= 1, not 0"),
    (["--seq", "0"], "argument --seq: must be an integer >= 1, not 0"),
    (["--seq", "1.5"], "argument --seq: takes an integer >= 1, not '1.5'"),
    (["--seed", "-3"], "argument --seed: must be an integer in [0, 2**32)"),
])
def test_bad_values_are_argparse_errors_before_any_work(argv, message, capsys, monkeypatch):
    assert message in _refused(argv, capsys, monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_up_front(capsys, monkeypatch):
    assert "argument --device: cuda:0: torch" in _refused(["--device", "cuda:0"], capsys, monkeypatch)


@pytest.mark.cuda
def test_a_gpu_the_machine_lacks_is_refused_up_front(capsys, monkeypatch):
    count = torch.cuda.device_count()
    err = _refused(["--device", f"cuda:{count}"], capsys, monkeypatch)
    assert f"argument --device: cuda:{count}: this machine has cuda:0..cuda:{count - 1}" in err


def test_an_unwritable_json_path_is_refused_before_training(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "no-such-folder" / "run.json"
    err = _refused(["--json", str(missing)], capsys, monkeypatch)
    assert "argument --json:" in err and "does not exist" in err
    assert "is a folder" in _refused(["--json", str(tmp_path)], capsys, monkeypatch)
    # Refused by the kernel even for root: the check opens the file, it does not guess from mode bits.
    assert "cannot be written" in _refused(["--json", "/proc/trainstream-run.json"], capsys, monkeypatch)
    assert not missing.parent.exists()


def test_the_json_check_leaves_no_file_and_keeps_an_existing_one(tmp_path):
    fresh = tmp_path / "fresh.json"
    assert cli._parse(["--json", str(fresh)]).json == str(fresh)
    assert not fresh.exists()  # no stray file if the run never gets to the end
    old = tmp_path / "old.json"
    old.write_text("keep")
    cli._parse(["--json", str(old)])
    assert old.read_text() == "keep"


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_lr_is_accepted_exactly_when_finite_and_positive(value):
    good = math.isfinite(value) and value > 0
    try:
        parsed = cli._parse(["--lr", repr(value)]).lr
    except SystemExit as stopped:
        assert stopped.code == 2 and not good
    else:
        assert good and parsed == value


def _error_line(argv, capsys, monkeypatch, build: bool = False) -> str:
    """main(argv) refuses with one line and exit code 2 (no traceback); returns that line. build=False: before
    any model is built."""
    if not build:
        monkeypatch.setattr(cli, "build_model", lambda *a, **k: pytest.fail("a model was built before the refusal"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1]
    assert "Traceback" not in err and last.startswith("trainstream: error: "), err
    assert build or err.count("\n") == 1, err  # before any work: that line alone
    return last


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch", "100000000"], "needs about"),  # before: killed by the OOM killer after minutes
    (["--seq", "100000000"], "the demo model's context is 4096 tokens"),  # before: a traceback from the model
])
def test_sizes_beyond_the_machine_or_the_model_are_refused_before_any_work(argv, message, capsys, monkeypatch):
    assert message in _error_line(argv, capsys, monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_options_the_machine_cannot_honour_are_a_message(capsys, monkeypatch):
    assert "needs a CUDA device" in _error_line(["--optimizer-mode", "gpu", "--steps", "1"], capsys, monkeypatch,
                                                build=True)


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_json_file_that_cannot_be_written_at_the_end_is_a_message(capsys, monkeypatch):
    assert "No space left" in _error_line(["--steps", "1", "--json", "/dev/full"], capsys, monkeypatch, build=True)


def test_ctrl_c_is_one_line_and_exit_code_130():
    import signal
    import subprocess
    import sys
    import time

    run = subprocess.Popen([sys.executable, "-m", "trainstream.cli", "--steps", "100000"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 120
        while "/100000 [" not in seen and time.monotonic() < deadline:  # training has started (the bar)
            seen += run.stderr.read(1)
        run.send_signal(signal.SIGINT)
        err = seen + run.communicate(timeout=60)[1]
    finally:
        run.kill()
    assert run.returncode == 130, err
    assert err.rstrip().endswith("trainstream: interrupted") and "Traceback" not in err, err[-2000:]


def test_version_names_trainstream_its_cores_and_torch(capsys):
    import trainstream

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"trainstream {trainstream.__version__}"
    assert [line.split()[0] for line in lines] == ["trainstream", "ts-pinned", "ts-adamw", "ts-quant", "ts-planner",
                                                   "ts-kvcache", "ts-peer", "torch"]
    assert lines[-1] == f"torch {torch.__version__}"


def test_the_summary_says_what_streams_is_quantized_and_what_moved():
    from trainstream._report import summary_lines

    report = {"optimizer": {"placements": {"device": {"values": 2_000_000, "state_bytes": 3 << 30}},
                            "moment_dtype": "float32", "steps": 7},
              "params": {"paged_blocks": [1, 3], "load_bytes": 2 << 30, "quantize": "nf4", "quantized_blocks": [0, 1]},
              "gpu": {"peak_allocated": 5 << 30}, "pinned": {"arena_used": 1 << 30},
              "plan": {"decisions": [{"option": "quantize", "value": "nf4"}],
                       "transitions": [{"step": 1, "transition": "optimizer_placement", "reason": "it fits",
                                        "changes": {"optimizer_placement": {}}},
                                       {"step": 2, "transition": "mapped_trial", "reason": "timed", "changes": {}}]}}
    text = "\n".join(summary_lines(report))
    assert "device 2.0 M values (3.00 GiB); float32 moments; 7 steps" in text
    assert "blocks [1, 3] from host memory, 2.00 GiB per step" in text and "nf4: 2 blocks" in text
    assert "peak 5.00 GiB allocated" in text and "decided           quantize='nf4'" in text
    assert "optimizer_placement: it fits" in text and "mapped_trial" not in text  # only transitions that changed
