"""k-means in torch: recovery of planted clusters, determinism, bad input, parity with scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from routing_testutil import make_blobs
from sklearn.metrics import adjusted_rand_score

from routing.kmeans import kmeans, nearest_centroid, topk_assign


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("batch_size", [None, 256])
def test_blobs_are_recovered(metric, batch_size):
    x, y = make_blobs(n_per=300, k=6, dim=16, seed=1)
    res = kmeans(x, 6, metric=metric, n_init=2, batch_size=batch_size, seed=0)
    assert adjusted_rand_score(y.numpy(), res.labels.numpy()) >= 0.95
    assert res.centroids.shape == (6, 16) and res.labels.shape == (1800,)
    if metric == "cosine":
        torch.testing.assert_close(res.centroids.norm(dim=1), torch.ones(6))


def test_labels_are_nearest_centroids_and_inertia_matches():
    x, _ = make_blobs(n_per=100, k=4, dim=8, seed=2)
    res = kmeans(x, 4, seed=3)
    labels, dists = nearest_centroid(x, res.centroids)
    assert torch.equal(labels, res.labels)
    brute = torch.cdist(x.double(), res.centroids.double()).pow(2).min(dim=1).values.sum()
    assert math.isclose(res.inertia, float(brute), rel_tol=1e-4)
    assert math.isclose(float(dists.sum()), float(brute), rel_tol=1e-4)


def test_same_seed_same_result_different_seed_runs():
    x, _ = make_blobs(n_per=200, k=5, dim=8, spread=1.5, seed=4)
    a, b = kmeans(x, 5, seed=7), kmeans(x, 5, seed=7)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.centroids, b.centroids)
    m1, m2 = kmeans(x, 5, seed=7, batch_size=64), kmeans(x, 5, seed=7, batch_size=64)
    assert torch.equal(m1.labels, m2.labels)


def test_n_init_keeps_the_best_run():
    x, _ = make_blobs(n_per=100, k=8, dim=4, spread=2.0, seed=5)
    runs = [kmeans(x, 8, seed=s, n_init=1).inertia for s in range(3)]
    best = kmeans(x, 8, seed=0, n_init=3).inertia
    assert best <= max(runs) + 1e-6
    assert best <= kmeans(x, 8, seed=0, n_init=1).inertia + 1e-6


def test_inertia_close_to_sklearn():
    from sklearn.cluster import KMeans

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 10, generator=g)  # no clear clusters: local optima differ, quality should not
    ours = kmeans(x, 12, n_init=3, seed=0).inertia
    ref = KMeans(12, n_init=3, random_state=0).fit(x.numpy()).inertia_
    assert ours <= ref * 1.01


def test_empty_clusters_are_reseeded():
    # 3 distinct points repeated: k=3 must find all three even if init duplicates a point.
    x = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]]).repeat(50, 1)
    res = kmeans(x, 3, seed=0)
    assert res.inertia < 1e-6
    assert sorted(np.bincount(res.labels.numpy()).tolist()) == [50, 50, 50]


def test_topk_assign_orders_nearest_first():
    c = torch.tensor([[0.0], [1.0], [3.0]])
    x = torch.tensor([[0.2], [2.9], [1.6]])
    assert topk_assign(x, c, 2).tolist() == [[0, 1], [2, 1], [1, 2]]
    with pytest.raises(ValueError):
        topk_assign(x, c, 4)


def test_bad_input():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match="k must be"):
        kmeans(x, 6)
    bad = torch.randn(10, 3)
    bad[2, 1] = float("nan")
    bad[7, 0] = float("inf")
    with pytest.raises(ValueError, match=r"2 row\(s\).*\[2, 7\]"):
        kmeans(bad, 2)
    with pytest.raises(ValueError, match="metric"):
        kmeans(x, 2, metric="manhattan")
    with pytest.raises(ValueError, match="2-D"):
        kmeans(torch.randn(5), 2)


@pytest.mark.parametrize("batch_size", [None, 256])
def test_n_iter_counts_the_iterations_run(batch_size):
    """n_iter (stored in the router's meta) was always 0: the loop never updated it."""
    x, _ = make_blobs(n_per=100, k=4, dim=8, seed=2)
    assert kmeans(x, 4, max_iter=1, batch_size=batch_size, seed=0).n_iter == 1
    converged = kmeans(x, 4, max_iter=300, batch_size=batch_size, seed=0).n_iter
    assert 2 <= converged < 300


def test_a_fit_reports_each_start_and_the_iterations_of_a_long_one(monkeypatch):
    """Issue 34: the k-means inside `dipaco route` printed nothing, however long it ran."""
    import routing.kmeans as km
    from routing.kmeans import balanced_kmeans

    x, _ = make_blobs(n_per=100, k=4, dim=8, seed=2)
    lines: list[str] = []
    balanced_kmeans(x, 4, 0.1, n_init=2, seed=0, log=lines.append)
    starts = [line for line in lines if line.startswith("k-means k=4 on 400 x 8, start ")]
    assert len(starts) == 2 and "iterations, inertia" in starts[0]
    assert lines[-1].startswith("balanced k-means (slack 0.1): ") and "against plain k-means" in lines[-1]
    assert not any("iteration 1/" in line for line in lines)  # a fast fit: no per-iteration lines

    monkeypatch.setattr(km, "LOG_EVERY_S", 0.0)  # a fit as long as the reporting interval
    lines.clear()
    res = kmeans(x, 4, seed=0, log=lines.append)
    assert [f"k-means iteration {i}/300" for i in range(1, res.n_iter + 1)] == [line.split(":")[0] for line in lines[:-1]]
