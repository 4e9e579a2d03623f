"""One host thread pool per process, shared by every core; sized and bounded by the cores this process may use;
a working pool in a child forked mid-loop; a core that cannot share falls back to its own pool with a warning."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import ts_adamw
from ts_adamw import _core

CORES = ("ts_adamw", "ts_pinned", "ts_quant", "ts_planner")


def run_python(code: str, timeout: float = 120, env: dict | None = None) -> str:
    """Runs `code` in a fresh interpreter (a clean pool and thread count); returns stdout, fails on error."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture
def restore_threads():
    before = ts_adamw.host_threads()
    yield
    ts_adamw.set_host_threads(before)


def test_all_cores_share_one_pool():
    if sum(_importable(name) for name in CORES) < 2:
        pytest.skip("needs two TrainStream cores installed (ts-adamw is installed alone here)")
    out = run_python("""
        import importlib, os
        import torch
        cores = []
        for name in ("ts_adamw", "ts_pinned", "ts_quant", "ts_planner"):
            try:
                cores.append(importlib.import_module(name + "._core"))
            except ImportError:
                pass
        import ts_adamw
        ts_adamw.set_host_threads(3)
        before = len(os.listdir("/proc/self/task"))
        for core in cores:
            assert core._pool_test(12, 0.003) >= 1
        grown = len(os.listdir("/proc/self/task")) - before
        infos = [core._host_pool_info() for core in cores]
        print(len(cores), grown, len({i["id"] for i in infos}), all(i["shared"] for i in infos),
              sorted({c.host_threads() for c in cores}), infos[0]["workers"], infos[0]["provider"])
    """)
    count, grown, ids, shared, threads, workers, provider = out.split()
    assert int(count) >= 2, "needs at least two cores installed"
    assert ids == "1" and shared == "True"
    assert threads == "[3]" and workers == "2"
    assert int(grown) == 2, f"{grown} threads started for a 3-thread pool shared by {count} cores"
    assert provider.endswith("._core")


def test_set_host_threads_sizes_every_core(restore_threads):
    others = [pytest.importorskip(f"{name}._core") for name in CORES[1:] if _importable(name)]
    target = min(3, ts_adamw.max_host_threads())
    assert ts_adamw.set_host_threads(target) is True
    for core in (_core, *others):
        assert core.host_threads() == target
    for core in (_core, *others):
        core._pool_test(4 * target, 0.002)
        assert core._host_pool_info()["workers"] == target - 1
    ts_adamw.set_host_threads(1)  # shrinking stops the workers at the next loop
    assert _core._pool_test(8, 0.001) == 1
    assert _core._host_pool_info()["workers"] == 0


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def test_an_error_in_another_cores_chunk_crosses_the_shared_pool():
    for name in CORES:
        if not _importable(name):
            continue
        core = __import__(f"{name}._core", fromlist=["_core"])
        with pytest.raises(ValueError, match="item 5 failed"):
            core._pool_test(16, 0.0, 0, 5)
        assert core._pool_test(4) >= 1  # the pool still works


@pytest.mark.parametrize("bad", [0, -1, 2**31, 2**70, -(2**70), True, 2.0, "4", None])
def test_set_host_threads_refuses_with_the_limit(bad, restore_threads):
    before = ts_adamw.host_threads()
    limit = ts_adamw.max_host_threads()
    with pytest.raises(ValueError, match="threads=") as error:
        ts_adamw.set_host_threads(bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        assert f"1 to {limit}" in str(error.value)
    assert ts_adamw.host_threads() == before
    with pytest.raises(ValueError, match=f"1 to {limit}"):
        ts_adamw.set_host_threads(limit + 1)


def test_limit_is_four_per_usable_core(restore_threads):
    usable = ts_adamw.usable_cores()
    assert 1 <= usable <= (os.cpu_count() or usable)
    assert usable <= len(os.sched_getaffinity(0))
    assert ts_adamw.max_host_threads() == 4 * usable
    assert ts_adamw.set_host_threads(ts_adamw.max_host_threads()) is True
    assert 1 <= _core.host_cpus()["physical"] <= usable


@pytest.mark.parametrize("threads", [0, 2**40, 2**70, True])
def test_threads_argument_is_bounded(threads):
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match=f"1 to {ts_adamw.max_host_threads()}|threads="):
        ts_adamw.adamw_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                            threads=threads)
    with pytest.raises(ValueError, match="threads="):
        ts_adamw.sum_of_squares([g], threads=threads)
    with pytest.raises(ValueError, match="threads="):
        ts_adamw.AdamW([torch.nn.Parameter(p)], threads=threads)


