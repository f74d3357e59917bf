"""scripts/kill_sweep.py: SIGKILL `dipaco train` at a random moment, resume, compare with an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kill_sweep.py"


def test_one_attempt_ends_bit_exactly_with_every_round_logged_once(tmp_path):
    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--attempts", "1", "--rounds", "3", "--inner-steps", "10",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["attempts"] == 1 and result["bit_exact"] == 1 and result["logged_once"] == 1
    row = result["rows"][0]
    assert row["resume_rc"] == 0 and row["killed_with"] and 0 <= row["delay_s"] <= result["uninterrupted_s"]
