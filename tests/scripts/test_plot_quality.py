"""scripts/plot_quality.py: rows are picked from several results files, and a missing row is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def plot_quality(load_script):
    return load_script("plot_quality")


def _results(path: Path, *rows: tuple[str, float]) -> Path:
    def curve(ppl: float) -> list[dict]:
        return [{"round": 1, "tokens": 1000, "ppl": 2 * ppl}, {"round": 2, "tokens": 2000, "ppl": ppl}]

    path.write_text(json.dumps({"rows": [{"name": n, "ppl": ppl, "curve": curve(ppl)} for n, ppl in rows]}))
    return path


def test_rows_come_from_whichever_file_holds_them_in_the_order_named(plot_quality, tmp_path):
    a = _results(tmp_path / "a.json", ("diloco_4", 10.0), ("dipaco_2x2_iid", 11.0))
    b = _results(tmp_path / "b.json", ("dipaco_2x2_kmeans", 9.0), ("diloco_4", 99.0))
    rows = plot_quality.panel_rows([a, b], ["dipaco_2x2_kmeans", "diloco_4"])
    assert [(r["name"], r["ppl"]) for r in rows] == [("dipaco_2x2_kmeans", 9.0), ("diloco_4", 10.0)]
    with pytest.raises(SystemExit, match="rows not in .*a.json, .*b.json: moe_4"):
        plot_quality.panel_rows([a, b], ["diloco_4", "moe_4"])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json: not a bench_quality results file"):
        plot_quality.panel_rows([tmp_path / "bad.json"], ["diloco_4"])
    with pytest.raises(SystemExit, match="expected TITLE=results.json"):
        plot_quality.parse_panel("a.json")


def test_main_writes_one_panel_per_corpus(plot_quality, tmp_path):
    pytest.importorskip("matplotlib")
    a = _results(tmp_path / "a.json", ("diloco_4", 10.0), ("dipaco_2x2_iid", 11.0))
    b = _results(tmp_path / "b.json", ("diloco_4", 12.0))
    c = _results(tmp_path / "c.json", ("dipaco_2x2_iid", 13.0))
    out = tmp_path / "plots" / "p.png"
    plot_quality.main(["--panel", f"BBC={a}", "--panel", f"mix={b},{c}", "--rows", "diloco_4", "dipaco_2x2_iid",
                       "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
