"""Capacity-constrained assignment: the cap holds exactly, and the solution is optimal."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from routing_testutil import make_blobs

from routing.assignment import balanced_assign_costs, capacity, floor_size
from routing.kmeans import balanced_assign, balanced_kmeans, kmeans, sq_distances


@pytest.mark.parametrize(
    "n,k,slack",
    [(100, 4, 0.0), (103, 4, 0.0), (1000, 7, 0.0), (1001, 10, 0.1), (997, 13, 0.05), (50, 50, 0.0), (2000, 3, 0.5)],
)
def test_capacity_holds_exactly(n, k, slack):
    g = torch.Generator().manual_seed(n + k)
    # Skewed data: one dense region, so plain nearest-centroid would overflow some clusters.
    x = torch.cat([torch.randn(n // 2, 5, generator=g) * 0.1, torch.randn(n - n // 2, 5, generator=g)])
    c = torch.randn(k, 5, generator=g)
    labels = balanced_assign(x, c, slack)
    sizes = np.bincount(labels.numpy(), minlength=k)
    cap = math.ceil(n / k * (1 + slack))
    assert capacity(n, k, slack) == cap
    assert sizes.sum() == n and sizes.max() <= cap
    if slack == 0:
        assert sizes.max() - sizes.min() <= 1


def test_slack_of_a_tenth_is_not_rounded_up_by_float_error():
    assert capacity(1000, 10, 0.1) == 110  # 1000/10*1.1 = 110.00000000000001 in floats


def test_equal_blobs_balanced_equals_unbalanced():
    x, _ = make_blobs(n_per=250, k=8, dim=6, seed=3)
    res = kmeans(x, 8, seed=0)
    assert np.bincount(res.labels.numpy()).tolist() == [250] * 8
    for slack in (0.0, 0.1):
        assert torch.equal(balanced_assign(x, res.centroids, slack), res.labels)


def test_matches_linear_programming_optimum():
    from scipy import sparse
    from scipy.optimize import linprog

    g = torch.Generator().manual_seed(11)
    n, k, cap = 90, 4, 25
    cost = torch.rand(n, k, generator=g, dtype=torch.float64)
    cost[:40, 0] -= 0.8  # 40 documents want cluster 0 but only 25 fit
    labels = balanced_assign_costs(cost, cap)
    ours = float(cost[torch.arange(n), labels].sum())
    rows = sparse.kron(sparse.eye(n), np.ones((1, k)))
    cols = sparse.kron(np.ones((1, n)), sparse.eye(k))
    lp = linprog(cost.numpy().ravel(), A_ub=cols, b_ub=np.full(k, cap), A_eq=rows, b_eq=np.ones(n),
                 bounds=(0, 1), method="highs")
    assert math.isclose(ours, lp.fun, rel_tol=1e-9, abs_tol=1e-9)


def test_balanced_kmeans_reports_its_inertia_cost():
    x = torch.cat([torch.randn(600, 4) * 0.3, torch.randn(200, 4) * 0.3 + 5.0])
    res = balanced_kmeans(x, 4, slack=0.0, seed=0)
    sizes = np.bincount(res.labels.numpy(), minlength=4)
    assert sizes.tolist() == [200] * 4
    # Both are local optima, so balance may cost little or even nothing; it is reported either way.
    assert math.isfinite(res.inertia) and math.isfinite(res.unbalanced_inertia)
    assert res.inertia_cost == pytest.approx(res.inertia / res.unbalanced_inertia - 1)


def test_infeasible_bounds_and_bad_costs():
    with pytest.raises(ValueError, match="infeasible"):
        balanced_assign_costs(torch.rand(10, 3), cap=3)
    bad = torch.rand(10, 3)
    bad[4, 2] = float("nan")
    with pytest.raises(ValueError, match="cost"):
        balanced_assign_costs(bad, cap=4)
    with pytest.raises(ValueError, match="slack"):
        balanced_assign(torch.rand(10, 2), torch.rand(3, 2), slack=-0.1)


def test_sq_distances_matches_cdist():
    x, c = torch.randn(50, 7), torch.randn(5, 7)
    torch.testing.assert_close(sq_distances(x, c), torch.cdist(x, c).pow(2), atol=1e-4, rtol=1e-4)


def test_floor_size():
    assert floor_size(100, 4, 0.0) == 25  # slack 0: equal sizes
    assert floor_size(100, 4, 0.1) == 0  # the cap alone, by default
    assert floor_size(100, 4, 0.1, 0.5) == 12
    with pytest.raises(ValueError, match="min_fraction"):
        floor_size(100, 4, 0.1, 1.5)


def test_product_router_cells_keep_their_floor():
    """Two perfectly correlated levels leave the off-diagonal product cells empty; with the cap alone
    (here a loose one, 2N/P) two of four shards stay empty (found on 20 Newsgroups with slack 0.1:
    a 4x4 grid's cell got 1 document)."""
    from routing.router import fit_router

    g = torch.Generator().manual_seed(0)
    side = torch.cat([torch.randn(100, 2, generator=g) - 4, torch.randn(100, 2, generator=g) + 4])
    x = torch.cat([side, side + 0.01 * torch.randn(200, 2, generator=g)], dim=1)  # level 2 copies level 1
    _, capped = fit_router(x, [2, 2], slack=1.0, seed=0)
    assert np.bincount(capped.numpy(), minlength=4).min() == 0
    router, paths = fit_router(x, [2, 2], slack=1.0, min_fraction=0.5, seed=0)
    sizes = np.bincount(paths.numpy(), minlength=4)
    assert sizes.min() >= floor_size(200, 4, 1.0, 0.5) == 25 and sizes.max() <= capacity(200, 4, 1.0)
    assert router.balance_min_fraction == 0.5


def test_router_file_keeps_the_floor(tmp_path):
    from routing.router import Router, fit_router

    x = make_blobs(200, 4, 3, seed=1)[0]
    router, _ = fit_router(x, [3], slack=0.2, min_fraction=0.6, seed=0)
    router.save(tmp_path / "r")
    assert Router.load(tmp_path / "r").balance_min_fraction == 0.6
