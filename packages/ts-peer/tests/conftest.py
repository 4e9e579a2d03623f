"""Fixture `run_ranks`: starts the ranks of a multi-process test as separate Python processes
(_dist_worker.py) and collects their JSON. Separate processes, not multiprocessing: the worker
needs no import of this test package, which --import-mode=importlib does not make importable."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("_dist_worker.py")


def _run_ranks(backend: str, world: int, tmp: pathlib.Path, timeout: float = 240) -> list[dict]:
    init = tmp / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), backend, str(r), str(world), str(init),
                               str(tmp / f"rank{r}.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r]}"
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="session")
def run_ranks():
    return _run_ranks
