"""The disk tier's DiskState: it steps bit-for-bit as adamw_steps in RAM (all parameters or some, reading ahead,
writing behind), and a failed step never applies data that was not fully read. StateFile: test_state_file.py."""

from __future__ import annotations

import errno
import time

import pytest
import torch
import ts_adamw
from disk_testing import BLOCK, KW, entries
from hypothesis import given, settings
from hypothesis import strategies as st

# ---- DiskState --------------------------------------------------------------------------------------------------


def _model(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}


def _reference(params, moments):
    ps = [p.clone().reshape(-1) for p in params.values()]
    return ps, [torch.zeros_like(p, dtype=moments) for p in ps], [torch.zeros_like(p, dtype=moments) for p in ps]


def _state_equals(state, ref) -> bool:
    for i, name in enumerate(state.names):
        got = state.read_state(name)
        if not all(torch.equal(got[k].reshape(-1), r[i]) for k, r in zip(("param", "exp_avg", "exp_avg_sq"), ref)):
            return False
    return True


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=6), quanta=st.integers(1, 5),
       depth=st.integers(1, 4), moments=st.sampled_from([torch.float32, torch.bfloat16]),
       grad=st.sampled_from([torch.float32, torch.bfloat16]), out=st.sampled_from([None, torch.bfloat16]),
       seed=st.integers(0, 2**32))
def test_disk_steps_are_bit_exact_with_steps_in_ram(tmp_path_factory, sizes, quanta, depth, moments, grad, out,
                                                     seed):
    params = _model(sizes, seed % 1000)
    ref = _reference(params, moments)
    directory = tmp_path_factory.mktemp("exact")
    with ts_adamw.DiskState(params, directory, moment_dtype=moments, depth=depth,
                            segment_values=quanta * 2048) as state:
        assert state.depth == depth
        for step in range(1, 4):
            gen = torch.Generator().manual_seed(seed % 997 + step)
            grads = {n: torch.randn(p.shape, generator=gen).to(grad) for n, p in params.items()}
            outs = None if out is None else {n: torch.empty(p.shape, dtype=out) for n, p in params.items()}
            ref_outs = None if out is None else [torch.empty(p.numel(), dtype=out) for p in params.values()]
            state.step(grads, step=step, params_out=outs, seed=seed, **KW)
            ts_adamw.adamw_steps(ref[0], [g.reshape(-1) for g in grads.values()], ref[1], ref[2], step=step,
                                 params_out=ref_outs, seed=seed, **KW)
            if out is not None:
                assert all(torch.equal(o.reshape(-1), r) for o, r in zip(outs.values(), ref_outs))
        assert _state_equals(state, ref)
    assert entries(directory) == []


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 7000), min_size=2, max_size=6), depth=st.integers(1, 3),
       moments=st.sampled_from([torch.float32, torch.bfloat16]), picks=st.lists(st.integers(0, 63), min_size=3,
                                                                                max_size=5),
       ahead=st.sampled_from(["none", "next", "wrong"]), read_between=st.booleans(), wait=st.booleans(),
       seed=st.integers(0, 2**32))
