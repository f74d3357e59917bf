"""scripts/bench_async.py: its argument checks (the runs themselves need Ray and minutes: docs/results.md)."""

from __future__ import annotations

import sys

import pytest


def test_only_fault_without_earlier_results_is_one_clear_line(load_script, tmp_path, monkeypatch):
    # It prepared a run, started Ray and ended in a FileNotFoundError traceback at the results it adds to.
    bench = load_script("bench_async")
    monkeypatch.setattr(sys, "argv", ["bench_async.py", "--only-fault", "--out-dir", str(tmp_path / "fresh")])
    with pytest.raises(SystemExit, match="--only-fault adds the fault run to .*results.json, which does not exist"):
        bench.main()
    assert not (tmp_path / "fresh").exists()  # nothing prepared
