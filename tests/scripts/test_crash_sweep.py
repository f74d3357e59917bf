"""scripts/crash_sweep.py: SIGKILL prepare's and route's clean-up, fail metrics.jsonl's writes; the same command
again ends as an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "crash_sweep.py"


@pytest.mark.slow  # it prepares, pretrains, routes and trains a tiny model, a process a command
def test_kills_during_clean_up_and_a_full_disk_on_metrics_end_as_an_uninterrupted_run(tmp_path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kill-points", "2", "--write-points", "1", "--setups",
                           "background", "--modes", "short", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kill_points"] == 4 and result["kills_matched"] == 4
    for command, work in (("prepare", "prepare.work"), ("route", "routing.work")):
        part = result["cleanup"][command]
        assert part["ops"] >= 3  # the rename away, then at least a file and the directory deleted
        first, last = part["rows"]
        assert (first["point"], last["point"]) == (1, part["ops"])
        assert all(row["killed"] and row["rerun_rc"] == 0 and not row["differs"] and not row["leftovers"]
                   for row in part["rows"])
        # killed before the rename: the work directory was whole, and the rerun resumed from it
        assert first["killed_before"][0] == "rename" and first["killed_before"][1].endswith(work)
        assert last["killed_before"][0] == "rmdir" and ".removing." in last["killed_before"][1]
    assert result["write_points"] == 1 and result["writes_matched"] == 1
    row = result["train"]["background"]["rows"][0]
    assert row["injected"]["landed"] > 0 and row["failed_rc"] == 2 and "No space left on device" in row["failed_with"]
    assert row["resume_rc"] == 0 and row["records_equal"] and row["records"] == result["train"]["background"]["records"]


def test_the_comparison_finds_a_round_logged_twice_and_a_partial_line(tmp_path, load_script):
    sweep = load_script("crash_sweep")
    good = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"event": "outer", "time": t, "round": r, "round_seconds": t}) + "\n"
             for r, t in ((1, 1.5), (2, 2.5))]
    good.write_text("".join(lines))
    want, problem = sweep.metrics_state(good)
    assert want == [{"event": "outer", "round": 1}, {"event": "outer", "round": 2}] and problem == ""
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join([lines[0], lines[0], lines[1]]))
    assert sweep.metrics_state(twice)[0] != want
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(lines) + lines[0][:10])
    assert sweep.metrics_state(partial) == (want, "a partial last line")


def test_files_differ_but_for_datasets_fingerprints_and_timing_fields(load_script):
    sweep = load_script("crash_sweep")
    want = {"a.arrow": b'x{"fingerprint": "0123456789abcdef"}y', "r.json": b'{"inertia": 1.0, "wall_time_s": 2.0}',
            "b.bin": b"\x00\x01"}
    same = {"a.arrow": b'x{"fingerprint": "fedcba9876543210"}y', "r.json": b'{"inertia": 1.0, "wall_time_s": 3.0}',
            "b.bin": b"\x00\x01"}
    assert sweep.compare_files(same, want) == ([], ["a.arrow"], ["r.json"])
    other = {**same, "r.json": b'{"inertia": 1.5, "wall_time_s": 2.0}', "b.bin": b"\x00\x02"}
    assert sweep.compare_files(other, want)[0] == ["differs b.bin", "differs r.json"]
    assert sweep.compare_files({"b.bin": b"\x00\x01"}, want)[0] == ["missing a.arrow", "missing r.json"]
    assert sweep.spread(10, 2) == [1, 10] and sweep.spread(10, 4) == [1, 4, 7, 10] and sweep.spread(3, None) == [1, 2, 3]