def test_steps_of_some_parameters_match_ram_and_leave_the_others(tmp_path_factory, sizes, depth, moments, picks,
                                                                  ahead, read_between, wait, seed):
    """Buckets arrive one at a time: stepping a subset (whose segments it may share with neighbours) updates
    exactly that subset, as adamw_steps over it would, and leaves every other value bit for bit; reading the
    next subset ahead (right, wrong, or dropped by a read between), or leaving writes in flight, changes no bit."""
    params = _model(sizes, seed % 1000)
    names = list(params)
    ref = _reference(params, moments)
    chosen_of = [[n for i, n in enumerate(names) if pick >> i & 1] or names[-1:] for pick in picks]
    with ts_adamw.DiskState(params, tmp_path_factory.mktemp("subset"), moment_dtype=moments, depth=depth,
                            segment_values=2048) as state:
        for step, chosen in enumerate(chosen_of, start=1):
            at = [names.index(n) for n in chosen]
            gen = torch.Generator().manual_seed(seed % 991 + step)
            grads = [torch.randn(params[n].shape, generator=gen) for n in chosen]
            outs = [torch.empty(params[n].shape, dtype=torch.bfloat16) for n in chosen]
            ref_outs = [torch.empty(params[n].numel(), dtype=torch.bfloat16) for n in chosen]
            following = chosen_of[step % len(chosen_of)]
            prefetch = {"none": None, "next": following, "wrong": [n for n in names if n not in following] or None}
            state.step(grads, step=step, params_out=outs, seed=seed, names=chosen, prefetch=prefetch[ahead],
                       wait_writes=wait, **KW)
            if read_between:
                state.read_state(names[0])
            ts_adamw.adamw_steps([ref[0][i] for i in at], [g.reshape(-1) for g in grads], [ref[1][i] for i in at],
                                 [ref[2][i] for i in at], step=step, params_out=ref_outs, seed=seed, keys=at, **KW)
            assert all(torch.equal(o.reshape(-1), r) for o, r in zip(outs, ref_outs))
        assert _state_equals(state, ref)


def test_a_step_reads_the_next_parameters_ahead_and_the_next_step_uses_them(tmp_path):
    params = _model([4096, 4096, 4096, 4096], 5)  # one segment each
    with ts_adamw.DiskState(params, tmp_path, segment_values=4096) as state:
        grads = {n: torch.randn(4096) for n in params}
        state.step([grads["p3"]], names=["p3"], prefetch=["p2", "p1"], step=1, **KW)
        assert sorted(state._ready) == [2]  # depth 3: one set reads ahead, two stay the step's
        state.step([grads["p2"]], names=["p2"], prefetch=["p1"], step=1, **KW)
        assert sorted(state._ready) == [1]
        state.step([grads["p0"]], names=["p0"], step=1, **KW)  # not what was read ahead: dropped
        assert state._ready == {}
        with pytest.raises(ValueError, match="unknown parameters"):
            state.step([grads["p0"]], names=["p0"], prefetch=["zz"], step=2, **KW)


def test_a_segment_a_step_writes_is_never_read_ahead(tmp_path):
    """Two parameters in one segment: reading the second ahead while the first's update is written back
    would hand the next step the segment as it was, and its write would undo the first update."""
    params = _model([1000, 1000], 6)
    ref = _reference(params, torch.float32)
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048) as state:
        for step in range(1, 4):
            for i, name in enumerate(params):
                g = torch.full((1000,), 0.1 * step + i)
                state.step([g], names=[name], prefetch=[n for n in params if n != name], step=step, **KW)
                ts_adamw.adamw_steps([ref[0][i]], [g], [ref[1][i]], [ref[2][i]], step=step, keys=[i], **KW)
        assert _state_equals(state, ref)


@pytest.mark.parametrize("depth", [3, 5, 8])
def test_no_segment_is_read_while_its_write_is_in_flight(tmp_path, depth):
    """Writes left in flight (wait_writes=False) land before their segment is read again, by a step or by a
    read ahead: checked at every read submitted (the disk might serve an overlapping read first)."""
    params = _model([3000, 3000, 3000, 3000], 8)  # two parameters per 4096-value segment
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048, depth=depth) as state:
        submit, seen = state._submit, []

        def checked(op, segment, staging, fields=(0, 1, 2)):
            if op == "read":
                seen.append(segment)
                assert not any(st.writes and st.written == segment for st in state._sets), segment
            return submit(op, segment, staging, fields)

        state._submit = checked
        names = list(params)
        for step in range(1, 4):
            for i, name in enumerate(reversed(names)):  # backward order, the next one read ahead
                ahead = [names[-2 - i]] if i + 1 < len(names) else [names[-1]]
                state.step([torch.randn(3000)], names=[name], prefetch=ahead, step=step, wait_writes=False, **KW)
        assert len(seen) > 8


