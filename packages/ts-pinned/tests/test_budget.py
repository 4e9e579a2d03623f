"""page_lock_budget: the probe the planner uses."""

from __future__ import annotations

import math
import resource

import pytest
import ts_pinned


def test_fields_are_consistent():
    b = ts_pinned.page_lock_budget()
    assert isinstance(b, ts_pinned.PageLockBudget)
    assert 0 < b.mem_available <= b.mem_total
    assert 0 < b.budget <= b.mem_available
    assert b.budget <= int(b.mem_available * 0.8) + 1
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert b.memlock_limit == (None if soft == resource.RLIM_INFINITY else soft)
    if b.memlock_limit is not None and b.memlock_limit >= 1 << 30:
        assert b.budget <= b.memlock_limit


@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
def test_fraction_scales_the_budget(fraction):
    b = ts_pinned.page_lock_budget(fraction)
    assert b.budget <= b.mem_available
    if b.memlock_limit is None or b.memlock_limit < 1 << 30:
        assert b.budget == int(b.mem_available * fraction)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.01, 2, math.nan, math.inf])
def test_fraction_validation(fraction):
    with pytest.raises(ValueError, match="fraction"):
        ts_pinned.page_lock_budget(fraction)


def test_budget_is_frozen():
    b = ts_pinned.page_lock_budget()
    with pytest.raises(AttributeError):
        b.budget = 1


def test_host_limits_message():
    from ts_pinned import _core

    text = _core.host_limits()
    assert "memlock limit" in text and "available" in text


# ---- cgroup memory limits, on fake /proc and /sys/fs/cgroup trees -----------------------------------------

GiB, MiB = 1 << 30, 1 << 20
MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1000000 kB\nMemAvailable:   12582912 kB\n"  # 16 / 12 GiB


