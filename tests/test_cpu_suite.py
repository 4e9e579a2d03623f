"""tools/bench/cpu_suite.py: every case writes records in _record's schema, its engines alternated round by round,
summaries that agree with the runs, and a figure below its bound marks the record as from a loaded machine."""

from __future__ import annotations

import glob
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools" / "bench"))
import _record
import cpu_suite

BENCH = pathlib.Path(cpu_suite.__file__).resolve().parent

ROUNDS = 2
EXPECTED = {"adamw": 2, "step": 1, "chunked-loss": 4, "pinned": 2}  # records per case in --quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Every case once, --quick --rounds 2, in one process (one torch import); the records by case."""
    out = tmp_path_factory.mktemp("cpu-suite")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(BENCH / "cpu_suite.py"), "--quick", "--rounds", str(ROUNDS),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"cpu_suite.py --quick --rounds {ROUNDS}: {elapsed:.1f} s\n{done.stdout}")
    records = {}
    for case in cpu_suite.CASES:
        paths = sorted(glob.glob(os.path.join(out, f"cpu-{case}-*.json")))
        records[case] = [(p, _record.load(p)) for p in paths]
    return records


def assert_alternated(data: dict) -> None:
    """Round r ran every engine once, in one fixed order, before round r + 1 began: A B C A B C ..."""
    engines = list(data["engines"])
    ran = sorted((run["order"], run["round"], engine) for engine in engines for run in data["engines"][engine]["runs"])
    assert [order for order, _, _ in ran] == list(range(len(engines) * data["rounds"]))
    for order, round_, engine in ran:
        assert round_ == order // len(engines), f"{engine} ran as run {order} in round {round_}"
        assert engine == ran[order % len(engines)][2], f"round {round_} changed the engines' order"


def assert_summaries_match_runs(data: dict) -> None:
    for engine, entry in data["engines"].items():
        values = [run[data["figure"]] for run in entry["runs"]]
        s = entry["summary"]
        assert s["runs"] == len(values) == data["rounds"] and s["failed"] == 0, engine
        assert s["min"] == min(values) and s["max"] == max(values), engine
        assert math.isclose(s["median"], statistics.median(values)), engine
        assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"], engine


@pytest.mark.parametrize("case", cpu_suite.CASES)
def test_case_writes_alternated_records(quick_run, case):
    records = quick_run[case]
    assert len(records) == EXPECTED[case], [p for p, _ in records]
    for path, data in records:
        assert data is not None, f"{path} is not a {_record.SCHEMA} record"
        assert data["kind"] == {"chunked-loss": "cpu-loss"}.get(case, f"cpu-{case}") and data["name"]
        assert data["rounds"] == ROUNDS and data["quick"] is True
        assert data["machine_note"] == cpu_suite.MACHINE_NOTE
        assert isinstance(data["loaded_machine"], bool) and data["loaded_machine"] == bool(data["loaded_reasons"])
        assert data["bounds_note"] and data["figure_note"]
        assert data["machine_use"]["own_share"] >= 0 and data["machine_use"]["window_s"] > 0
        assert {"commit", "cpu", "cpus", "torch", "command", "started"} <= set(data["provenance"])
        assert len(data["engines"]) >= 2
        for engine, bound in data["bounds"].items():
            assert engine in data["engines"] and bound["value"] > 0 and isinstance(bound["terms"], dict)
        assert_alternated(data)
        assert_summaries_match_runs(data)


def test_chunked_loss_matches_dense_in_less_memory(quick_run):
    for path, data in quick_run["chunked-loss"]:
        chunked, dense = (data["engines"][e]["runs"] for e in ("chunked (trainstream)", "dense (F.cross_entropy)"))
        assert all(math.isclose(c["loss"], d["loss"], rel_tol=1e-5) for c, d in zip(chunked, dense)), path
        if data["figure"] == "peak_mib":  # measured, above the gradients' bytes, and the logits not kept whole
            assert not any("below its bound" in r for r in data["loaded_reasons"]), data["loaded_reasons"]
            assert all(r["peak_bytes"] >= data["tokens"] * data["vocab"] * 4 for r in dense), path
            assert max(r["peak_mib"] for r in chunked) < min(r["peak_mib"] for r in dense), path


