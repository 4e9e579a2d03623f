"""tools/bench/disk_tier.py end to end at a tiny size: both engines run alternated, train the same bits, and the
record holds the disk engine's bound from the measured disk rates."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from disk_state import filesystem  # noqa: E402


def test_the_disk_tier_bench_runs_both_engines_and_bounds_the_disk_one(tmp_path):
    if filesystem(str(tmp_path)) == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs: the bench needs a disk")
    out = tmp_path / "disk-tier.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "disk_tier.py"), "--dir", str(tmp_path),
                           "--width", "512", "--depth", "2", "--rounds", "2", "--steps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["same_bits"] is True and data["kind"] == "cpu-disk" and data["name"] == "disk-tier"
    assert [r["round"] for r in data["engines"]["disk"]["runs"]] == [0, 1]
    (run, _) = data["engines"]["disk"]["runs"]
    assert run["file_bytes"] >= 2 * 512 * 512 * 12 and run["disk_params"] == 2
    bound = data["bounds"]["disk"]
    terms = bound["terms"]
    assert bound["value"] == max(terms["read_s"], terms["write_s"], terms["mixed_s"], terms["ram_step_s"])
    assert all(r["share_of_bound"] == pytest.approx(bound["value"] / r["seconds"])
               for r in data["engines"]["disk"]["runs"])
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no scratch file left behind
