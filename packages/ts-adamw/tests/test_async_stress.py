"""Async lane lifetime under stress: handles dropped unwaited, waited from many threads, in flight at exit, fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import ts_adamw

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _set(n, seed, moments=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16(),
            torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments), torch.empty(n, dtype=torch.bfloat16))


def test_many_handles_dropped_unwaited_match_sync():
    sets = [_set(20_000 + 17 * i, i, torch.bfloat16 if i % 2 else torch.float32) for i in range(64)]
    refs = [tuple(t.clone() for t in s) for s in sets]
    for step in (1, 2):
        for p, g, m, v, o in sets:
            # The handle dies at once (a temporary): its destructor waits, with the GIL released.
            ts_adamw.adamw_step_async(p, g, m, v, step=step, param_out=o, seed=5, **KW)
        for p, g, m, v, o in refs:
            ts_adamw.adamw_step(p, g, m, v, step=step, param_out=o, seed=5, **KW)
    for a, b in zip(sets, refs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_threads_submit_drop_and_wait_concurrently():
    errors = []

    def worker(seed):
        try:
            sets = [_set(30_000, seed * 100 + i) for i in range(8)]
            handles = [ts_adamw.adamw_step_async(p, g, m, v, step=1, param_out=o, **KW) for p, g, m, v, o in sets]
            for i, h in enumerate(handles):
                if i % 2:
                    h.wait()
            del handles  # the rest die unwaited, on this (GIL-holding) thread
            for p, _g, _m, _v, o in sets:
                assert torch.equal(o, p.bfloat16())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_one_handle_waited_from_many_threads():
    p, g, m, v, o = _set(2_000_000, 9)
    h = ts_adamw.adamw_step_async(p, g, m, v, step=1, param_out=o, **KW)
    threads = [threading.Thread(target=h.wait) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.done()
    h.wait()


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, ts_adamw
    KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    keep = []
    for i in range(30):
        p, g = torch.randn(200_000), torch.randn(200_000)
        m, v = torch.zeros(200_000), torch.zeros(200_000)
        h = ts_adamw.adamw_step_async(p, g, m, v, step=1, **KW)
        if i % 3 == 0:
            keep.append(h)        # alive until interpreter teardown
        elif i % 3 == 1:
            globals()[f"h{i}"] = h  # a module global, freed during finalization
        # else: dropped now, unwaited
        del p, g, m, v
    # A reference cycle holding a handle: freed (if ever) by the collector at exit.
    cycle = [ts_adamw.adamw_step_async(torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10),
                                       step=1, **KW)]
    cycle.append(cycle)
    del cycle
    print("submitted", flush=True)
    sys.exit(int(sys.argv[1]))
""")


@pytest.mark.parametrize("code", [0, 3])
def test_interpreter_exit_with_handles_in_flight(code):
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _EXIT_SCRIPT, str(code)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert "submitted" in proc.stdout
    assert "Fatal" not in proc.stderr and "Segmentation" not in proc.stderr, proc.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_async_steps_work_in_a_forked_child():
    p, g, m, v, o = _set(100_000, 4)
    ts_adamw.adamw_step_async(p, g, m, v, step=1, param_out=o, **KW).wait()  # the parent's lane exists
    script = textwrap.dedent("""
        import os, sys, torch, ts_adamw
        KW = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        p, g, m, v = torch.randn(1000), torch.randn(1000), torch.zeros(1000), torch.zeros(1000)
        ts_adamw.adamw_step_async(p, g, m, v, step=1, **KW).wait()
        pid = os.fork()
        if pid == 0:
            q = p.clone()
            ts_adamw.adamw_step_async(q, g, m.clone(), v.clone(), step=2, **KW).wait()
            os._exit(0 if not torch.equal(q, p) else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
