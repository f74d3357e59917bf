"""`dipaco report`: the table shows each model's compute (paths x steps x params) beside its steps."""

from __future__ import annotations

import json

from dipaco.eval.report import REPORT, comparison_table


def write_report(path, name, paths, steps, params, ppl):
    path.mkdir(parents=True)
    (path / REPORT).write_text(json.dumps({
        "experiment": name, "topology": f"{paths} paths", "num_paths": paths, "params_per_path": params,
        "params_total": params * paths, "steps_per_path": steps, "overall": {"ppl": ppl}}))


def test_compute_is_paths_times_steps_times_params_relative_to_the_cheapest(tmp_path):
    write_report(tmp_path / "pretrain", "pretrained", 1, 400, 1000, 90.0)
    write_report(tmp_path / "train" / "dense", "dense", 1, 200, 1000, 80.0)
    write_report(tmp_path / "train" / "grid", "grid", 4, 200, 1000, 70.0)
    write_report(tmp_path / "train" / "wide", "wide", 1, 100, 3000, 75.0)
    lines = comparison_table(tmp_path).splitlines()
    assert "steps/path" in lines[0] and "compute" in lines[0] and "relative" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert rows["dense"][-3:] == ["2e+05", "1x", "80.00"]
    assert rows["grid"][-3:] == ["8e+05", "4x", "70.00"]
    assert rows["wide"][-3:] == ["3e+05", "1.5x", "75.00"]
    assert rows["pretrained"][-3:] == ["4e+05", "-", "90.00"]  # the init is no experiment to compare against
