"""scripts/bench_codecs.py: times every codec and the adaptive rule, against a git revision's codecs."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_codecs.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_codecs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_codec_bench_against_the_checked_out_revision(bench, tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=SCRIPT.parent, capture_output=True).returncode:
        pytest.skip("not a git checkout: --baseline needs git")
    out = tmp_path / "codecs.json"
    result = bench.main(["--numel", "5000", "--chunk", "64", "--repeats", "2", "--baseline", "HEAD", "--out", str(out)])
    assert [r["codec"] for r in result["rows"]] == ["bf16", "int8", "int4", "fp4"]
    # HEAD's committed codecs and the working tree's encode the same bits (a change that did not would fail here).
    assert all(r["bit_identical"] and r["ours_ms"] > 0 and r["baseline_ms"] > 0 for r in result["rows"])
    assert result["adaptive"]["sample_0_ms"] > 0 and result["adaptive"]["sample_64_ms"] > 0
    assert out.is_file()
