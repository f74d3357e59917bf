"""`python -m bench sites`: time to a target, the table against DDP and compute-only, the refusal without root."""

from __future__ import annotations

import pytest

from bench import sites
from bench.harness import Results


def test_time_to_target_interpolates_between_evaluations_and_says_never():
    curve = [[10.0, 100.0], [20.0, 50.0], [30.0, 40.0]]
    assert sites.time_to(curve, 75.0) == pytest.approx(15.0)
    assert sites.time_to(curve, 100.0) == 10.0
    assert sites.time_to(curve, 30.0) is None


def _row(results: Results, name: str, curve, **extra):
    results.put(name, {}, {"curve": curve, "bytes_per_site": 1e6, "train_seconds": curve[-1][0], **extra})


def test_the_table_compares_each_row_with_ddp_and_with_its_compute_only_run(tmp_path):
    results = Results(tmp_path / "r.json", "sites")
    ddp = {"curve_steps": [10, 20], "steps": 20}
    _row(results, "ddp@unshaped", [[1.0, 80.0], [2.0, 60.0]], seconds_per_step=0.1, **ddp)
    _row(results, "ddp@lan", [[2.0, 80.0], [4.0, 60.0]], seconds_per_step=0.2, **ddp)
    # too slow to reach the target within its budget: extrapolated from its step time
    _row(results, "ddp@poor", [[20.0, 80.0]], seconds_per_step=2.0, **ddp)
    _row(results, "dipaco@unshaped", [[1.0, 70.0], [2.0, 55.0]], wait_share=0.01)
    _row(results, "dipaco@lan", [[1.1, 70.0], [2.2, 55.0]], wait_share=0.02)
    _row(results, "dipaco@poor", [[1.5, 70.0], [3.0, 55.0]], wait_share=0.3)
    table = {(t["row"], t["profile"]): t for t in sites.summarize(results, ["lan", "poor"], ["ddp", "dipaco"])}
    assert table["ddp", "lan"]["target_ppl"] == 60.0  # DDP's final perplexity on the best link
    poor = table["ddp", "poor"]
    assert poor["extrapolated"] and poor["seconds_to_target"] == pytest.approx(40.0)  # 20 steps x 2 s
    assert poor["wait_share"] == pytest.approx(0.95)  # 1 - 0.1 / 2.0: the step time the link adds
    d = table["dipaco", "poor"]
    expected = 1.5 + 1.5 * (70 - 60) / (70 - 55)
    assert d["seconds_to_target"] == pytest.approx(expected)
    assert d["vs_compute_only"] == pytest.approx(expected / (1.0 + 1.0 * (70 - 60) / (70 - 55)))
    assert d["ddp_over_this"] == pytest.approx(40.0 / expected)
    half = {(t["row"], t["profile"]): t for t in sites.summarize(results, ["lan"], ["ddp"], target_fraction=0.5)}
    assert half["ddp", "lan"]["target_ppl"] == 80.0


def test_without_namespaces_it_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sites, "unavailable", lambda: "network namespaces need root (ip netns add)")
    assert sites.main(["--sites", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need root" in err[0]
