"""tools/bench/host_overhead.py, the CPU benchmark CI watches (issue 13): it runs, and trainstream's host work per
step grows with the gradient buckets, not with the trained tensors (672 LoRA-sized tensors: 11 buckets of 64)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench" / "host_overhead.py"


def test_host_work_per_step_follows_buckets_not_tensors():
    done = subprocess.run([sys.executable, str(BENCH), "--steps", "3", "--warmup", "1"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    assert re.search(r"trainstream\.wrap\s+[\d.]+ ms/step", done.stdout)
    launches, calls, tensors = re.search(r"host work per step: ([\d.]+) gradient D2H launches, ([\d.]+) host "
                                         r"AdamW calls for (\d+) trained tensors", done.stdout).groups()
    assert int(tensors) == 672
    assert float(launches) == 11  # ceil(672 / 64): one launch per bucket
    assert float(calls) == 11  # a bucket's updates are queued in one go: one host AdamW call each