def test_huge_step_is_a_value_error():
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    with pytest.raises(ValueError, match="step="):
        ts_adamw.adamw_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=2**64)
    with pytest.raises(ValueError, match="lr="):
        ts_adamw.adamw_step(p, g, m, v, lr=10**400, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def _write_cpu_cgroup(root, version: int, quota: str) -> None:
    (root / "proc" / "self").mkdir(parents=True)
    fs = root / "sys" / "fs" / "cgroup"
    if version == 2:
        (root / "proc" / "self" / "cgroup").write_text("0::/job/step\n")
        (fs / "job" / "step").mkdir(parents=True)
        (fs / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        (fs / "job" / "cpu.max").write_text(f"{quota} 100000\n")
        (fs / "job" / "step" / "cpu.max").write_text("max 100000\n")
    else:
        (root / "proc" / "self" / "cgroup").write_text("5:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n")
        # A container mounts its own cgroup as the hierarchy's root: /docker/x is not below the mount.
        (fs / "cpu,cpuacct").mkdir(parents=True)
        (fs / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (fs / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")


@pytest.mark.parametrize("version, quota, cpus", [(2, "150000", 1.5), (2, "max", None), (1, "100000", 1.0),
                                                  (1, "-1", None), (2, "50000", 0.5)])
def test_cpu_quota_from_a_fake_cgroup(tmp_path, version, quota, cpus):
    _write_cpu_cgroup(tmp_path, version, quota)
    info = _core.host_cpus(str(tmp_path))
    affinity = len(os.sched_getaffinity(0))
    assert info["affinity"] == affinity
    if cpus is None:
        assert info["quota"] is None and info["usable"] == affinity
    else:
        assert info["quota"] == pytest.approx(cpus)
        assert info["quota_source"].startswith(f"cgroup v{version} {tmp_path}")
        assert info["usable"] == min(affinity, math.ceil(cpus))
    assert 1 <= info["physical"] <= info["usable"]


def test_pool_is_sized_and_bounded_by_the_cgroup_quota(tmp_path):
    _write_cpu_cgroup(tmp_path, 2, "100000")  # one CPU
    out = run_python("""
        import ts_adamw
        print(ts_adamw.usable_cores(), ts_adamw.max_host_threads(), ts_adamw.host_threads())
        try:
            ts_adamw.set_host_threads(5)
        except ValueError as e:
            print("refused:", e)
    """, env={"TS_CGROUP_ROOT": str(tmp_path)})
    assert out.splitlines()[0] == "1 4 1"
    assert "refused:" in out and "1 to 4" in out and "1 cores this process may use" in out


def test_child_forked_during_a_parallel_loop_gets_a_working_pool():
    out = run_python("""
        import os, sys, threading, time, warnings
        warnings.simplefilter("ignore")
        import torch, ts_adamw
        from ts_adamw import _core
        ts_adamw.set_host_threads(2)
        busy = threading.Thread(target=_core._pool_test, args=(8, 0.25))  # ~1 s on 2 threads
        busy.start()
        time.sleep(0.3)  # the loop runs: its mutexes are held, its workers busy
        pid = os.fork()
        if pid == 0:
            ok = _core._pool_test(16, 0.01) == 2 and _core._host_pool_info()["workers"] == 1
            p, g = torch.ones(1 << 16), torch.full((1 << 16,), 0.5)
            m, v = torch.zeros_like(p), torch.zeros_like(p)
            ts_adamw.adamw_step(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
            ok = ok and bool(torch.allclose(p, torch.full_like(p, 0.9)))
            os._exit(0 if ok else 3)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
            sys.exit(1)
        busy.join()
        print("child exit", os.waitstatus_to_exitcode(status))
    """, timeout=90)
    assert out.strip() == "child exit 0"


FAKE_TABLE = """
    import ctypes, sys, warnings

    class Table(ctypes.Structure):
        _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                    ("provider", ctypes.c_char_p), ("fns", ctypes.c_void_p * 4)]

    table = Table(%d, %s, b"a future core")
    name = ctypes.create_string_buffer(b"trainstream.host_pool")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    sys._trainstream_host_pool = %s
"""


@pytest.mark.parametrize("version, size, value, says", [
    (999, "ctypes.sizeof(Table)", "new(ctypes.addressof(table), name, None)", "ABI version 999"),
    (1, "8", "new(ctypes.addressof(table), name, None)", "size 8"),
    (1, "ctypes.sizeof(Table)", "object()", "not a"),
])
def test_a_core_that_cannot_share_falls_back_with_a_warning(version, size, value, says):
    out = run_python(FAKE_TABLE % (version, size, value) + """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch, ts_adamw
    from ts_adamw import _core
    info = _core._host_pool_info()
    p, g = torch.ones(1000), torch.full((1000,), 0.5)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ts_adamw.adamw_step(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    print(info["own"], info["shared"], round(float(p[0]), 5), _core._pool_test(8, 0.001) >= 1)
    print([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])
    """)
    first, warnings_line = out.splitlines()[:2]
    assert first.split() == ["True", "False", "0.9", "True"]
    assert "own host thread pool" in warnings_line or "runs its own pool" in warnings_line
    assert says in warnings_line
