"""``python -m bench comm``'s two-rank measurement at smoke size: real ``torchrun`` jobs (gloo) at fp32 and int8 on
the tiny run's corpus, their bytes against DDP's, the outer step's share and validation perplexity.

Here rather than in tests/bench/: the tiny corpus (``prepared_run``) is a fixture of tests/dipaco/conftest.py."""

from __future__ import annotations

import json
import math

import pytest

from bench import comm as bench


@pytest.mark.slow
def test_bench_comm_measures_two_rank_jobs_bytes_against_ddp(prepared_run, tmp_path):
    out = tmp_path / "comm.json"
    inner = 4
    assert bench.main(["--work", str(tmp_path / "work"), "--corpus", prepared_run.data.corpus, "--rounds", "2",
                       "--inner-steps", str(inner), "--batch", "2", "--layers", "2", "--hidden", "32", "--vocab", "512",
                       "--pretrain-steps", "4", "--dtypes", "fp32,int8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["nproc"] == 2 and report["meta"]["command"].startswith("python -m bench comm")
    fp32, int8 = report["results"]["fp32"], report["results"]["int8"]
    for row in (fp32, int8):
        assert row["inner_steps_per_rank_round"] == 2 * inner and row["modules_communicated"]  # 2 paths a rank
        assert 0 < row["outer_fraction_median"] < 1 and math.isfinite(row["val_ppl"])
    # an fp32 sync sends about a path's parameters once a round, DDP its gradients every inner step
    assert fp32["ddp_over_ours"] >= inner and fp32["target_ddp_over_ours"] == inner
    assert 3.5 < int8["ddp_over_ours"] / fp32["ddp_over_ours"] <= 4.0  # int8: a quarter of the bytes, plus scales
    assert abs(int8["val_ppl"] / fp32["val_ppl"] - 1) < 0.05