def test_a_write_left_in_flight_that_fails_makes_the_state_unusable_at_the_next_call(tmp_path):
    params = _model([4096, 4096], 7)
    with ts_adamw.DiskState(params, tmp_path, segment_values=4096) as state:
        grads = [torch.randn(4096)]
        state.step(grads, names=["p0"], step=1, wait_writes=False, **KW)
        state.flush()  # nothing pending fails
        state._file._fail_next("eio", "write")
        state.step(grads, names=["p1"], step=1, wait_writes=False, **KW)  # returns: its write is in flight
        with pytest.raises(ts_adamw.DiskIOError, match="write"):
            state.flush()
        assert state.failed is not None
        with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
            state.step(grads, names=["p0"], step=2, **KW)


def test_bad_names_are_refused_before_any_io(tmp_path):
    params = _model([3000, 20], 4)
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048) as state:
        g = torch.randn(20)
        for names, message in ((["zz"], "unknown parameters"), (["p1", "p1"], "twice"), ([], "non-empty"),
                               ("p1", "non-empty")):
            with pytest.raises(ValueError, match=message):
                state.step([g], step=1, names=names, **KW)
        with pytest.raises(ValueError, match="not stepped"):
            state.step({"p0": torch.randn(3000), "p1": g}, step=1, names=["p1"], **KW)
        assert state.failed is None


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_one_large_parameter_matches_adamw_step(tmp_path, moments):
    n = 300_001  # many segments of one tensor: bf16 rounding continues across segment borders
    p = torch.randn(n)
    ref_p, ref_m, ref_v = p.clone(), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    with ts_adamw.DiskState({"w": p}, tmp_path, moment_dtype=moments, segment_values=16384) as state:
        for step in range(1, 5):
            g = torch.randn(n)
            out, ref_out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
            ts_adamw.adamw_step_on_disk(state, [g], step=step, seed=9, params_out=[out], **KW)
            ts_adamw.adamw_step(ref_p, g, ref_m, ref_v, step=step, seed=9, param_out=ref_out, **KW)
            assert torch.equal(out, ref_out)
        got = state.read_state("w")
        assert torch.equal(got["param"], ref_p) and torch.equal(got["exp_avg"], ref_m)
        assert torch.equal(got["exp_avg_sq"], ref_v)


def test_caller_staging_is_used_as_given(tmp_path):
    params = _model([5000, 70, 12000], 1)
    set_bytes = ts_adamw.DiskState.staging_bytes(4096)
    staging = [ts_adamw.aligned_empty(set_bytes + BLOCK) for _ in range(2)]
    ptrs = [t.data_ptr() for t in staging]
    ref = _reference(params, torch.float32)
    with ts_adamw.DiskState(params, tmp_path, segment_values=4096, staging=staging) as state:
        assert state.depth == 2 and state.nbytes % BLOCK == 0
        grads = [torch.randn(p.shape) for p in params.values()]
        state.step(grads, step=1, **KW)
        ts_adamw.adamw_steps(ref[0], [g.reshape(-1) for g in grads], ref[1], ref[2], step=1, **KW)
        assert _state_equals(state, ref) and [t.data_ptr() for t in staging] == ptrs
    with pytest.raises(ValueError, match="4096-byte boundary"):
        ts_adamw.DiskState(params, tmp_path, segment_values=4096, staging=[staging[0][1:]])
    with pytest.raises(ValueError, match="staging\\[0\\] and staging\\[1\\] share memory"):
        ts_adamw.DiskState(params, tmp_path, segment_values=4096, staging=[staging[0], staging[0]])


