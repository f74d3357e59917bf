"""bench/codecs.py: times every codec and the adaptive rule, against a git revision's codecs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import codecs

REPO = Path(__file__).resolve().parents[2]


def test_codec_bench_against_the_checked_out_revision(tmp_path, capsys):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout: --baseline needs git")
    out = tmp_path / "codecs.json"
    assert codecs.main(["--numel", "5000", "--chunk", "64", "--repeats", "2", "--baseline", "HEAD", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["codec"] for r in result["rows"]] == ["bf16", "int8", "int4", "fp4"]
    # HEAD's committed codecs and the working tree's encode the same bits (a change that did not would fail here).
    assert all(r["bit_identical"] and r["ours_ms"] > 0 and r["baseline_ms"] > 0 for r in result["rows"])
    assert result["adaptive"]["sample_0_ms"] > 0 and result["adaptive"]["sample_64_ms"] > 0
    assert result["environment"]["device"].startswith("cpu (") and result["command"].startswith("python -m bench codecs")
    table = capsys.readouterr().out
    assert "| codec | baseline ms | ours ms | speedup | bit-identical |" in table and "| fp4 |" in table