def test_wrapped_step_trains_like_the_plain_one(quick_run):
    ((_, data),) = quick_run["step"]
    wrapped, plain = (data["engines"][e]["runs"] for e in ("trainstream.wrap", "plain torch.optim.AdamW"))
    for w, p in zip(wrapped, plain):
        assert len(w["steps_s"]) == len(p["steps_s"]) == data["steps_per_run"]
        assert math.isclose(w["final_loss"], p["final_loss"], rel_tol=1e-3)


# ---- the bound check, directly ----------------------------------------------------------------------------------

def _runs(*values):
    return [{"seconds": v, "round": i} for i, v in enumerate(values)]


def test_a_figure_below_its_bound_is_flagged():
    bounds = {"a": {"value": 1.0, "terms": {}}}
    reasons = cpu_suite.bound_check({"a": _runs(1.2, 0.9, 1.1), "b": _runs(0.1)}, "seconds", bounds)
    assert len(reasons) == 1 and "a, round 1" in reasons[0] and "below its bound" in reasons[0]
    assert cpu_suite.bound_check({"a": _runs(1.0, 1.5)}, "seconds", bounds) == []  # at the bound: fine
    assert cpu_suite.bound_check({"b": _runs(0.1)}, "seconds", bounds) == []  # no bound, nothing to break


def test_bandwidth_probes_apart_are_flagged():
    assert cpu_suite.bound_check({}, "seconds", {}, probes=[40.0, 49.0]) == []
    (reason,) = cpu_suite.bound_check({}, "seconds", {}, probes=[40.0, 52.0])
    assert "differ by 30%" in reason
    assert len(cpu_suite.bound_check({}, "seconds", {}, probes=[52.0, 40.0])) == 1  # either direction


def test_others_taking_the_machine_is_flagged():
    use = {"window_s": 10.0, "cpus": 2, "own_share": 0.9, "others_share": 0.2, "steal_share": 0.0}
    assert cpu_suite.busy_reasons(use) == []
    (reason,) = cpu_suite.busy_reasons({**use, "steal_share": 0.1})  # others and steal, together
    assert "took 30% of the machine's 2 CPUs" in reason
    assert cpu_suite.busy_reasons({"window_s": 1.0, "cpus": 2, "own_share": 0.5}) == []  # no /proc/stat


def test_others_share_leaves_out_our_own_cpu_time(monkeypatch):
    before = {"wall": 0.0, "own": 0.0, "busy": 0.0, "steal": 0.0}
    monkeypatch.setattr(cpu_suite, "cpu_snapshot", lambda: {"wall": 10.0, "own": 12.0, "busy": 15.0, "steal": 1.0})
    use = cpu_suite.others_since(before)
    cpus = os.cpu_count()
    assert math.isclose(use["own_share"], 12 / (10 * cpus)) and math.isclose(use["others_share"], 3 / (10 * cpus))
    assert math.isclose(use["steal_share"], 1 / (10 * cpus))


def test_adamw_record_says_loaded_when_a_run_beats_the_bandwidth(monkeypatch, tmp_path):
    """The wiring: a bandwidth too low for the measured times gives bounds above them, so the record is flagged
    and no engine is reported above 100 % of the bandwidth unmarked."""
    probes = iter([{"best": 1e-3}, {"best": 1e-3}, {"best": 1e-3}])
    monkeypatch.setattr(cpu_suite.adamw_bench, "host_bandwidth", lambda *a: next(probes))
    monkeypatch.setattr(cpu_suite, "last_level_cache_bytes", lambda: None)
    monkeypatch.setattr(cpu_suite, "busy_reasons", lambda use: [])  # only the bounds' reasons counted here
    fake = {"variant": "fake", "seconds": 0.01}
    monkeypatch.setattr(cpu_suite.adamw_bench, "bench_ts_host", lambda *a, **k: dict(fake))
    monkeypatch.setattr(cpu_suite.adamw_bench, "bench_torch", lambda *a, **k: dict(fake))
    args = cpu_suite.argparse.Namespace(quick=True, rounds=3, threads=1, machine_note=cpu_suite.MACHINE_NOTE)
    records = cpu_suite.case_adamw(args)
    assert [label for label, _ in records] == ["64k", "1M"]
    for _, data in records:
        assert data["loaded_machine"] and len(data["loaded_reasons"]) == 3 * len(cpu_suite.ADAMW_ENGINES)
        assert set(data["bounds"]) == set(cpu_suite.ADAMW_ENGINES)
        assert_alternated(data)
