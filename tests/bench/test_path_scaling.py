"""bench/path_scaling.py: what the path-count sweep runs and how it judges its rows.

The whole benchmark runs end to end in CI (`.ci/run`, `--smoke`); these tests pin what the smoke run cannot
show: each preset's rows and settings, the outer-step search and its fresh seeds, the regime's arithmetic (tokens
per parameter, the big dense reference's compute), the diagnostics and the targets' arithmetic."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from bench import lm_training as lm
from bench import path_scaling as bench
from dipaco.config import ModelConfig
from dipaco.run import load_config

REPO = Path(__file__).resolve().parents[2]


def _row(name: str, ppl: float, paths: int = 4) -> dict:
    return {"name": name, "ppl": ppl, "paths": paths, "steps_per_path": 10, "params_per_path": 1000,
            "params_total": 1000, "wall_time_s": 1.0}


def plan(preset: str = "cpu", seeds: int = 2, smoke: bool = False, paths: str | None = None):
    args = bench.parse_args(["--preset", preset, *(["--smoke"] if smoke else []), "--seeds", str(seeds),
                             *(["--paths", paths] if paths else [])])
    return bench.make_plan(args)


def finish(rows, ppl=None) -> dict[str, dict]:
    return {r.name: _row(r.name, (ppl or {}).get(r.name, 10.0)) for r in rows}


def test_every_family_at_every_size_trains_one_path_shape_at_equal_compute():
    rows = {r.name: r for r in bench.known_rows(bench.PRESETS["cpu"]).values()}
    assert rows["dense_1x"].preset == "dense"
    for p, grid in ((4, "grid:2x2"), (16, "grid:4x4")):
        dipaco, shared = rows[f"dipaco_{p}"], rows[f"dipaco_shared_{p}"]
        assert dipaco.preset == shared.preset == grid
        assert {"topology.embedding=path", "topology.head=path"} <= set(dipaco.overrides)
        assert {"topology.embedding=shared", "topology.head=shared"} <= set(shared.overrides)
        assert rows[f"diloco_{p}"].preset == f"diloco:{p}" and rows[f"diloco_{p}"].routing is None  # iid shards
        assert rows[f"moe_{p}"].preset == f"moe:{p}"
        assert rows[f"dense_{p}x"].rounds_factor == p  # one path, P times the steps
        # DiPaCo and flat MoE train on the same doc_topics shards, numbered so alike ones share modules
        assert dipaco.routing == shared.routing == rows[f"moe_{p}"].routing == f"doctopics{p}_similar"


def test_the_grid_runs_first_then_the_best_setting_on_fresh_seeds():
    sweep = plan(paths="1,4")
    first = sweep.rows({})
    names = [r.name for r in first]
    assert names[0] == "dense_1x"
    assert "dipaco_4" in names and "dipaco_4@outer.lr=0.7" in names and "diloco_4@outer.lr=0.85" in names
    assert "dipaco_shared_4@outer.lr=0.7@outer.embedding_head_lr_scale=1.0@outer.rescale=sqrt_paths" in names
    # P = 1 and dense have no grid: only their fresh seeds, from the start; nothing else has fresh seeds yet
    assert [n for n in names if "run.seed" in n] == ["dense_1x@run.seed=1", "dense_1x@run.seed=2", "diloco_1@run.seed=1",
                                                     "diloco_1@run.seed=2", "dense_4x@run.seed=1", "dense_4x@run.seed=2"]
    one = next(r for r in first if r.name == "diloco_1@run.seed=1")
    assert one.preset == "diloco:1" and "outer.lr=1.0" in one.overrides  # one path with DiLoCo's outer step
    done = finish(first, {"dipaco_4@outer.lr=0.85": 9.0, "diloco_4": 9.5})
    names = [r.name for r in sweep.rows(done)]
    for seed in (1, 2):
        assert f"dipaco_4@outer.lr=0.85@run.seed={seed}" in names  # the lowest tuning-seed perplexity
        assert f"diloco_4@run.seed={seed}" in names  # the default won
        assert f"moe_4@run.seed={seed}" in names
    assert not any(n.startswith("dipaco_4@run.seed") for n in names)
    row = next(r for r in sweep.rows(done) if r.name == "dipaco_4@outer.lr=0.85@run.seed=1")
    assert row.overrides[-2:] == ["outer.lr=0.85", "run.seed=1"]  # on top of the family's default, seed last


def test_a_family_waits_for_its_whole_grid():
    sweep = plan(paths="4")
    done = finish([r for r in sweep.rows({}) if r.name != "dipaco_4@outer.lr=0.7"])
    names = [r.name for r in sweep.rows(done)]
    assert not any(n.startswith("dipaco_4") and "run.seed" in n for n in names)
    assert "diloco_4@run.seed=1" in names


def test_sixteen_paths_add_the_extras_and_the_big_dense_reference():
    sweep = plan(paths="16")
    big = bench.BigDense(ModelConfig(num_layers=4, hidden_size=96, intermediate_size=192, num_heads=6), rounds=50,
                         params=400_000, dipaco_16_bank_params=350_000, path_flops_per_token=1.0,
                         big_flops_per_token=10.0)
    sweep = bench.replace(sweep, big=big)
    done = finish(sweep.rows({}))
    rows = {r.name: r for r in sweep.rows(done)}
    assert "route.topk=2" in rows["dipaco_16@route.topk=2"].overrides
    assert rows["dense_big_16x"].model == ["model.num_layers=4", "model.hidden_size=96", "model.intermediate_size=192",
                                           "model.num_heads=6"]
    assert rows["dense_big_16x"].overrides[-1] == "train.rounds=50"


def test_presets_without_tuning_run_their_defaults_on_fresh_seeds_only():
    gpu = plan(preset="gpu", seeds=1)
    assert [r.name for r in gpu.rows({})] == ["dipaco_4@run.seed=1", "diloco_4@run.seed=1", "dipaco_16@run.seed=1",
                                              "diloco_16@run.seed=1"]
    bpe = plan(preset="bpe", seeds=2, paths="4")
    assert {r.name for r in bpe.rows({})} == {f"{f}@run.seed={s}" for f in ("dipaco_4", "dipaco_shared_4", "diloco_4",
                                                                            "moe_4", "dense_4x") for s in (1, 2)}


def test_the_smoke_run_keeps_one_alternative_per_compared_family():
    smoke = plan(smoke=True, seeds=1, paths="4")
    names = {r.name for r in smoke.rows({})}
    assert {"dipaco_4", "dipaco_4@outer.embedding_head_lr_scale=0.7", "diloco_4", "diloco_4@outer.lr=0.7",
            "dipaco_shared_4", "moe_4"} <= names
    assert not any(n.startswith("dipaco_shared_4@") or n.startswith("moe_4@") for n in names)


def test_the_cpu_regime_binds_capacity_within_two_passes():
    """Issue 49's rules for the cpu preset: non-embedding parameters are the path's majority, >= 80 tokens per
    non-embedding parameter per path, >= 32 rounds; the smallest 16-path shard is checked in the docs (1.30M bytes)."""
    cfg = load_config(REPO / "configs/bench/quality.yaml", list(bench.PRESETS["cpu"].overrides))
    nonemb, head, total = bench.count_params(cfg.model, cfg.tokenizer.vocab_size)
    d, ff, layers = cfg.model.hidden_size, cfg.model.intermediate_size, cfg.model.num_layers
    assert nonemb == layers * (4 * d * d + 3 * d * ff + 2 * d) + d  # attention, SwiGLU MLP, norms, final norm
    assert head == cfg.tokenizer.vocab_size * d and total == nonemb + 2 * head
    assert nonemb / total > 0.5
    tokens = cfg.train.rounds * cfg.train.inner_steps * cfg.train.optim.batch_size * cfg.data.seq_len
    assert tokens / nonemb >= 80 and cfg.train.rounds >= 32
    assert 2 * 1_298_598 >= tokens  # the smallest 16-path doc_topics shard of the mixed corpus, in bytes


def test_the_big_dense_reference_has_dipaco_sixteens_parameters_and_compute(tmp_path):
    cfg = load_config(REPO / "configs/bench/quality.yaml", [*bench.PRESETS["cpu"].overrides, f"run.dir={tmp_path}"])
    big = bench.plan_big_dense(cfg, vocab=258)
    # the bank of a 4x4 grid with path-specific embedding and head: 16 embeddings and heads, 8 one-block modules
    d, vocab = cfg.model.hidden_size, 258
    block = (bench.non_embedding_params(cfg.model) - d) // cfg.model.num_layers
    assert big.dipaco_16_bank_params == 16 * (vocab * d) + 16 * (vocab * d + d) + 8 * block
    assert abs(big.params - big.dipaco_16_bank_params) / big.dipaco_16_bank_params < 0.15
    compute = 16 * cfg.train.rounds * cfg.train.inner_steps * big.path_flops_per_token
    assert math.isclose(big.rounds * cfg.train.inner_steps * big.big_flops_per_token, compute, rel_tol=0.05)


def test_outer_diagnostics_average_each_part_kind_over_modules_and_rounds():
    records = [
        {"outer_grad_norm": {"embedding.0": 1.0, "level0.0": 2.0, "level1.0": 4.0, "head.0": 8.0},
         "path_cosine": {"embedding.0": 0.5, "level0.0": 0.2, "level1.0": 0.4, "head.0": None},
         "path_delta_norm": {"level0.0": 1.0, "level1.0": 3.0}},
        {"outer_grad_norm": {"level0.0": 4.0, "level1.0": 6.0}, "path_cosine": {"level0.0": 0.6, "level1.0": 0.8},
         "path_delta_norm": {"level0.0": 5.0, "level1.0": 7.0}},
    ]
    d = bench.outer_diagnostics(records)
    assert d["levels"]["outer_grad_norm"] == pytest.approx((3.0 + 5.0) / 2)
    assert d["levels"]["path_cosine"] == pytest.approx((0.3 + 0.7) / 2)
    assert d["levels"]["path_cosine_first"] == pytest.approx(0.3) and d["levels"]["path_cosine_last"] == pytest.approx(0.7)
    assert d["levels"]["path_delta_norm"] == pytest.approx((2.0 + 6.0) / 2)
    assert d["head"]["path_cosine"] is None  # one path per head: no pair to compare
    assert d["embedding"]["outer_grad_norm"] == 1.0


def test_the_curve_and_targets_use_fresh_seed_means_of_each_familys_best():
    results = [_row("dense_1x", 10.0, 1), _row("dense_1x@run.seed=1", 10.2, 1), _row("diloco_1@run.seed=1", 9.5, 1),
               _row("dipaco_4", 9.0), _row("dipaco_4@outer.lr=0.85", 8.0),  # tuning seed: not in the curve
               _row("dipaco_4@outer.lr=0.85@run.seed=1", 8.6), _row("dipaco_4@outer.lr=0.85@run.seed=2", 8.8),
               _row("diloco_4@run.seed=1", 9.0), _row("diloco_4@run.seed=2", 9.0),
               _row("dipaco_16@run.seed=1", 8.0, 16), _row("dipaco_16@run.seed=2", 8.2, 16),
               _row("diloco_16@run.seed=1", 8.8, 16), _row("diloco_16@run.seed=2", 8.6, 16),
               _row("dipaco_16@route.topk=2@run.seed=1", 1.0, 16)]  # beside the sweep: never the curve
    main = bench.fresh_seed_rows(results)
    assert main[("dipaco", 1)] == main[("moe", 1)] == main[("diloco", 1)] == {1: 9.5}  # one path, outer step
    assert main[("dense", 1)] == {1: 10.2}  # plain AdamW; the tuning seed's dense_1x is not in the curve
    assert main[("dipaco", 4)] == {1: 8.6, 2: 8.8}
    assert main[("dipaco", 16)] == {1: 8.0, 2: 8.2}
    assert "8.700 ± 0.141 (2)" in bench.scaling_table(results, [1, 4, 16])
    lines = bench.targets(results)
    assert lines[0] == "- DiPaCo-16 <= 0.95 x DiLoCo-16 (fresh-seed means): met (8.100 vs 8.700: ratio 0.9310)"
    assert lines[1].startswith("- the DiPaCo/DiLoCo ratio at P = 16 is below the one at P = 4 in every seed: met")
    assert "seed 1: P=4 0.9556, P=16 0.9091" in lines[1]
    assert lines[2] == "- DiPaCo at P = 16 at least 5% below P = 4: met (8.700 -> 8.100: -6.90%)"
    flat = [{**r, "ppl": 8.7} if r["name"].startswith("dipaco_16") else r for r in results]
    assert bench.targets(flat)[2].startswith("- DiPaCo at P = 16 at least 5% below P = 4: MISSED")


def test_the_grid_table_marks_the_chosen_setting():
    results = [_row("diloco_16", 9.0, 16), _row("diloco_16@outer.lr=0.85", 8.5, 16), _row("diloco_16@outer.lr=1.2", 9.5, 16)]
    table = bench.grid_table(results)
    assert "| diloco | 16 | outer.lr=0.85 | **8.500** |" in table
    assert "| diloco | 16 | default (outer.lr=1.0) | 9.000 |" in table


def test_bits_per_byte_convert_a_token_perplexity():
    assert bench.bits_per_byte(8.0, 1.0) == pytest.approx(3.0)
    assert bench.bits_per_byte(8.0, 3.0) == pytest.approx(1.0)
    assert bench.bits_per_byte(8.0, None) is None


def test_targets_say_not_run_without_the_rows():
    lines = bench.targets([_row("dense_1x", 10.0, 1)])
    assert all(": not run" in line for line in lines[:3])


def test_paths_option_names_what_it_refuses():
    assert bench.parse_paths("16,1,4") == [1, 4, 16]
    with pytest.raises(SystemExit, match=r"\[8\] not among 1, 4, 16, 64"):
        bench.parse_paths("1,8")
    with pytest.raises(SystemExit, match="comma-separated"):
        bench.parse_paths("four")


def test_an_unknown_extra_row_fails_before_anything_is_prepared(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="unknown row 'dipaco_5'"):
        bench.main(["--out-dir", str(tmp_path / "out"), "--rows", "dipaco_5"])
    assert not (tmp_path / "out").exists()
    known = bench.known_rows(bench.PRESETS["cpu"])
    row = lm.named_row("dipaco_16@route.topk=2", known)
    assert row.overrides[-1] == "route.topk=2" and row.routing == "doctopics16_similar"


def test_a_missing_corpus_is_named(tmp_path):
    with pytest.raises(SystemExit, match="missing 20news_bydate.jsonl.gz"):
        bench.main(["--out-dir", str(tmp_path / "out"), "--data", str(tmp_path)])
    assert sys.modules["bench.path_scaling"] is bench


def test_families_option_runs_a_subset_and_names_what_it_refuses(capsys):
    sweep = bench.make_plan(bench.parse_args(["--preset", "bpe", "--seeds", "1", "--paths", "16",
                                              "--families", "dipaco,diloco"]))
    assert [r.name for r in sweep.rows({})] == ["dipaco_16@run.seed=1", "diloco_16@run.seed=1"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "gpu", "--families", "moe"])
    assert "--families: ['moe'] not among the gpu preset's dipaco, diloco" in capsys.readouterr().err


def report(tmp_path, capsys, rows: list[dict]) -> list[str]:
    """What --report prints for a results.json of the cpu preset holding ``rows`` (its base config and rows only, as
    a sweep still running has written it)."""
    import json

    from omegaconf import OmegaConf

    cfg = load_config(REPO / "configs/bench/quality.yaml", [*bench.PRESETS["cpu"].overrides, f"run.dir={tmp_path}/b"])
    (tmp_path / "results.json").write_text(json.dumps({"base_config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                                                        "pretrained_ppl": 20.0, "rows": rows}))
    bench.main(["--report", "--out-dir", str(tmp_path)])
    return capsys.readouterr().out.splitlines()


def test_report_of_a_sweep_in_progress_derives_the_arithmetic_from_its_config(tmp_path, capsys):
    # A running sweep's results.json holds only its base config and rows; --report printed 1,703,936 tokens per
    # non-embedding parameter (the path's parameters read as 1) before it derived them from the config.
    out = report(tmp_path, capsys, [{**_row("dense_1x", 8.5, paths=1), "steps_per_path": 32 * 26}])
    line = next(x for x in out if x.startswith("| dense_1x |"))
    assert "| 82.6 |" in line


def test_report_reads_the_rows_of_the_script_before_the_benchmark(tmp_path, capsys):
    # docs/results/bench_scaling.json (issue 36) holds dipaco_16_top2: --report raised ValueError on its name.
    rows = [_row("dipaco_16_top2", 7.0, 16), _row("dipaco_16@run.seed=1", 8.0, 16)]
    assert bench.fresh_seed_rows(rows) == {("dipaco", 16): {1: 8.0}}  # a row beside the sweep: not in the curve
    out = report(tmp_path, capsys, rows)
    assert any(x.startswith("| dipaco_16_top2 | 16 |") for x in out)
    assert "| DiPaCo grid, path-specific embedding + head | - | - | 8.000 |" in out


def test_a_diverged_grid_point_is_never_the_best_setting():
    # A NaN perplexity (null once results.json holds it: strict JSON) was chosen when it came first, and None raised
    # TypeError in a resumed sweep.
    sweep = plan(paths="4")
    for diverged in (math.nan, None):
        done = finish(sweep.rows({}), {"dipaco_4": diverged, "dipaco_4@outer.lr=0.7": 9.0})
        assert sweep.best_setting("dipaco", 4, done) == ("outer.lr=0.7",)
        assert "dipaco_4@outer.lr=0.7@run.seed=1" in [r.name for r in sweep.rows(done)]
        assert "| dipaco | 4 | outer.lr=0.7 | **9.000** |" in bench.grid_table(list(done.values()))


def test_the_tables_and_targets_show_a_diverged_row(tmp_path, capsys):
    # A diverged fresh seed made statistics.stdev raise (NaN) and the tables raise TypeError (null, read back).
    rows = [_row("dipaco_16@run.seed=1", 8.0, 16), _row("dipaco_16@run.seed=2", math.nan, 16),
            _row("diloco_16@run.seed=1", 8.5, 16), _row("diloco_16@run.seed=2", None, 16)]
    assert "| DiPaCo grid, path-specific embedding + head | nan |" in bench.scaling_table(rows, [16])
    assert bench.targets(rows)[0] == "- DiPaCo-16 <= 0.95 x DiLoCo-16 (fresh-seed means): MISSED (nan vs nan: ratio nan)"
    out = report(tmp_path, capsys, [{**r, "ppl": None if r["ppl"] is None or math.isnan(r["ppl"]) else r["ppl"]} for r in rows])
    assert any(x.startswith("| diloco_16@run.seed=2 |") and x.endswith("| - | - |") for x in out)
