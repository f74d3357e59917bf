"""bench/checkpoint.py: the round's blocking time with the background writer against the synchronous write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_smoke_compares_both_writers_and_their_files(tmp_path):
    out = tmp_path / "checkpoint.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "checkpoint", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 and all(r["identical_files"] for r in result["rows"])
    assert all(r["sync_s"] > 0 and r["blocked_s"] > 0 for r in result["rows"])
    assert result["ratio"] == result["blocked_median_s"] / result["sync_median_s"] and result["target"] == 0.10
    assert "ratio" in proc.stdout and result["command"].startswith("python -m bench checkpoint --smoke")
    assert result["environment"]["device"].startswith("cpu (") and result["environment"]["threads"] >= 1


def test_the_state_is_a_trainer_snapshot_with_adamw_moments():
    snapshot, nbytes = checkpoint.path_state(hidden=32, layers=1, vocab=64)
    params, inner = snapshot.paths[0]
    moments = [s["exp_avg"] for s in inner["optimizer"]["state"].values()]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # one AdamW step was taken
    per_copy = sum(p.numel() * p.element_size() for p in params.values())
    steps = sum(s["step"].numel() * s["step"].element_size() for s in inner["optimizer"]["state"].values())
    assert nbytes == 5 * per_copy + steps  # the bank's copy, outer momentum, parameters, two AdamW moments
