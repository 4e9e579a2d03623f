"""local_process_count(): the launcher's count of processes sharing this machine."""

import pytest
import ts_planner


@pytest.mark.parametrize("env, expected", [({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4),
                                           ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
                                           ({"SLURM_NTASKS_PER_NODE": "3,1"}, 3),
                                           ({"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}, 2),
                                           ({"LOCAL_WORLD_SIZE": " ", "SLURM_NTASKS_PER_NODE": "8"}, 8)])
def test_count_from_the_environment(monkeypatch, env, expected):
    for name in ts_planner._local.LOCAL_PROCESS_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ts_planner.local_process_count() == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_count_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE={value!r}"):
        ts_planner.local_process_count()
