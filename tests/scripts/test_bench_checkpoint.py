"""scripts/bench_checkpoint.py: the round's blocking time with the background writer against the synchronous write."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_checkpoint.py"


def test_smoke_compares_both_writers_and_their_files(tmp_path):
    out = tmp_path / "checkpoint.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 and all(r["identical_files"] for r in result["rows"])
    assert all(r["sync_s"] > 0 and r["blocked_s"] > 0 for r in result["rows"])
    assert result["ratio"] == result["blocked_median_s"] / result["sync_median_s"] and result["target"] == 0.10
    assert "ratio" in proc.stdout and result["command"].startswith("python scripts/bench_checkpoint.py --smoke")


def test_the_state_is_a_trainer_snapshot_with_adamw_moments():
    spec = importlib.util.spec_from_file_location("bench_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    snapshot, nbytes = module.path_state(hidden=32, layers=1, vocab=64)
    params, inner = snapshot.paths[0]
    moments = [s["exp_avg"] for s in inner["optimizer"]["state"].values()]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # one AdamW step was taken
    per_copy = sum(p.numel() * p.element_size() for p in params.values())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in inner["optimizer"]["state"].values())
    assert nbytes == 5 * per_copy + steps  # the bank's copy, outer momentum, parameters, two AdamW moments
