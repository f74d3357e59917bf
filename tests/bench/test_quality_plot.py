"""python -m bench quality --plot: rows are picked from several results files, and a missing row is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import quality


def _results(path: Path, *rows: tuple[str, float]) -> Path:
    def curve(ppl: float) -> list[dict]:
        return [{"round": 1, "tokens": 1000, "ppl": 2 * ppl}, {"round": 2, "tokens": 2000, "ppl": ppl}]

    path.write_text(json.dumps({"rows": [{"name": n, "ppl": ppl, "curve": curve(ppl)} for n, ppl in rows]}))
    return path


def test_rows_come_from_whichever_file_holds_them_in_the_order_named(tmp_path):
    a = _results(tmp_path / "a.json", ("diloco_4", 10.0), ("dipaco_2x2_iid", 11.0))
    b = _results(tmp_path / "b.json", ("dipaco_2x2_kmeans", 9.0), ("diloco_4", 99.0))
    rows = quality.panel_rows([a, b], ["dipaco_2x2_kmeans", "diloco_4"])
    assert [(r["name"], r["ppl"]) for r in rows] == [("dipaco_2x2_kmeans", 9.0), ("diloco_4", 10.0)]
    with pytest.raises(SystemExit, match="rows not in .*a.json, .*b.json: moe_4"):
        quality.panel_rows([a, b], ["diloco_4", "moe_4"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json: not a results file of the quality benchmark"):
        quality.panel_rows([tmp_path / "bad.json"], ["diloco_4"])
    with pytest.raises(SystemExit, match="expected TITLE=results.json"):
        quality.parse_panel("a.json")


def test_main_writes_one_panel_per_corpus(tmp_path):
    pytest.importorskip("matplotlib")
    a = _results(tmp_path / "a.json", ("diloco_4", 10.0), ("dipaco_2x2_iid", 11.0))
    b = _results(tmp_path / "b.json", ("diloco_4", 12.0))
    c = _results(tmp_path / "c.json", ("dipaco_2x2_iid", 13.0))
    out = tmp_path / "plots" / "p.png"
    quality.main(["--plot", str(out), "--panel", f"BBC={a}", "--panel", f"mix={b},{c}", "--rows", "diloco_4",
                       "dipaco_2x2_iid"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_flags_go_together(capsys):
    for argv, message in ((["--plot", "p.png", "--rows", "diloco_4"], "--plot and --panel go together"),
                          (["--panel", "BBC=a.json", "--rows", "diloco_4"], "--plot and --panel go together"),
                          (["--plot", "p.png", "--panel", "BBC=a.json"], "--plot needs the --rows to plot"),
                          (["--plot", "p.png", "--panel", "BBC=a.json", "--rows", "diloco_4", "--report", "a.json"],
                           "--plot and --report are two modes")):
        with pytest.raises(SystemExit):
            quality.main(argv)
        assert message in capsys.readouterr().err


def test_the_recorded_results_files_are_read_by_plot_and_report():
    """docs/ holds results files that scripts/bench_quality.py wrote (and merged) before the harness: the
    figures they back stay reproducible from them."""
    recorded = Path(__file__).resolve().parents[2] / "docs" / "results" / "bench_quality_issue14_bbc16.json"
    rows = quality.panel_rows([recorded], ["diloco_4@train.rounds=16"])
    assert rows[0]["name"] == "diloco_4@train.rounds=16" and rows[0]["curve"][-1]["ppl"] == rows[0]["ppl"]
    merged = quality.merge_results([recorded])
    assert merged["rows"] and merged["dense_steps"] > 0 and "diloco_4@train.rounds=16" in quality.results_table(
        merged["rows"], merged["dense_steps"])
