"""tools/bench/interleaved_ab.py: the base version's processes (compare.py's engine child included) import
trainstream from the base tree, the head's from the installed one, in alternation."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import trainstream

BENCH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench"


def test_base_runs_its_own_tree_down_to_the_engine_process(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(pathlib.Path(trainstream.__file__).parent, base / "trainstream")
    wrap_py = base / "trainstream" / "_wrap.py"
    source = wrap_py.read_text()
    marked = source.replace("def wrap(", "def wrap(*_a, **_k):\n    raise RuntimeError('AB-BASE-MARKER')\n\n\n"
                                         "def _unmarked_wrap(", 1)
    assert marked != source
    wrap_py.write_text(marked)
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(BENCH / "interleaved_ab.py"), "--base-dir", str(base),
                           "--scenario", "lora_tiny", "--engine", "trainstream-lora", "--rounds", "1", "--steps", "3",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=BENCH)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["imported_from"]["base"].startswith(str(base))
    base_run, head_run = saved["runs"]
    assert (base_run["version"], head_run["version"]) == ("base", "head")
    assert "AB-BASE-MARKER" in base_run["outcome"]  # the engine's own process ran the base tree's wrap()
    assert head_run["outcome"] == "ok" and head_run["median_s"] > 0
    assert "head: median of its 1 runs' medians" in done.stdout
