"""Discriminative re-routing: recover a planted routing; biases bring shard sizes to the target."""

from __future__ import annotations

import pytest
import torch
from routing_testutil import make_blobs

from routing.discriminative import adjust_bias, fit_discriminative_router, shard_fractions


def planted(p=5, n_per=120, seed=0):
    x, y = make_blobs(n_per=n_per, k=p, dim=12, spread=1.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    loglik = -50.0 + torch.randn(len(y), p, generator=g, dtype=torch.float64)
    loglik[torch.arange(len(y)), y] += 10.0  # the planted path is clearly best
    return x, y, loglik


def test_planted_assignment_is_recovered():
    x, y, loglik = planted()
    w, b = fit_discriminative_router(x, loglik)
    assert w.shape == (5, 12) and b.shape == (5,)
    pred = (x @ w.T + b).argmax(dim=1)
    assert (pred == y).float().mean() >= 0.95
    # Held-out documents from the same blobs are routed the same way.
    x2, y2, _ = planted(seed=0)
    assert ((x2 @ w.T + b).argmax(dim=1) == y2).float().mean() >= 0.95


def test_bias_adjustment_brings_skewed_shares_to_target():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4000, 8, generator=g, dtype=torch.float64)
    logits[:, 0] += 2.0  # path 0 wins most documents
    target = torch.full((8,), 1 / 8, dtype=torch.float64)
    assert 0.5 * (shard_fractions(logits, torch.zeros(8)) - target).abs().sum() > 0.3
    bias, tv = adjust_bias(logits, target, tol=0.02)
    assert tv <= 0.02
    assert 0.5 * float((shard_fractions(logits, bias) - target).abs().sum()) <= 0.02


def test_skewed_labels_come_out_with_wanted_sizes():
    x, y, loglik = planted(p=4, n_per=200, seed=2)
    loglik[:, 0] += 8.0  # path 0 now wins nearly everything
    for target in ("uniform", [0.4, 0.2, 0.2, 0.2]):
        w, b = fit_discriminative_router(x, loglik, target_sizes=target, tol=0.02)
        frac = torch.bincount((x @ w.T + b).argmax(dim=1), minlength=4).double() / len(x)
        want = torch.full((4,), 0.25) if target == "uniform" else torch.tensor(target)
        assert 0.5 * float((frac - want.double()).abs().sum()) <= 0.02


def test_paths_that_never_win_still_get_documents():
    x, y, loglik = planted(p=3, n_per=150, seed=3)
    loglik = torch.cat([loglik, torch.full((len(y), 2), -1e3, dtype=torch.float64)], dim=1)  # 2 losers
    w, b = fit_discriminative_router(x, loglik, target_sizes="uniform", tol=0.05)
    assert w.shape == (5, 12)
    frac = torch.bincount((x @ w.T + b).argmax(dim=1), minlength=5).double() / len(x)
    assert 0.5 * float((frac - 0.2).abs().sum()) <= 0.05
    assert (frac > 0).all()


def test_bad_input():
    x = torch.randn(10, 3)
    with pytest.raises(ValueError, match="path_loglik"):
        fit_discriminative_router(x, torch.randn(9, 4))
    with pytest.raises(ValueError, match="target_sizes"):
        fit_discriminative_router(x, torch.randn(10, 4), target_sizes=[1.0, 2.0])
    bad = torch.randn(10, 4)
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fit_discriminative_router(x, bad)
