"""eval.every (issue 48): each path's validation perplexity during training, in metrics.jsonl, changing nothing."""

from __future__ import annotations

import math

import pytest
import torch

from dipaco.checkpoint.compare import checkpoint_tensors
from dipaco.checkpoint.store import CheckpointManager
from dipaco.errors import ConfigError
from dipaco.metrics import read_metrics
from dipaco.run import Run, apply_overrides


def test_validation_every_round_is_logged_and_changes_nothing(run_cfg):
    watched = Run(apply_overrides(run_cfg, ["train.name=watched", "eval.every=1", "eval.max_docs=12"])).train()
    plain = Run(apply_overrides(run_cfg, ["train.name=plain"])).train()
    records = read_metrics(watched.dir / "metrics.jsonl", "eval")
    assert [r["round"] for r in records] == [1, 2]
    for rec in records:
        assert sum(rec["docs"].values()) == 12 and set(rec["ppl"]) == {f"path_{p:03d}" for p in range(4)}
        assert rec["overall_ppl"] > 1 and math.isfinite(rec["overall_ppl"]) and rec["scored_tokens"] > 0
        assert all(v is None or v > 1 for v in rec["ppl"].values())
    assert records[1]["overall_ppl"] < records[0]["overall_ppl"] * 1.5  # scored by trained paths, not noise
    assert not read_metrics(plain.dir / "metrics.jsonl", "eval")
    a = checkpoint_tensors(CheckpointManager(watched.dir / "checkpoints").latest())
    b = checkpoint_tensors(CheckpointManager(plain.dir / "checkpoints").latest())
    assert all(torch.equal(a[k], b[k]) for k in a)  # scoring draws nothing and changes nothing


def test_validation_every_is_checked(run_cfg):
    with pytest.raises(ConfigError, match="eval.every: must be >= 0"):
        apply_overrides(run_cfg, ["eval.every=-1"])
    with pytest.raises(ConfigError, match="eval.every: 2 is not supported by train.driver=ray"):
        apply_overrides(run_cfg, ["eval.every=2", "train.driver=ray", "outer.sync=async_nesterov"])
