"""bench/quality.py (and the row training it shares with path_scaling, bench/lm_training.py): the pieces that
decide what a 2-hour run measures and keeps.

The whole benchmark runs end to end in CI (`.ci/run`, `--smoke`); these tests pin the bookkeeping
that the smoke run cannot show: curve points, the compute column, and `--resume`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import lm_training as lm
from bench import quality as bench
from bench.harness import ResultsFileError
from dipaco.config import Config
from dipaco.model.topology import topology_from_config
from dipaco.run import apply_overrides, load_config

SOURCES = [Path(bench.__file__), Path(lm.__file__)]  # the benchmark's code and the row training it uses


def test_curve_rounds_are_powers_of_two_and_the_last():
    assert lm.curve_rounds(1) == [1]
    assert lm.curve_rounds(4) == [1, 2, 4]
    assert lm.curve_rounds(6) == [1, 2, 4, 6]
    assert lm.curve_rounds(16) == [1, 2, 4, 8, 16]


def test_rows_cover_the_issue_and_names_are_unique():
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


def test_compute_column_scales_with_paths_steps_and_path_size():
    table = bench.results_table([
        _row("dense_1x", 1, 100, 1000, 10.0),
        _row("diloco_4", 4, 100, 1000, 9.0),
        _row("dense_deep_4x", 1, 400, 1500, 8.0),
    ], dense_steps=100)
    compute = {line.split("|")[1].strip(): line.split("|")[6].strip() for line in table.splitlines()[2:]}
    assert compute == {"dense_1x": "1x", "diloco_4": "4x", "dense_deep_4x": "6x"}


def _finished_rows(path: Path, base: Config) -> dict[str, dict]:
    """The rows `--resume` finds in ``path`` for a run of ``base``, by name."""
    return {r["name"]: r for r in lm.open_results(path, "quality", base, resume=True).rows}


def _write_results(path: Path, base: Config, rows: list[dict]) -> None:
    """What a run of ``base`` writes after its rows (each one a row of :func:`bench.quality.rows`)."""
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    results = lm.open_results(path, "quality", base, resume=False)
    results.meta["pretrained_ppl"] = 50.0
    for row in rows:
        lm.put_row(results, every[row["name"]], {k: v for k, v in row.items() if k != "name"})
    results.write()


def test_resume_keeps_rows_of_the_same_base_config(tmp_path):
    base = Config()
    results = tmp_path / "results.json"
    assert _finished_rows(results, base) == {}
    _write_results(results, base, [_row("dense_1x", 1, 100, 1000, 10.0)])
    assert list(_finished_rows(results, base)) == ["dense_1x"]


def test_resume_refuses_another_base_config_naming_the_key(tmp_path):
    results = tmp_path / "results.json"
    _write_results(results, Config(), [_row("dense_1x", 1, 100, 1000, 10.0)])
    with pytest.raises(SystemExit, match="train.rounds"):
        _finished_rows(results, apply_overrides(Config(), ["train.rounds=9"]))
    assert json.loads(results.read_text())["rows"][0]["name"] == "dense_1x"  # nothing lost


def test_resume_reruns_a_row_whose_settings_changed_and_keeps_the_rows_of_older_files(tmp_path):
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    path = tmp_path / "results.json"
    _write_results(path, Config(), [_row("dipaco_2x2_em", 4, 100, 1000, 10.0)])
    results = lm.open_results(path, "quality", Config(), resume=True)
    assert lm.finished(results, every["dipaco_2x2_em"])
    assert not lm.finished(results, replace(every["dipaco_2x2_em"], reroutes=2))  # e.g. EM_REROUTES changed
    assert results.payload()["benchmark"] == "quality" and results.meta["base_config"]["train"]["rounds"] == 4
    # scripts/bench_quality.py's files record no settings: their rows are kept as that script kept them.
    path.write_text(json.dumps({"base_config": results.meta["base_config"], "pretrained_ppl": 50.0,
                                "rows": [_row("dense_1x", 1, 100, 1000, 10.0)]}))
    older = lm.open_results(path, "quality", Config(), resume=True)
    assert lm.finished(older, every["dense_1x"]) and older.get("dense_1x")["ppl"] == 10.0
    assert older.get("dense_1x")["settings"] == lm.row_settings(every["dense_1x"])
    older.write()
    with pytest.raises(ResultsFileError, match="not of 'path_scaling'"):  # another benchmark's file is refused
        lm.open_results(path, "path_scaling", Config(), resume=True)


def test_targets_are_checked_on_both_grids():
    rows = [_row(name, 4, 100, 1000, ppl) for name, ppl in [
        ("dense_1x", 200.0), ("dipaco_2x2_kmeans", 180.0), ("dipaco_2x2_reroute", 181.0),
        ("diloco_16", 160.0), ("dipaco_4x4_kmeans", 150.0), ("dipaco_4x4_product", 149.0)]]
    lines = bench.targets(rows)
    assert "- DiPaCo 2x2 beats dense 1x by >= 5%: met (+10.0%)" in lines
    assert any(line.startswith("- DiPaCo 4x4 beats DiLoCo-16: met") for line in lines)
    assert any("(2x2): MISSED" in line for line in lines)
    assert any("(4x4): met (dipaco_4x4_product 149.00" in line for line in lines)


def test_every_routed_row_has_an_iid_control_of_its_topology_and_the_smoke_run_keeps_one():
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    for routed in (r for r in every.values() if r.routing is not None and bench.iid_control(r.name)):
        control = every[bench.iid_control(routed.name)]
        assert control.routing is None and control.preset == routed.preset
        assert control.rounds_factor == routed.rounds_factor
        # The same topology: embedding and head sharing are the control's, other overrides are the row's.
        topology = [o for o in routed.overrides if o.startswith("topology.")]
        assert control.overrides == topology, routed.name
    assert bench.iid_control("dipaco_2x2_pathemb_top2") == "dipaco_2x2_pathemb_iid"
    assert bench.iid_control("moe_4") == "moe_4_iid" and bench.iid_control("moe_4_iid") is None
    assert bench.iid_control("diloco_4") is None and bench.iid_control("dense_deep_4x") is None
    assert "dipaco_2x2_iid" not in bench.SMOKE_SKIP and set(bench.SMOKE_SKIP) <= set(every)
    assert {n.format(p=4, q=16) for n in bench.GPU_ROWS} <= set(every)  # --preset gpu names real rows
    assert every["dipaco_2x2_top2"].overrides == ["route.topk=2"] and every["dipaco_2x2_em"].reroutes == 3


def test_reroute_rounds_are_evenly_spaced_inside_the_run():
    assert lm.reroute_rounds(4, 1) == [2]
    assert lm.reroute_rounds(4, 3) == [1, 2, 3]
    assert lm.reroute_rounds(16, 3) == [4, 8, 12]
    assert lm.reroute_rounds(2, 3) == [1]
    assert lm.reroute_rounds(1, 3) == []


def test_iid_controls_and_routing_agreement_are_in_the_table_and_targets():
    rows = [{**_row(name, 4, 100, 1000, ppl), "nmi": nmi, "purity": pur} for name, ppl, nmi, pur in [
        ("diloco_4", 100.0, 0.1, 0.4), ("moe_4", 96.0, 0.3, 0.6), ("moe_4_iid", 100.0, 0.01, 0.3),
        ("dipaco_2x2_kmeans", 99.0, 0.1, 0.4), ("dipaco_2x2_featurizer", 95.0, 0.38, 0.61),
        ("dipaco_2x2_iid", 100.0, 0.01, 0.3)]]
    table = bench.results_table(rows, dense_steps=100)
    assert "| NMI | purity |" in table.splitlines()[0]
    assert "| dipaco_2x2_featurizer | 4 | 1.0k | 1.0k | 100 | 4x | 1.0k | 0.380 | 0.610 |" in table
    lines = bench.targets(rows)
    assert "- dipaco_2x2_featurizer beats its iid control (dipaco_2x2_iid) by >= 3%: met (95.00 vs 100.00: +5.0%)" in lines
    assert "- dipaco_2x2_kmeans beats its iid control (dipaco_2x2_iid) by >= 3%: MISSED (99.00 vs 100.00: +1.0%)" in lines
    assert "- moe_4 beats its iid control (moe_4_iid) by >= 3%: met (96.00 vs 100.00: +4.0%)" in lines
    assert any(line.startswith("- DiPaCo 2x2 beats DiLoCo-4 at equal compute: met (best 2x2 row "
                               "dipaco_2x2_featurizer") for line in lines)


def test_path_embedding_rows_are_judged_against_their_own_iid_control():
    rows = [_row(name, 4, 100, 1000, ppl) for name, ppl in [
        ("dipaco_2x2_featurizer", 148.0), ("dipaco_2x2_iid", 147.0),
        ("dipaco_2x2_pathemb_featurizer", 153.0), ("dipaco_2x2_pathemb_iid", 170.0)]]
    lines = bench.targets(rows)
    assert ("- dipaco_2x2_pathemb_featurizer beats its iid control (dipaco_2x2_pathemb_iid) by >= 3%: "
            "met (153.00 vs 170.00: +10.0%)") in lines
    assert any(line.startswith("- dipaco_2x2_featurizer beats its iid control (dipaco_2x2_iid) by >= 3%: MISSED")
               for line in lines)
    assert not any(line.startswith("- dipaco_2x2_pathemb_iid beats") for line in lines)


def test_path_embedding_rows_give_every_path_its_own_embedding_and_head():
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    base = load_config(None, [])
    for name in ("dipaco_2x2_pathemb_featurizer", "dipaco_2x2_pathemb_top2", "dipaco_2x2_pathemb_iid"):
        cfg = apply_overrides(base, lm.row_overrides(every[name], base))
        topo = topology_from_config(cfg.topology, cfg.model.num_layers)
        assert topo.parts[0].num_modules == topo.parts[-1].num_modules == 4 == topo.num_paths


def test_the_product_featurizer_row_routes_each_grid_level_on_the_improved_featurizer():
    preset, method, settings = lm.ROUTINGS["featurizer_product2x2"]
    assert (preset, method) == ("grid:2x2", "product")
    # The flat featurizer row's features and metric; top-1 shards, as the other non-top-2 rows train.
    assert set(settings) == set(lm.improved_featurizer()) - {"route.topk=2"}
    cfg = apply_overrides(load_config(None, []), [f"topology.preset={preset}", f"route.method={method}", *settings])
    assert (cfg.route.method, cfg.route.featurizer, cfg.route.topk) == ("product", "tfidf_svd", 1)
    row = next(r for r in bench.rows(4, 16, True, num_layers=4) if r.name == "dipaco_2x2_product_featurizer")
    assert row.routing == "featurizer_product2x2" and bench.iid_control(row.name) == "dipaco_2x2_iid"


def test_the_doc_topics_rows_route_on_doc_topics_and_are_judged_against_their_iid_controls():
    preset, method, settings = lm.ROUTINGS["doctopics4"]
    cfg = apply_overrides(load_config(None, []), [f"topology.preset={preset}", f"route.method={method}", *settings])
    assert (cfg.route.method, cfg.route.featurizer, cfg.route.metric) == ("kmeans", "doc_topics", "cosine")
    assert cfg.route.topics == 0  # one topic per path
    by_name = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    assert by_name["dipaco_2x2_doctopics"].routing == by_name["moe_4_doctopics"].routing == "doctopics4"
    assert bench.iid_control("dipaco_2x2_doctopics@outer.rescale=sqrt_paths") == "dipaco_2x2_iid@outer.rescale=sqrt_paths"
    assert bench.iid_control("moe_4_doctopics") == "moe_4_iid"
    assert "dipaco_2x2_doctopics" not in bench.SMOKE_SKIP  # CI routes and trains it at the smoke size


def test_the_arranged_doc_topics_rows_differ_from_doctopics4_only_in_the_numbering():
    base = lm.ROUTINGS["doctopics4"][2]
    for mode in ("similar", "dissimilar"):
        preset, method, settings = lm.ROUTINGS[f"doctopics4_{mode}"]
        assert (preset, method) == lm.ROUTINGS["doctopics4"][:2]
        assert settings == [*base, f"route.arrange={mode}"]
        cfg = apply_overrides(load_config(None, []), [f"topology.preset={preset}", f"route.method={method}", *settings])
        assert cfg.route.arrange == mode
        row = next(r for r in bench.rows(4, 16, True, num_layers=4) if r.name == f"dipaco_2x2_doctopics_{mode}")
        assert row.routing == f"doctopics4_{mode}" and bench.iid_control(row.name) == "dipaco_2x2_iid"
    assert "dipaco_2x2_doctopics_similar" in bench.GPU_ROWS


def test_rerouting_rows_reroute_inside_dipaco_train_at_their_points():
    """One code path: the reroute and EM rows set route.em_rounds and train with one `train` call."""
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    base = apply_overrides(Config(), ["train.rounds=16", "train.sharding=kmeans"])

    def em_rounds(name: str) -> list[int]:
        return apply_overrides(base, lm.row_overrides(every[name], base)).route.em_rounds

    assert em_rounds("dipaco_2x2_em") == [4, 8, 12]
    assert em_rounds("dipaco_2x2_reroute") == [8]
    assert em_rounds("dipaco_2x2_kmeans") == [] and em_rounds("dense_4x") == []
    assert "route.em_rounds=[1,2,3]" in lm.row_overrides(every["dipaco_2x2_em"], Config())  # 4 rounds
    assert not any("reroute(" in source.read_text() for source in SOURCES)  # no re-routing loop of its own


def test_corpus_option_writes_only_the_named_shared_corpora(tmp_path, monkeypatch):
    import gzip

    shared = tmp_path / "shared"
    shared.mkdir()
    for name in lm.SOURCES:
        source = name.split("_")[0]
        docs = [{"source": source, "label": f"t{i % 2}", "id": str(i), "text": f"{source} document {i}"} for i in range(3)]
        with gzip.open(shared / name, "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps(d) + "\n" for d in docs))
    monkeypatch.setattr(lm, "SHARED", shared)
    assert set(lm.CORPORA) == {"mix", "bbc", "20ng", "brown"} and lm.CORPORA["mix"] == lm.SOURCES
    bbc = [json.loads(line) for line in lm.write_corpus(tmp_path / "bbc.jsonl", 2, lm.CORPORA["bbc"]).open()]
    assert [d["id"] for d in bbc] == ["bbc/0", "bbc/1"] and {d["label"] for d in bbc} == {"bbc:t0", "bbc:t1"}
    mix = [json.loads(line) for line in lm.write_corpus(tmp_path / "mix.jsonl", None).open()]
    assert len(mix) == 9 and {d["id"].split("/")[0] for d in mix} == {"20news", "bbc", "brown"}


def test_a_row_with_overrides_is_that_row_judged_against_its_control_with_the_same_overrides():
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    row = lm.named_row("dipaco_2x2_pathemb_top2@outer.rescale=sqrt_paths@outer.lr=0.5", every)
    assert row.overrides == [*every["dipaco_2x2_pathemb_top2"].overrides, "outer.rescale=sqrt_paths", "outer.lr=0.5"]
    assert row.routing == "featurizer4" and row.preset == "grid:2x2"
    assert row.experiment == "dipaco_2x2_pathemb_top2_outer.rescale_sqrt_paths_outer.lr_0.5"
    cfg = apply_overrides(load_config(None, []), lm.row_overrides(row, load_config(None, [])))
    assert cfg.outer.rescale == "sqrt_paths" and cfg.train.name == row.experiment and cfg.route.topk == 2
    assert lm.named_row("moe_4", every) is every["moe_4"]
    for bad in ("moe_5", "moe_4@outer.lr", "nope@outer.lr=1"):
        with pytest.raises(KeyError):
            lm.named_row(bad, every)

    sweep = "@outer.rescale=sqrt_paths"
    assert bench.iid_control(f"dipaco_2x2_featurizer{sweep}") == f"dipaco_2x2_iid{sweep}"
    assert bench.iid_control(f"dipaco_2x2_iid{sweep}") is None
    rows = [_row(name, 4, 100, 1000, ppl) for name, ppl in [
        ("diloco_4", 150.0), ("dipaco_2x2_featurizer", 148.0), ("dipaco_2x2_iid", 147.0),
        (f"dipaco_2x2_featurizer{sweep}", 140.0), (f"dipaco_2x2_iid{sweep}", 100.0)]]
    lines = bench.targets(rows)
    assert (f"- dipaco_2x2_featurizer{sweep} beats its iid control (dipaco_2x2_iid{sweep}) by >= 3%: "
            "MISSED (140.00 vs 100.00: -40.0%)") in lines
    # An iid control is never the "best DiPaCo 2x2 row", whatever overrides it carries, and neither is a
    # row that trained longer than DiLoCo-4.
    assert ("- DiPaCo 2x2 beats DiLoCo-4 at equal compute: met (best 2x2 row "
            f"dipaco_2x2_featurizer{sweep} 140.00 vs 150.00)") in lines
    longer = _row("dipaco_2x2_featurizer@train.rounds=8", 4, 200, 1000, 90.0)
    assert ("- DiPaCo 2x2 beats DiLoCo-4 at equal compute: met (best 2x2 row "
            f"dipaco_2x2_featurizer{sweep} 140.00 vs 150.00)") in bench.targets([*rows, longer])
    # ... and is judged against the best DiLoCo-4 row that trained as long.
    longer_diloco = [_row("diloco_4@train.rounds=8", 4, 200, 1000, 85.0),
                     _row("diloco_4@train.rounds=8@outer.lr=0.5", 4, 200, 1000, 88.0)]
    lines = bench.targets([*rows, longer, *longer_diloco])
    assert ("- DiPaCo 2x2 beats DiLoCo-4 at equal compute: met (best 2x2 row "
            f"dipaco_2x2_featurizer{sweep} 140.00 vs 150.00)") in lines
    assert ("- DiPaCo 2x2 beats DiLoCo-4 at equal compute (200 steps per path): MISSED (best 2x2 row "
            "dipaco_2x2_featurizer@train.rounds=8 90.00 vs diloco_4@train.rounds=8 85.00)") in lines
    assert sum("DiLoCo-4" in line for line in lines) == 2



def test_rows_repeated_over_seeds_are_judged_on_their_means():
    assert lm.seed_group("diloco_4@train.rounds=16@run.seed=2", 0) == ("diloco_4@train.rounds=16", 2)
    assert lm.seed_group("diloco_4@train.rounds=16", 7) == ("diloco_4@train.rounds=16", 7)
    s16 = "@outer.rescale=sqrt_paths@train.rounds=16"
    rows = [_row(name, 4, 800, 1000, ppl) for name, ppl in [
        ("diloco_4@train.rounds=16", 95.0),
        (f"dipaco_2x2_doctopics{s16}", 90.0), (f"dipaco_2x2_doctopics{s16}@run.seed=1", 110.0),
        (f"dipaco_2x2_iid{s16}", 100.0), (f"dipaco_2x2_iid{s16}@run.seed=1", 104.0)]]
    lines = bench.targets(rows)
    # The 2x2's luckier seed alone would beat DiLoCo-4; its mean does not.
    assert ("- DiPaCo 2x2 beats DiLoCo-4 at equal compute (800 steps per path): MISSED (best 2x2 row "
            f"dipaco_2x2_doctopics{s16} (mean of seeds 0,1) 100.00 vs diloco_4@train.rounds=16 95.00)") in lines
    assert (f"- dipaco_2x2_doctopics{s16} beats its iid control (dipaco_2x2_iid{s16}) by >= 3%, mean of seeds 0,1: "
            "MISSED (100.00 vs 102.00: +2.0%)") in lines
    # Per seed, each row still meets its own seed's control.
    assert (f"- dipaco_2x2_doctopics{s16} beats its iid control (dipaco_2x2_iid{s16}) by >= 3%: "
            "met (90.00 vs 100.00: +10.0%)") in lines
    # A control that ran other seeds gives no mean comparison.
    assert not any("mean of seeds" in line and "iid control" in line for line in bench.targets(rows[:-1]))
    # The seed table shows the spread beside the mean, for repeated rows only.
    table = bench.seed_table(rows, 0).splitlines()
    assert table[2] == f"| dipaco_2x2_doctopics{s16} | 0,1 | 100.00 | 14.14 | 90.00 | 110.00 |"
    assert len(table) == 4 and bench.seed_table(rows[:2], 0) == ""


def test_an_unknown_row_fails_before_anything_is_prepared(tmp_path, monkeypatch):
    import gzip

    shared = tmp_path / "shared"
    shared.mkdir()
    with gzip.open(shared / "bbc_news.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"source": "bbc", "label": "t", "id": "0", "text": "a document"}) + "\n")
    monkeypatch.setattr(bench, "SHARED", shared)
    monkeypatch.setattr(lm, "prepare", lambda cfg: pytest.fail("prepared before the rows were checked"))
    argv = ["--corpus", "bbc", "--out-dir", str(tmp_path / "out"),
            "--rows", "dipaco_2x2_iid@outer.rescale=sqrt_paths", "dipaco_2x2_idd"]
    with pytest.raises(SystemExit, match=r"unknown row 'dipaco_2x2_idd' \(ROW or ROW@key=value@...\)"):
        bench.main(argv)


def test_data_option_names_the_corpora_folder_and_a_missing_one_is_named(tmp_path, monkeypatch):
    """The repository travels to a GPU machine without ../shared: --data points at a carried copy."""
    import gzip

    carried = tmp_path / "carried"
    carried.mkdir()
    with gzip.open(carried / "bbc_news.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"source": "bbc", "label": "t", "id": "0", "text": "a document"}) + "\n")
    monkeypatch.setattr(bench, "SHARED", tmp_path / "absent")
    written = lm.write_corpus(tmp_path / "bbc.jsonl", None, lm.CORPORA["bbc"], carried)
    assert [json.loads(line)["id"] for line in written.open()] == ["bbc/0"]

    monkeypatch.setattr(lm, "prepare", lambda cfg: pytest.fail("prepared without the corpora"))
    out = tmp_path / "out"
    argv = ["--out-dir", str(out), "--data", str(carried)]
    with pytest.raises(SystemExit, match=r"not at .*carried \(missing 20news_bydate.jsonl.gz, "
                                         r"brown_genres.jsonl.gz\); name their folder with --data"):
        bench.main(argv)  # the mix needs all three corpora
    argv = ["--corpus", "bbc", "--out-dir", str(out)]
    with pytest.raises(SystemExit, match=r"absent \(missing bbc_news.jsonl.gz\)"):
        bench.main(argv)
    assert not out.exists()


def _results_file(path: Path, rows: list[dict], pretrained_ppl: float = 211.08, seed: int = 0) -> Path:
    path.write_text(json.dumps({"base_config": {"run": {"seed": seed}}, "pretrained_ppl": pretrained_ppl,
                                "rows": rows}))
    return path


def test_report_judges_rows_of_several_out_dirs_together_without_training(tmp_path, monkeypatch, capsys):
    """Rows of one corpus run side by side in two out-dirs; --report reads both, with no corpora at hand."""
    monkeypatch.setattr(bench, "SHARED", tmp_path / "absent")
    monkeypatch.setattr(lm, "prepare", lambda cfg: pytest.fail("--report prepared data"))
    s16 = "@outer.rescale=sqrt_paths@train.rounds=16"
    one = _results_file(tmp_path / "a.json", [_row(f"dipaco_2x2_doctopics{s16}", 4, 800, 1000, 90.0),
                                              _row(f"dipaco_2x2_doctopics{s16}@run.seed=1", 4, 800, 1000, 92.0)])
    two = _results_file(tmp_path / "b.json", [_row("diloco_4@train.rounds=16@run.seed=1", 4, 800, 1000, 93.0),
                                              _row("diloco_4@train.rounds=16", 4, 800, 1000, 95.0),
                                              _row(f"dipaco_2x2_doctopics{s16}", 4, 800, 1000, 90.0)])
    merged = tmp_path / "merged.json"
    argv = ["--report", str(one), str(two), "--merged", str(merged)]
    bench.main(argv)
    out = capsys.readouterr().out
    # Table order (DiLoCo before DiPaCo), the row both files hold once, and the seed means across files.
    names = [line.split(" | ")[0].removeprefix("| ") for line in out.splitlines() if line.startswith("| d")]
    assert names[:3] == ["diloco_4@train.rounds=16", "diloco_4@train.rounds=16@run.seed=1",
                         f"dipaco_2x2_doctopics{s16}"]
    assert "| diloco_4@train.rounds=16 | 0,1 | 94.00 | 1.41 | 93.00 | 95.00 |" in out
    assert (f"best 2x2 row dipaco_2x2_doctopics{s16} (mean of seeds 0,1) 91.00 vs "
            "diloco_4@train.rounds=16 (mean of seeds 0,1) 94.00") in out
    # The merged file is a results file: reporting it again prints the same tables.
    argv = ["--report", str(merged)]
    bench.main(argv)
    table, wrote = out.rsplit("[bench] wrote", 1)
    assert wrote.startswith(" the 4 rows to ") and capsys.readouterr().out == table


def test_report_refuses_rows_it_cannot_compare(tmp_path, monkeypatch):
    row = _row("diloco_4", 4, 800, 1000, 95.0)
    good = _results_file(tmp_path / "good.json", [row])
    cases = {
        "other_init.json": (dict(rows=[row], pretrained_ppl=150.0), r"other_init.json was trained from another "
                            r"pretrained init \(val ppl 150.00\) than .*good.json \(211.08\)"),
        "other_result.json": (dict(rows=[{**row, "ppl": 97.0}]), r"row diloco_4 is in .*good.json \(ppl 95.00\) "
                              r"and in .*other_result.json \(ppl 97.00\)"),
        "other_seed.json": (dict(rows=[row], seed=3), r"other_seed.json's base config has run.seed=3"),
    }
    for name, (kwargs, message) in cases.items():
        other = _results_file(tmp_path / name, **kwargs)
        argv = ["--report", str(good), str(other)]
        with pytest.raises(SystemExit, match=message):
            bench.main(argv)
    (tmp_path / "table.md").write_text("| not json |")
    argv = ["--report", str(tmp_path / "table.md")]
    with pytest.raises(SystemExit, match=r"table.md: not a results file of the quality benchmark"):
        bench.main(argv)
    argv = ["--merged", str(tmp_path / "m.json")]
    with pytest.raises(SystemExit):
        bench.main(argv)


def test_a_rounds_override_keeps_the_rows_compute_factor_and_rerouting_points():
    """ROW@train.rounds=16: dense_4x still trains 4x as long as a path, and EM re-routes inside the 16 rounds
    (before the fix dense_4x@train.rounds=16 trained 16 rounds, as long as dense_1x, and the EM row
    re-routed after rounds 1, 2 and 3 of the base schedule)."""
    every = {r.name: r for r in bench.rows(4, 16, True, num_layers=4)}
    base = apply_overrides(Config(), ["train.sharding=kmeans"])  # 4 rounds

    def cfg(name: str) -> Config:
        return apply_overrides(base, lm.row_overrides(lm.named_row(name, every), base))

    assert cfg("dense_4x@train.rounds=16").train.rounds == 64
    assert cfg("dense_1x@train.rounds=16").train.rounds == 16
    assert cfg("diloco_4@train.rounds=16@run.seed=1").train.rounds == 16
    assert cfg("dipaco_2x2_em@train.rounds=16").route.em_rounds == [4, 8, 12]
    assert cfg("dipaco_2x2_reroute@train.rounds=16").route.em_rounds == [8]
    assert cfg("dense_4x").train.rounds == 16 and cfg("dipaco_2x2_em").route.em_rounds == [1, 2, 3]

