"""scripts/bench_quality.py: the pieces that decide what a 2-hour run measures and keeps.

The whole script runs end to end in CI (`.ci/run`, `--smoke`); these tests pin the bookkeeping
that the smoke run cannot show: curve points, the compute column, and `--resume`."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from dipaco.config import Config, apply_overrides

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_quality.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_curve_rounds_are_powers_of_two_and_the_last(bench):
    assert bench.curve_rounds(1) == [1]
    assert bench.curve_rounds(4) == [1, 2, 4]
    assert bench.curve_rounds(6) == [1, 2, 4, 6]
    assert bench.curve_rounds(16) == [1, 2, 4, 8, 16]


def test_rows_cover_the_issue_and_names_are_unique(bench):
    names = [r.name for r in bench.rows(4, 16, True, num_layers=4)]
    assert len(names) == len(set(names))
    for expected in ("dense_1x", "dense_4x", "diloco_4", "moe_4", "dipaco_2x2_kmeans", "dipaco_2x2_product",
                     "dipaco_2x2_reroute", "dipaco_2x2_early_stop", "dense_deep_4x", "diloco_16",
                     "dipaco_4x4_kmeans", "dipaco_4x4_product", "dipaco_4x4_early_stop"):
        assert expected in names
    deep = next(r for r in bench.rows(4, 16, False, num_layers=3) if r.name == "dense_deep_4x")
    assert deep.model == ["model.num_layers=6"]
    assert all(not r.name.endswith("_16") and "4x4" not in r.name for r in bench.rows(4, 16, False, num_layers=4))


def _row(name: str, paths: int, steps: int, params: int, ppl: float) -> dict:
    return {"name": name, "paths": paths, "steps_per_path": steps, "params_per_path": params,
            "params_total": params, "tokens_seen": 1000, "wall_time_s": 60.0, "ppl": ppl}


def test_compute_column_scales_with_paths_steps_and_path_size(bench):
    table = bench.markdown_table([
        _row("dense_1x", 1, 100, 1000, 10.0),
        _row("diloco_4", 4, 100, 1000, 9.0),
        _row("dense_deep_4x", 1, 400, 1500, 8.0),
    ], dense_steps=100)
    compute = {line.split("|")[1].strip(): line.split("|")[5].strip() for line in table.splitlines()[2:]}
    assert compute == {"dense_1x": "1x", "diloco_4": "4x", "dense_deep_4x": "6x"}


def test_resume_keeps_rows_of_the_same_base_config(bench, tmp_path):
    base = Config()
    results = tmp_path / "results.json"
    assert bench.finished_rows(results, base) == {}
    init = {"overall": {"ppl": 50.0}}
    bench.write_results(results, base, init, [_row("dense_1x", 1, 100, 1000, 10.0)])
    assert list(bench.finished_rows(results, base)) == ["dense_1x"]


def test_resume_refuses_another_base_config_naming_the_key(bench, tmp_path):
    results = tmp_path / "results.json"
    bench.write_results(results, Config(), {"overall": {"ppl": 50.0}}, [_row("dense_1x", 1, 100, 1000, 10.0)])
    with pytest.raises(SystemExit, match="train.rounds"):
        bench.finished_rows(results, apply_overrides(Config(), ["train.rounds=9"]))
    assert json.loads(results.read_text())["rows"][0]["name"] == "dense_1x"  # nothing lost


def test_targets_are_checked_on_both_grids(bench):
    rows = [_row(name, 4, 100, 1000, ppl) for name, ppl in [
        ("dense_1x", 200.0), ("dipaco_2x2_kmeans", 180.0), ("dipaco_2x2_reroute", 181.0),
        ("diloco_16", 160.0), ("dipaco_4x4_kmeans", 150.0), ("dipaco_4x4_product", 149.0)]]
    lines = bench.targets(rows)
    assert "- DiPaCo 2x2 beats dense 1x by >= 5%: met (+10.0%)" in lines
    assert any(line.startswith("- DiPaCo 4x4 beats DiLoCo-16: met") for line in lines)
    assert any("(2x2): MISSED" in line for line in lines)
    assert any("(4x4): met (dipaco_4x4_product 149.00" in line for line in lines)
