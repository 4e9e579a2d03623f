"""tools/bench/link_timeline.py (issue 11): the link's idle gaps and busy fractions read from a chrome trace, on
a hand-made trace whose answer is known."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench"
sys.path.insert(0, str(BENCH))

import link_timeline  # noqa: E402


def _trace() -> list[dict]:
    """One 30 ms step: stream 7 copies host-to-device 0-10 ms and decodes 20-24 ms, copies again 24-30 ms;
    stream 9 computes 5-25 ms and uploads a few bytes (a batch's ids: still the compute stream); the host runs
    aten::mm 12-14 ms. The link idles 10-20 ms, under the gemm."""
    return [
        {"name": "train_step", "cat": "user_annotation", "ts": 0, "dur": 30_000},
        {"name": "Memcpy HtoD (Pinned -> Device)", "cat": "gpu_memcpy", "ts": 0, "dur": 10_000, "tid": 7},
        {"name": "decode", "cat": "kernel", "ts": 20_000, "dur": 4_000, "tid": 7},
        {"name": "Memcpy HtoD (Pinned -> Device)", "cat": "gpu_memcpy", "ts": 24_000, "dur": 6_000, "tid": 7},
        {"name": "gemm", "cat": "kernel", "ts": 5_000, "dur": 20_000, "tid": 9},
        {"name": "Memcpy HtoD (Pageable -> Device)", "cat": "gpu_memcpy", "ts": 15_000, "dur": 100, "tid": 9},
        {"name": "aten::mm", "cat": "cpu_op", "ts": 12_000, "dur": 2_000},
    ]


def test_gaps_busy_fractions_and_what_ran_inside():
    events = _trace()
    (window,) = link_timeline.windows(events)
    result = link_timeline.analyse(events, window, bin_ms=10, top_gaps=5)
    assert result["window_ms"] == 30 and result["link_ms"] == 20 and result["compute_ms"] == 20
    assert [round(b["link"], 2) for b in result["bins"]] == [1.0, 0.0, 1.0]  # the decode on stream 7 is link time
    assert [round(b["compute"], 2) for b in result["bins"]] == [0.5, 1.0, 0.5]
    (gap,) = result["gaps"]
    assert (gap["at_ms"], gap["ms"], gap["compute_ms"]) == (10, 10, 10)
    assert gap["kernels"] == [("gemm", 10.0)] and gap["host"] == [("aten::mm", 2.0)]


def test_command_line_reads_a_gzipped_trace(tmp_path):
    import gzip

    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    saved = tmp_path / "window.json.gz"
    done = subprocess.run([sys.executable, str(BENCH / "link_timeline.py"), str(path), "--bin-ms", "10",
                           "--save-window", str(saved)], capture_output=True, text=True, timeout=60, cwd=BENCH)
    assert done.returncode == 0, done.stderr
    assert "link busy 20.0 ms, compute busy 20.0 ms (link streams 7)" in done.stdout
    assert "    10.0   10.00   10.00  | gemm 10.0 | aten::mm 2.0 | " in done.stdout
    assert len(link_timeline.load_events(str(saved))) == len(_trace())
