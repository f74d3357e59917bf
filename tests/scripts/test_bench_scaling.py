"""scripts/bench_scaling.py: what the path-count sweep runs and how it judges its rows.

The whole script runs end to end in CI (`.ci/run`, `--smoke`); these tests pin what the smoke run cannot
show: the sweep's rows and settings, the tokens-per-parameter rule of its path, and the targets' arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dipaco.run import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_scaling")


def _row(name: str, ppl: float, paths: int = 4) -> dict:
    return {"name": name, "ppl": ppl, "paths": paths, "steps_per_path": 10, "params_per_path": 1000,
            "params_total": 1000, "wall_time_s": 1.0}


def test_every_size_has_every_family_at_equal_compute(bench):
    rows = {r.name: r for r in bench.scaling_rows([1, 4, 16, 64], seeds=2)}
    assert len(rows) == len(bench.scaling_rows([1, 4, 16, 64], seeds=2))  # unique names
    assert rows["dense_1x"].preset == "dense"
    for p, grid in ((4, "grid:2x2"), (16, "grid:4x4"), (64, "grid:8x8")):
        assert rows[f"dipaco_{p}"].preset == grid
        assert rows[f"diloco_{p}"].preset == f"diloco:{p}" and rows[f"diloco_{p}"].routing is None  # iid shards
        assert rows[f"moe_{p}"].preset == f"moe:{p}"
        assert rows[f"dense_{p}x"].rounds_factor == p  # one path, P times the steps
        # DiPaCo and flat MoE train on the same doc_topics shards, numbered so alike ones share modules
        assert rows[f"dipaco_{p}"].routing == rows[f"moe_{p}"].routing == f"doctopics{p}_similar"
        preset, method, settings = bench.bq.ROUTINGS[f"doctopics{p}_similar"]
        assert preset == grid and "route.featurizer=doc_topics" in settings and "route.arrange=similar" in settings


def test_seeds_repeat_the_four_and_sixteen_path_rows(bench):
    names = [r.name for r in bench.scaling_rows([1, 4, 16, 64], seeds=2)]
    for name in ("dipaco_4", "diloco_4", "dense_4x", "moe_4", "dipaco_16", "diloco_16", "dense_16x"):
        assert f"{name}@run.seed=1" in names
    assert "dense_1x@run.seed=1" not in names and "dipaco_64@run.seed=1" not in names
    smoke = [r.name for r in bench.scaling_rows([1, 4, 16], seeds=2, smoke=True)]
    assert "dipaco_4@run.seed=1" in smoke and "dipaco_16@run.seed=1" not in smoke
    seed_row = next(r for r in bench.scaling_rows([4], seeds=2) if r.name == "dipaco_4@run.seed=1")
    assert "run.seed=1" in seed_row.overrides and set(bench.DIPACO_OUTER) <= set(seed_row.overrides)


def test_the_sixteen_path_extras_and_outer_steps(bench):
    rows = {r.name: r for r in bench.scaling_rows([16], seeds=1)}
    assert "route.topk=2" in rows["dipaco_16_top2"].overrides
    assert rows["dipaco_16_early_stop"].early_stopping
    assert set(bench.DILOCO_OUTER) <= set(rows["diloco_16"].overrides)
    assert rows["diloco_16@outer.lr=1.0"].overrides[-1] == "outer.lr=1.0"  # the later override wins
    assert set(bench.PLAIN) <= set(rows["dense_16x"].overrides)
    assert not any(name.startswith("dipaco_4_") for name in rows)


def test_the_path_reads_twenty_tokens_per_non_embedding_parameter(bench):
    cfg = load_config(REPO / "configs/bench/quality.yaml", bench.FULL)
    nonemb = bench.non_embedding_params(cfg.model)
    d, ff, layers = cfg.model.hidden_size, cfg.model.intermediate_size, cfg.model.num_layers
    assert nonemb == layers * (4 * d * d + 3 * d * ff + 2 * d) + d  # attention, SwiGLU MLP, norms, final norm
    tokens = cfg.train.rounds * cfg.train.inner_steps * cfg.train.optim.batch_size * cfg.data.seq_len
    assert tokens / nonemb >= 20


def test_main_rows_give_one_curve_per_family_and_dense_1x_starts_them_all(bench):
    results = [_row("dense_1x", 100.0, 1), _row("dipaco_4", 80.0), _row("dipaco_4@run.seed=1", 82.0),
               _row("dipaco_16_top2", 10.0, 16), _row("diloco_16@outer.lr=1.0", 10.0, 16), _row("dense_4x", 85.0, 1)]
    main = bench.main_family_rows(results)
    assert main[("dipaco", 1)] == main[("moe", 1)] == {0: 100.0}
    assert main[("dipaco", 4)] == {0: 80.0, 1: 82.0}
    assert main[("dense", 4)] == {0: 85.0}
    assert ("dipaco", 16) not in main and ("diloco", 16) not in main  # extras and other steps are not the curve
    assert "81.00 ± 1.41 (2)" in bench.scaling_table(results, [1, 4, 16])


def test_targets_use_seed_means_and_the_best_diloco_step(bench):
    results = [
        _row("dense_1x", 100.0, 1),
        _row("dipaco_4", 80.0), _row("dipaco_4@run.seed=1", 82.0),
        _row("diloco_4", 82.0), _row("diloco_4@run.seed=1", 82.0),
        _row("dipaco_16", 60.0, 16), _row("dipaco_16@run.seed=1", 62.0, 16),
        _row("diloco_16", 70.0, 16), _row("diloco_16@run.seed=1", 70.0, 16),
        _row("diloco_16@outer.lr=1.0", 63.0, 16),  # the better DiLoCo step: 61 vs 63 is a 3.2% gain
        _row("dense_16x", 61.5, 1), _row("dense_16x@run.seed=1", 61.5, 1),
    ]
    for r in results:  # one model for 16x the steps: the compute of 16 paths
        r["steps_per_path"] *= 16 if r["name"].startswith("dense_16x") else 1
    lines = bench.targets(results, [1, 4, 16])
    assert lines[0].startswith("- DiPaCo's perplexity falls strictly as P grows: met")
    assert "diloco_16 by >= 3%: met (61.00 vs diloco_16@outer.lr=1.0 63.00: +3.2%)" in lines[1]
    assert "dense_16x by >= 3%: MISSED (61.00 vs dense_16x 61.50: +0.8%)" in lines[2]
    assert "widens from P=4 to P=16: met (P=4 +1.2%, P=16 +3.2%)" in lines[3]
    flat = [{**r, "ppl": 90.0} if r["name"].startswith("dipaco_16") else r for r in results]
    assert bench.targets(flat, [1, 4, 16])[0].startswith("- DiPaCo's perplexity falls strictly as P grows: MISSED")


def test_targets_say_not_run_without_the_rows(bench):
    lines = bench.targets([_row("dense_1x", 100.0, 1)], [1])
    assert all(": not run" in line for line in lines)


def test_paths_option_names_what_it_refuses(bench):
    assert bench.parse_paths("16,1,4") == [1, 4, 16]
    with pytest.raises(SystemExit, match=r"\[8\] not among 1, 4, 16, 64"):
        bench.parse_paths("1,8")
    with pytest.raises(SystemExit, match="comma-separated"):
        bench.parse_paths("four")


def test_an_unknown_extra_row_fails_before_anything_is_prepared(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_scaling.py", "--out-dir", str(tmp_path / "out"), "--rows", "dipaco_5"])
    with pytest.raises(SystemExit, match="unknown row 'dipaco_5'"):
        bench.main()
    assert not (tmp_path / "out").exists()
    known = {r.name: r for r in bench.scaling_rows([1, 4, 16, 64], seeds=1)}
    row = bench.bq.named_row("dipaco_4@train.rounds=32", known)
    assert row.overrides[-1] == "train.rounds=32" and row.routing == "doctopics4_similar"


def test_crossover_rows_are_judged_against_diloco_and_the_dense_row_of_their_compute(bench):
    def row(name: str, ppl: float, paths: int, steps: int) -> dict:
        return {**_row(name, ppl, paths), "steps_per_path": steps}

    results = [row("dense_4x", 140.0, 1, 832), row("dense_16x", 85.0, 1, 3328),
               row("dipaco_4@train.rounds=32", 89.0, 4, 832), row("dipaco_4@train.rounds=32@run.seed=1", 91.0, 4, 832),
               row("diloco_4@train.rounds=32", 92.0, 4, 832), row("diloco_4@train.rounds=32@run.seed=1", 92.0, 4, 832)]
    (line,) = bench.crossover(results)
    assert line == ("- (info) crossover: dipaco_4@train.rounds=32 (832 steps per path, seeds 0,1) 90.00; "
                    "vs diloco_4@train.rounds=32 92.00: +2.2%; vs dense_16x 85.00: -5.9%")


def test_a_rival_with_another_schedule_is_not_the_best_diloco(bench):
    """Regression: diloco_4@train.rounds=32 (4x the compute) was taken as DiLoCo-4's best row."""
    def row(name: str, ppl: float, paths: int, steps: int) -> dict:
        return {**_row(name, ppl, paths), "steps_per_path": steps}

    results = [row("dense_1x", 270.0, 1, 208), row("dipaco_4", 157.0, 4, 208), row("diloco_4", 156.0, 4, 208),
               row("diloco_4@outer.lr=1.0", 158.0, 4, 208), row("diloco_4@train.rounds=32", 91.0, 4, 832),
               row("dipaco_16", 158.0, 16, 208), row("diloco_16", 153.0, 16, 208)]
    lines = bench.targets(results, [1, 4, 16])
    assert "widens from P=4 to P=16: MISSED (P=4 -0.6%, P=16 -3.3%)" in lines[3]
