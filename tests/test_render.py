"""tools/bench/render.py: the docs' performance tables are generated from the records, and CI fails when the
committed tables differ from them."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))
import _record  # noqa: E402
import render  # noqa: E402


def _record_file(directory: pathlib.Path, name: str, started: str, medians: dict, bound: float | None = None,
                 below: list | None = None) -> None:
    runs = {engine: [{"median_s": m, "outcome": "ok" if m is not None else "out of memory", "peak_gb": 20.0}
                     for m in values] for engine, values in medians.items()}
    data = _record.record("compare", name, runs, "median_s", rounds=max(len(v) for v in medians.values()),
                          bounds={e: {"value": bound, "terms": {"compute_fwd_bwd": 0.2, "compute_from": "stock-lora",
                                                              "dequantize": None, "link": bound, "host_adamw": 0.01}}
                                  for e in medians if e.startswith("trainstream")} if bound else {},
                          gpu=False, floors=["stock-lora-uncapped"], below_bound=below or [],
                          settings={"scenario": {"size": "14b", "lora": True, "batch": 1, "seq": 512,
                                                "vram_gb": 24.0, "steps": 10}})
    data["provenance"]["started"] = started
    (directory / f"compare-{name}-{started[:10]}.json").write_text(json.dumps(data))


def test_the_committed_tables_are_the_rendered_records():
    assert render.differing() == [], "run: python tools/bench/render.py --write"


def test_a_comparison_shows_every_runs_median_spread_and_count_beside_the_bound(tmp_path):
    _record_file(tmp_path, "lora14b", "2026-12-05T10:00:00+00:00",
                 {"trainstream-lora": [0.30, 0.34, 0.32], "bnb-qlora": [0.50, None, 0.52],
                  "stock-lora-uncapped": [0.25, 0.26, 0.27]}, bound=0.21)
    text = render.sections(str(tmp_path))["compare"]
    assert "| trainstream-lora | 0.320 s | 0.300 s – 0.340 s | 3/3 | 20.0 GB | 0.210 s |" in text
    assert "| bnb-qlora | 0.510 s | 0.500 s – 0.520 s | 2/3 |" in text and "out of memory" in text
    assert "stock-lora-uncapped (floor: no VRAM cap)" in text
    assert "3 rounds alternated" in text
    assert "14b shape, LoRA r=16 on every linear layer of the blocks, 1 x 512 tokens, VRAM capped at 24 GB" in text


def test_only_the_newest_record_of_a_scenario_is_the_table_the_rest_is_history(tmp_path):
    _record_file(tmp_path, "lora14b", "2026-12-01T10:00:00+00:00", {"trainstream-lora": [0.9, 0.9]})
    _record_file(tmp_path, "lora14b", "2026-12-05T10:00:00+00:00", {"trainstream-lora": [0.4, 0.4]})
    out = render.sections(str(tmp_path))
    assert "0.400 s" in out["compare"] and "0.900 s" not in out["compare"]
    assert out["history"].count("| compare | lora14b |") == 2


def test_a_run_below_its_bound_is_reported_as_a_wrong_bound(tmp_path):
    _record_file(tmp_path, "full1.5b", "2026-12-05T10:00:00+00:00", {"trainstream-auto": [0.18, 0.30]}, bound=0.2,
                 below=[{"engine": "trainstream-auto", "round": 0, "median_s": 0.18, "bound_s": 0.2}])
    assert "**bound wrong**: trainstream-auto round 0 ran 0.180 s" in render.sections(str(tmp_path))["compare"]


def test_check_fails_when_a_generated_table_was_edited_by_hand(tmp_path):
    for target in set(render.TARGETS.values()):
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / target, tmp_path / target)
    results = tmp_path / "results"
    results.mkdir()
    _record_file(results, "lora14b", "2026-12-05T10:00:00+00:00", {"trainstream-lora": [0.30, 0.34]})
    assert set(render.differing(str(tmp_path), str(results), write=True)) == set(render.TARGETS.values())
    assert render.differing(str(tmp_path), str(results)) == []
    page = tmp_path / "docs" / "benchmarks.md"
    page.write_text(page.read_text().replace("0.320 s", "0.290 s"))
    assert render.differing(str(tmp_path), str(results)) == ["docs/benchmarks.md"]


def test_a_page_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="markers of section 'cpu'"):
        render.replace("# no markers here\n", "cpu", "body")
