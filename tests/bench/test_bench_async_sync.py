"""bench/async_sync.py: its argument checks (the runs themselves need Ray and minutes: docs/results.md)."""

from __future__ import annotations

import pytest

from bench import async_sync


def test_only_fault_without_earlier_results_is_one_clear_line(tmp_path):
    # It prepared a run, started Ray and ended in a FileNotFoundError traceback at the results it adds to.
    with pytest.raises(SystemExit, match="--only-fault adds the fault run to .*results.json, which does not exist"):
        async_sync.main(["--only-fault", "--out-dir", str(tmp_path / "fresh")])
    assert not (tmp_path / "fresh").exists()  # nothing prepared


def test_the_table_prints_every_variant_in_markdown():
    row = {"name": "async_dn", "wall_seconds": 3.94, "speedup_vs_sync": 2.3, "step_seconds": 0.0123, "wall_in_steps": 320.4,
           "normalized_speedup_vs_sync": 1.63, "final_ppl": 426.854, "ppl_vs_sync": 0.038, "tasks": 40,
           "staleness": {"mean": 1.25, "p90": 3.0, "max": 4}}
    from bench.harness import markdown_table

    lines = markdown_table([row], async_sync.TABLE).splitlines()
    assert lines[0].startswith("| variant | wall s | speed-up |") and lines[1] == "|" + "---|" * 10
    assert lines[2] == "| async_dn | 3.9 | 2.30x | 0.012 | 320 | 1.63x | 426.85 | +3.8% | 40 | 1.25 / 3 / 4 |"