def fake_tree(root, cgroup_lines: str, files: dict[str, str], controllers: str | None = None):
    """<root>/proc/{meminfo,self/cgroup} and files under <root>/sys/fs/cgroup."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(MEMINFO)
    (root / "proc" / "self" / "cgroup").write_text(cgroup_lines)
    fs = root / "sys" / "fs" / "cgroup"
    fs.mkdir(parents=True)
    if controllers is not None:
        (fs / "cgroup.controllers").write_text(controllers)
    for path, text in files.items():
        (fs / path).parent.mkdir(parents=True, exist_ok=True)
        (fs / path).write_text(text)
    return str(root)


def v2_tree(root, limit: str, current: int, inactive: int = 0):
    return fake_tree(root, "0::/kubepods/pod7\n", {
        "kubepods/pod7/memory.max": f"{limit}\n",
        "kubepods/pod7/memory.current": f"{current}\n",
        "kubepods/pod7/memory.stat": f"anon {current - inactive}\nfile {inactive}\ninactive_file {inactive}\n",
        "kubepods/memory.max": "max\n",
    }, controllers="cpuset cpu io memory pids\n")


def host_memory(root):
    from ts_pinned import _core

    return _core.host_memory(root)


def test_v2_limit_bounds_total_and_available(tmp_path):
    info = host_memory(v2_tree(tmp_path, str(2 * GiB), current=768 * MiB, inactive=256 * MiB))
    assert info["meminfo_total"] == 16 * GiB and info["meminfo_available"] == 12 * GiB
    assert info["source"] == "cgroup v2" and info["cgroup_version"] == 2
    assert info["total"] == 2 * GiB and info["cgroup_limit"] == 2 * GiB
    # Inactive page cache is dropped before the kernel kills: room = limit - (usage - inactive_file).
    assert info["available"] == 2 * GiB - (768 - 256) * MiB
    assert info["cgroup_dir"].endswith("sys/fs/cgroup/kubepods/pod7")


def test_v2_max_means_no_limit(tmp_path):
    info = host_memory(v2_tree(tmp_path, "max", current=768 * MiB))
    assert info["source"] == "meminfo" and info["cgroup_limit"] is None
    assert info["total"] == 16 * GiB and info["available"] == 12 * GiB


def test_v2_an_ancestor_limit_applies(tmp_path):
    root = v2_tree(tmp_path, str(8 * GiB), current=GiB)
    fs = tmp_path / "sys" / "fs" / "cgroup" / "kubepods"
    (fs / "memory.max").write_text(f"{3 * GiB}\n")
    (fs / "memory.current").write_text(f"{2 * GiB}\n")  # siblings use 1 GiB more
    info = host_memory(root)
    assert info["cgroup_limit"] == 3 * GiB and info["available"] == GiB
    assert info["cgroup_dir"].endswith("cgroup/kubepods")


def test_a_limit_above_meminfo_leaves_meminfo_in_charge(tmp_path):
    info = host_memory(v2_tree(tmp_path, str(64 * GiB), current=GiB))
    assert info["source"] == "meminfo" and info["available"] == 12 * GiB
    assert info["cgroup_limit"] == 64 * GiB and info["total"] == 16 * GiB


def test_v1_limit_and_usage(tmp_path):
    root = fake_tree(tmp_path, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{4 * GiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
        "memory/docker/abc/memory.stat": f"cache 5\ninactive_file 7\ntotal_inactive_file {100 * MiB}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "unlimited"
        "unified/cgroup.controllers": "hugetlb\n",  # a hybrid host: v2 without the memory controller
    })
    info = host_memory(root)
    assert info["source"] == "cgroup v1" and info["cgroup_version"] == 1
    assert info["total"] == 4 * GiB and info["available"] == 4 * GiB - (GiB - 100 * MiB)
    assert info["cgroup_usage"] == GiB and info["cgroup_reclaimable"] == 100 * MiB


def test_v1_inside_a_container_reads_the_mount_root(tmp_path):
    # /proc/self/cgroup shows the host's path, but the container mounts its own cgroup at the root.
    root = fake_tree(tmp_path, "9:memory:/docker/abc\n", {
        "memory/memory.limit_in_bytes": f"{GiB}\n", "memory/memory.usage_in_bytes": f"{512 * MiB}\n"})
    info = host_memory(root)
    assert info["source"] == "cgroup v1" and info["available"] == 512 * MiB and info["total"] == GiB


def test_v1_unlimited_and_no_cgroup_at_all(tmp_path):
    root = fake_tree(tmp_path / "a", "4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                                       "memory/memory.usage_in_bytes": "1000\n"})
    assert host_memory(root)["source"] == "meminfo" and host_memory(root)["available"] == 12 * GiB
    bare = fake_tree(tmp_path / "b", "", {})
    assert host_memory(bare)["source"] == "meminfo" and host_memory(bare)["cgroup_limit"] is None


def test_usage_above_the_limit_leaves_no_room(tmp_path):
    info = host_memory(v2_tree(tmp_path, str(GiB), current=GiB + 4096))
    assert info["available"] == 0 and info["source"] == "cgroup v2"


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_page_lock_budget_honours_the_cgroup_limit(tmp_path, monkeypatch, fraction):
    root = v2_tree(tmp_path, str(2 * GiB), current=GiB)
    monkeypatch.setenv("TS_CGROUP_ROOT", root)
    b = ts_pinned.page_lock_budget(fraction)
    assert b.memory_source == "cgroup v2" and b.cgroup_limit == 2 * GiB
    assert b.mem_total == 2 * GiB and b.mem_available == GiB
    if b.memlock_limit is None or b.memlock_limit < 1 << 30:
        assert b.budget == int(GiB * fraction)
    assert b.budget <= GiB


def test_real_host_memory_is_consistent():
    from ts_pinned import _core

    info = _core.host_memory()
    assert info["source"] in ("meminfo", "cgroup v1", "cgroup v2")
    assert 0 < info["available"] <= info["total"] <= info["meminfo_total"]
    assert info["available"] <= info["meminfo_available"]
    if info["cgroup_limit"] is not None:
        assert info["total"] <= info["cgroup_limit"]
    assert ts_pinned.page_lock_budget().memory_source == info["source"]


# ---- the page-lock rule (native/src/page_lock.cpp), shared with ts-planner's budget ------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(available=st.integers(0, 1 << 44), fraction=st.floats(0.01, 1.0), processes=st.integers(1, 256),
       memlock=st.one_of(st.none(), st.integers(0, 1 << 44)))
def test_page_lock_rule(available, fraction, processes, memlock):
    from ts_pinned import _core

    budget = _core.page_lock_budget_bytes(available, fraction, processes, memlock)
    share = available // processes
    assert budget <= share
    assert abs(budget - share * fraction) <= 1 + share * 1e-12 or (memlock is not None and memlock >= GiB)
    if memlock is not None and memlock >= GiB:
        assert budget <= memlock // processes  # a deliberately raised limit binds
        assert budget == min(int(share * fraction), memlock // processes) or abs(
            budget - min(share * fraction, memlock // processes)) <= 1
    # More RAM never page-locks less; more processes never give one of them more.
    assert _core.page_lock_budget_bytes(available + GiB, fraction, processes, memlock) >= budget
    assert _core.page_lock_budget_bytes(available, fraction, processes + 1, memlock) <= budget


def test_a_small_memlock_limit_is_not_a_plan_bound():
    from ts_pinned import _core

    assert _core.page_lock_budget_bytes(8 * GiB, 0.5, 1, 64 << 10) == 4 * GiB  # a distribution default
    assert _core.page_lock_budget_bytes(8 * GiB, 0.5, 1, 2 * GiB) == 2 * GiB  # raised on purpose
    assert _core.page_lock_budget_bytes(8 * GiB, 0.5, 2, 2 * GiB) == GiB  # each process its share


@pytest.mark.parametrize("bad", [dict(fraction=0.0), dict(fraction=1.5), dict(processes=0)])
def test_page_lock_rule_refuses_bad_arguments(bad):
    from ts_pinned import _core

    with pytest.raises(ValueError):
        _core.page_lock_budget_bytes(GiB, bad.get("fraction", 0.8), bad.get("processes", 1), None)


def test_local_processes_split_the_budget():
    one, four = ts_pinned.page_lock_budget(), ts_pinned.page_lock_budget(processes=4)
    assert four.budget <= four.mem_available // 4 and one.budget <= one.mem_available
    with pytest.raises(ValueError, match="processes"):
        ts_pinned.page_lock_budget(processes=0)
