"""scripts/layer_walk.py: building a rank's experiment never climbs back up the package layers, and the
root's walk to the inner loops climbs at most 10 times (issue 50's goal), for both drivers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "layer_walk.py"


@pytest.mark.slow  # it prepares and pretrains a tiny model first
@pytest.mark.parametrize("driver", ["torchrun", "ray"])
def test_the_walk_from_build_trainer_to_the_inner_loops(driver):
    # --driver ray failed with a ConfigError (its tiny config kept outer.sync=diloco) until this test
    proc = subprocess.run([sys.executable, str(SCRIPT), "--driver", driver], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = re.search(rf"build_trainer \({driver}\): (\d+) calls into dipaco, (\d+) climb back up", proc.stdout)
    walk = re.search(r"the walk to the inner loops: (\d+) calls by the root, (\d+) back up a layer", proc.stdout)
    assert calls and walk, proc.stdout[-3000:]
    assert int(calls[1]) > 100 and int(calls[2]) == 0
    assert int(walk[1]) > 10 and int(walk[2]) <= 10
