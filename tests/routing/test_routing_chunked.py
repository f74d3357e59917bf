"""Chunked balanced assignment (routing.chunked): the bounds of the full N always hold, the result is the
in-memory exact optimum, and no (N, k) matrix is ever requested."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numpy.lib.format import open_memmap
from routing_testutil import make_blobs

from routing.assignment import balanced_assign_costs, capacity, dual_prices, floor_size
from routing.chunked import ChunkedCosts, chunked_balanced_assign
from routing.router import fit_router


def dense_costs(cost: np.ndarray, chunk: int, requests: list[int] | None = None) -> ChunkedCosts:
    """ChunkedCosts over a dense matrix, noting how many rows each request asked for."""

    def rows(a: int, b: int) -> np.ndarray:
        if requests is not None:
            requests.append(b - a)
        return cost[a:b]

    def take(idx: np.ndarray) -> np.ndarray:
        if requests is not None:
            requests.append(idx.size)
        return cost[idx]

    return ChunkedCosts(cost.shape[0], cost.shape[1], chunk, rows, take)


def skewed(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Costs under which most documents prefer the same few clusters, so caps and floors bind."""
    return rng.random((n, k)) * rng.random(k) * 3.0


def random_case(rng: np.random.Generator) -> tuple[np.ndarray, int, int, int]:
    n, k = int(rng.integers(60, 400)), int(rng.integers(2, 9))
    slack, min_fraction = float(rng.choice([0.0, 0.05, 0.1, 0.5])), float(rng.choice([0.0, 0.5, 0.9]))
    return skewed(rng, n, k), capacity(n, k, slack), floor_size(n, k, slack, min_fraction), int(rng.integers(7, n // 3))


def sample_prices(cost: np.ndarray, rng: np.random.Generator, cap_of) -> np.ndarray:
    """Prices of the exact solution on a random half of the documents, as the router's fit sample gives."""
    sample = np.sort(rng.choice(len(cost), len(cost) // 2, replace=False))
    cap, floor = cap_of(len(sample))
    labels = balanced_assign_costs(cost[sample], cap, floor).numpy()
    return dual_prices(cost[sample], labels, cap, floor)


def test_caps_and_floors_of_the_full_n_hold_with_chunks_smaller_than_n():
    rng = np.random.default_rng(0)
    bound = 0
    for _ in range(25):
        cost, cap, floor, chunk = random_case(rng)
        # No prices: the first assignment is nearest-cluster, out of bounds, so repair does the work.
        result = chunked_balanced_assign(dense_costs(cost, chunk), cap, floor, pool_docs=int(rng.choice([4, 10_000])))
        sizes = np.bincount(result.labels, minlength=cost.shape[1])
        assert sizes.max() <= cap and sizes.min() >= floor and result.labels.size == len(cost)
        nearest = np.bincount(cost.argmin(axis=1), minlength=cost.shape[1])
        bound += bool(nearest.max() > cap or nearest.min() < floor)
    assert bound >= 15  # most cases needed the repair


def test_chunked_result_is_the_in_memory_exact_optimum():
    rng = np.random.default_rng(1)
    for trial in range(25):
        cost, cap, floor, chunk = random_case(rng)
        n, k = cost.shape
        exact = balanced_assign_costs(cost, cap, floor).numpy()
        prices = None
        if trial % 2:
            slack_cap, slack_floor = cap, floor

            def cap_of(m: int, c=slack_cap, f=slack_floor) -> tuple[int, int]:
                return min(m, int(np.ceil(c * m / n))), int(f * m // n)

            prices = sample_prices(cost, rng, cap_of)
        result = chunked_balanced_assign(dense_costs(cost, chunk), cap, floor, prices, pool_docs=int(rng.choice([4, 10_000])))
        assert result.optimal
        assert result.cost == pytest.approx(cost[np.arange(n), exact].sum(), rel=1e-12)
        np.testing.assert_array_equal(result.labels, exact)  # continuous random costs: the optimum is unique


def test_with_ties_the_total_cost_is_still_the_optimum():
    rng = np.random.default_rng(2)
    for _ in range(10):
        n, k = int(rng.integers(60, 300)), int(rng.integers(2, 7))
        cost = rng.integers(0, 4, size=(n, k)).astype(np.float64) * rng.integers(1, 3, size=k)
        cap, floor = capacity(n, k, 0.1), floor_size(n, k, 0.1, 0.8)
        exact = balanced_assign_costs(cost, cap, floor).numpy()
        result = chunked_balanced_assign(dense_costs(cost, 17), cap, floor, pool_docs=8)
        assert result.optimal and result.cost == cost[np.arange(n), exact].sum()


def test_no_request_reads_more_rows_than_a_chunk_or_the_boundary_pool():
    rng = np.random.default_rng(3)
    n, k, chunk, pool = 3000, 8, 250, 64
    cost = skewed(rng, n, k)
    requests: list[int] = []
    result = chunked_balanced_assign(dense_costs(cost, chunk, requests), capacity(n, k, 0.05), floor_size(n, k, 0.05, 0.9),
                                     pool_docs=pool)
    assert result.optimal and result.passes > 1
    assert max(requests) <= max(chunk, k * k)  # pool: at most one document per pair of clusters here
    assert max(requests) < n


def test_dual_prices_reproduce_the_optimal_assignment():
    rng = np.random.default_rng(4)
    for _ in range(10):
        n, k = int(rng.integers(50, 300)), int(rng.integers(2, 8))
        cost = skewed(rng, n, k)
        cap, floor = capacity(n, k, 0.1), floor_size(n, k, 0.1, 0.7)
        labels = balanced_assign_costs(cost, cap, floor).numpy()
        reduced = cost - dual_prices(cost, labels, cap, floor)
        # Complementary slackness: each document's cluster is a cheapest one after pricing (ties, on the
        # edges of the shortest-path tree, are at most one document per cluster).
        own = reduced[np.arange(n), labels]
        assert (own <= reduced.min(axis=1) + 1e-9).all()
        assert (reduced.argmin(axis=1) != labels).sum() <= k
        assert (cost.argmin(axis=1) != labels).sum() > k  # without the prices many documents differ


def test_infeasible_bounds_are_refused():
    with pytest.raises(ValueError, match="infeasible"):
        chunked_balanced_assign(dense_costs(np.random.rand(10, 3), 4), cap=3)


def test_router_assigns_a_memory_mapped_corpus_as_it_would_in_memory(tmp_path):
    x, _ = make_blobs(150, 4, 6, spread=1.5, seed=5)
    x = torch.cat([x, x[:100] * 1.3])  # uneven blobs: the caps bind
    stored = open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=tuple(x.shape))
    stored[:] = x.numpy()
    sample = np.sort(np.random.default_rng(0).choice(len(x), 200, replace=False))
    router, fitted = fit_router(x[sample], [4], slack=0.05, min_fraction=0.5, seed=0)
    result = router.assign_balanced_chunked(stored, chunk=64, sample=sample, sample_labels=fitted.numpy())
    in_memory = router.assign_balanced(x).numpy()
    assert result.optimal
    np.testing.assert_array_equal(result.labels, in_memory)
    assert np.bincount(result.labels).max() <= capacity(len(x), 4, 0.05)
    np.testing.assert_array_equal(router.assign_chunked(stored, 64), router.assign(x).numpy())
    np.testing.assert_array_equal(router.assign_topk_chunked(stored, 2, 64), router.assign_topk(x, 2).numpy())


def test_refining_on_the_whole_corpus_lowers_the_cost_of_a_sample_fit(tmp_path):
    """A fit on a small sample misplaces its centroids; Lloyd rounds over every document, read in chunks,
    bring the balanced assignment's cost toward that of a fit on all, and the bounds still hold."""
    x = torch.randn(6000, 8, generator=torch.Generator().manual_seed(3))  # no clusters to find: the fit is noisy
    stored = open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=tuple(x.shape))
    stored[:] = x.numpy()
    sample = np.sort(np.random.default_rng(0).choice(len(x), 400, replace=False))
    costs = {}
    for rounds in (0, 3):
        router, fitted = fit_router(x[sample], [16], slack=0.1, seed=0)
        before = [c.clone() for c in router.centroids]
        lines: list[str] = []
        labels = router.refine_chunked(stored, 1000, sample, fitted, rounds, log=lines.append) if rounds else fitted
        assert len(lines) == rounds and (rounds == 0 or not torch.equal(router.centroids[0], before[0]))
        result = router.assign_balanced_chunked(stored, 1000, sample=sample, sample_labels=labels)
        assert np.bincount(result.labels, minlength=16).max() <= capacity(len(x), 16, 0.1)
        costs[rounds] = result.cost
    full, full_labels = fit_router(x, [16], slack=0.1, seed=0)
    on_all = full.assign_balanced_chunked(stored, 1000, sample=np.arange(len(x)), sample_labels=full_labels).cost
    assert costs[3] < costs[0]
    assert (costs[3] - on_all) < 0.5 * (costs[0] - on_all), (costs, on_all)


def test_only_one_level_k_means_is_refined():
    x, _ = make_blobs(50, 4, 4, seed=1)
    router, labels = fit_router(x, [2, 2], slack=0.1, seed=0)
    with pytest.raises(ValueError, match="one-level k-means"):
        router.refine_chunked(x.numpy(), 64, np.arange(len(x)), labels, 1)


@pytest.mark.parametrize("seed", range(4))
def test_the_boundary_pool_is_the_documents_of_smallest_margin_chosen_chunk_by_chunk(seed):
    from routing.chunked import boundary_pool

    rng = np.random.default_rng(seed)
    n, k, budget = 500, 5, int(rng.integers(1, 120))
    cost = rng.random((n, k))
    prices = rng.random(k) * 0.1
    labels = rng.integers(0, k, n)
    costs = dense_costs(cost, chunk=int(rng.integers(3, 90)))
    shifted = cost - cost.min(axis=1, keepdims=True) - prices
    own = shifted[np.arange(n), labels].copy()
    shifted[np.arange(n), labels] = np.inf
    margin = (shifted.min(axis=1) - own).astype(np.float32)  # continuous random costs: no ties
    pool = boundary_pool(costs, labels, prices, budget)
    assert pool.tolist() == np.sort(np.argsort(margin, kind="stable")[:budget]).tolist()
    assert boundary_pool(costs, labels, prices, n + 1).tolist() == list(range(n))  # every document fits


def test_the_boundary_pool_holds_no_per_document_array():
    """It held the (N,) float32 margins and their (N,) int64 argpartition: 120 MB at 10M documents."""
    import tracemalloc

    from routing.chunked import boundary_pool

    n, k, chunk, budget = 4_000_000, 4, 65_536, 1_000
    cost = np.random.default_rng(0).random((chunk, k))
    costs = ChunkedCosts(n, k, chunk, rows=lambda a, b: cost[: b - a].copy(), take=lambda idx: cost[idx % chunk])
    labels = np.zeros(n, dtype=np.int64)
    tracemalloc.start()
    pool = boundary_pool(costs, labels, None, budget)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert pool.size == budget
    assert peak < 8 * chunk * k * 8 + (1 << 20), peak  # chunk-sized temporaries (17 MB); n * 12 bytes is 48 MB