def test_write_state_and_read_state_round_trip_without_touching_neighbours(tmp_path):
    params = _model([3, 1500, 4097, 10], 2)  # starts not on block boundaries
    with ts_adamw.DiskState(params, tmp_path, moment_dtype=torch.bfloat16, segment_values=2048) as state:
        before = {n: state.read_state(n) for n in state.names}
        assert torch.equal(before["p1"]["param"], params["p1"]) and not before["p2"]["exp_avg"].any()
        new = {"param": torch.randn(4097), "exp_avg": torch.randn(4097), "exp_avg_sq": torch.rand(4097)}
        state.write_state("p2", **new)
        got = state.read_state("p2")
        assert torch.equal(got["param"], new["param"])
        assert torch.equal(got["exp_avg"], new["exp_avg"].bfloat16())
        for n in ("p0", "p1", "p3"):
            assert all(torch.equal(state.read_state(n)[k], before[n][k]) for k in before[n])
        with pytest.raises(ValueError, match="4097 values"):
            state.write_state("p2", param=torch.zeros(4096))
        with pytest.raises(KeyError):
            state.read_state("nope")


def _bad_step_cases(params):
    grads = {n: torch.randn(p.shape) for n, p in params.items()}
    return {
        "grad dtype": ({**grads, "p0": grads["p0"].double()}, {}, "float64"),
        "grad numel": ({**grads, "p1": torch.randn(3)}, {}, "has 3 values"),
        "missing grad": ({"p0": grads["p0"]}, {}, "missing"),
        "unknown grad": ({**grads, "zz": grads["p0"]}, {}, "unknown"),
        "strided grad": ({**grads, "p0": torch.randn(2 * params["p0"].numel())[::2]}, {}, "contiguous"),
        "out dtype": (grads, {"params_out": {n: torch.empty(p.shape, dtype=torch.int32) for n, p in params.items()}},
                      "int32"),
        "out aliases grad": (grads, {"params_out": grads}, "share memory"),
        "lr": (grads, {"lr": -1.0}, "lr"),
        "step": (grads, {"step": 0}, "step"),
        "threads": (grads, {"threads": 0}, "threads"),
    }


@pytest.mark.parametrize("case", sorted(_bad_step_cases(_model([10, 20], 0))))
def test_bad_step_input_raises_before_any_io(tmp_path, case):
    params = _model([3000, 20], 3)
    with ts_adamw.DiskState(params, tmp_path, segment_values=2048) as state:
        before = {n: state.read_state(n) for n in state.names}
        grads, extra, message = _bad_step_cases(params)[case]
        with pytest.raises(ValueError, match=message):
            state.step(grads, step=extra.pop("step", 1), **{**KW, **extra})
        assert state.failed is None
        assert all(torch.equal(state.read_state(n)[k], before[n][k]) for n in before for k in before[n])


def test_bad_construction_raises(tmp_path):
    params = _model([10], 0)
    for kwargs, message in (({"segment_values": 3000}, "multiple of 2048"), ({"moment_dtype": torch.float16},
                            "moment_dtype"), ({"keys": [1, 2]}, "keys"), ({"depth": 0}, "depth")):
        with pytest.raises(ValueError, match=message):
            ts_adamw.DiskState(params, tmp_path, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        ts_adamw.DiskState({}, tmp_path)
    with pytest.raises(ValueError, match="floating"):
        ts_adamw.DiskState({"i": torch.arange(4)}, tmp_path)
    with pytest.raises(ts_adamw.DiskIOError, match="does not exist"):
        ts_adamw.DiskState(params, tmp_path / "missing")
    assert entries(tmp_path) == []


def _failing_step(tmp_path, kind, op, after):
    """A 4-segment state whose step meets `kind` on the `after`-th later chunk of `op`: (state, outs before, outs
    after the failed step, outs of a good step, the error)."""
    params = _model([4 * 2048], 4)
    state = ts_adamw.DiskState(params, tmp_path, segment_values=2048, depth=3)
    grads = {"p0": torch.randn(4 * 2048)}
    outs = {"p0": torch.full((4 * 2048,), 7.0, dtype=torch.bfloat16)}
    expect = {"p0": torch.empty(4 * 2048, dtype=torch.bfloat16)}
    ref = _reference(params, torch.float32)
    ts_adamw.adamw_steps(ref[0], [grads["p0"]], ref[1], ref[2], step=1, params_out=[expect["p0"]], **KW)
    state._file._fail_next(kind, op, after)
    with pytest.raises(ts_adamw.DiskIOError) as info:
        state.step(grads, step=1, params_out=outs, **KW)
    assert state.path in str(info.value)
    return state, params, grads, outs["p0"], expect["p0"], info.value


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_failed_first_read_changes_nothing_and_the_state_stays_usable(tmp_path, kind):
    state, params, grads, out, expect, _ = _failing_step(tmp_path, kind, "read", 0)
    assert state.failed is None
    assert bool((out == 7.0).all())  # params_out untouched
    assert torch.equal(state.read_state("p0")["param"], params["p0"])  # the file untouched
    state.step(grads, step=1, params_out={"p0": out}, **KW)  # the step, retried, is the step
    assert torch.equal(out, expect)
    state.close()
    assert entries(tmp_path) == []


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_later_failed_read_never_applies_unread_data_and_marks_the_state_unusable(tmp_path, kind):
    state, _, grads, out, expect, error = _failing_step(tmp_path, kind, "read", 3 * 2)  # segment 2's master
    segments = [slice(i * 2048, (i + 1) * 2048) for i in range(4)]
    assert torch.equal(out[segments[0]], expect[segments[0]]) and torch.equal(out[segments[1]], expect[segments[1]])
    assert bool((out[segments[2]] == 7.0).all()) and bool((out[segments[3]] == 7.0).all())
    assert state.failed is error
    with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
        state.step(grads, step=2, **KW)
    with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
        state.read_state("p0")
    state.close()
    assert entries(tmp_path) == []


def test_a_failed_write_keeps_the_in_memory_result_and_marks_the_state_unusable(tmp_path):
    state, _, _, out, expect, error = _failing_step(tmp_path, "eio", "write", 0)
    assert "write of" in str(error) and error.errno == errno.EIO
    assert torch.equal(out[:2048], expect[:2048])  # segment 0 was updated, its write failed
    assert state.failed is error
    with pytest.raises(ts_adamw.DiskIOError, match="unusable"):
        state.read_state("p0")
    state.close()
    with pytest.raises(ValueError, match="closed"):
        state.read_state("p0")


def test_steps_after_close_raise_and_the_directory_is_empty(tmp_path):
    state = ts_adamw.DiskState(_model([100], 5), tmp_path)
    assert state.direct in (True, False) and state.nbytes > 0
    state.close()
    state.close()
    assert state.closed and entries(tmp_path) == []
    with pytest.raises(ValueError, match="closed"):
        state.step([torch.zeros(100)], step=1, **KW)


def test_a_step_lets_other_python_threads_run(tmp_path):
    # The step releases the GIL while it waits for I/O and while it updates.
    import threading

    params = _model([400_000], 6)
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    with ts_adamw.DiskState(params, tmp_path, segment_values=8192) as state:
        worker = threading.Thread(target=tick)
        worker.start()
        try:
            start = time.perf_counter()
            for step in range(1, 4):
                state.step([torch.randn(400_000)], step=step, **KW)
            end = time.perf_counter()
        finally:
            stop.set()
            worker.join()
    assert sum(start <= t <= end for t in ticks) >= 3
    stats = state.stats  # the last step's clock: every wait attributed
    assert set(stats) == {"read_wait_s", "write_wait_s", "update_s", "step_s"}
    assert stats["update_s"] > 0 and stats["read_wait_s"] + stats["write_wait_s"] + stats["update_s"] > 0
    assert stats["read_wait_s"] + stats["write_wait_s"] + stats["update_s"] <= stats["step_s"]
