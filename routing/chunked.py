"""Capacity-constrained assignment of a corpus too large for an (N, k) cost matrix, in chunks.

`routing.assignment` solves the transportation problem exactly on a dense (N, k) matrix; at
millions of documents and 256 clusters that matrix alone is gigabytes. Here the costs are never
held whole: `ChunkedCosts` recomputes any rows on demand (from memory-mapped features and the
centroids), and the solver only keeps the labels (N,) plus k x k summaries:

1. **Prices.** Every document takes argmin_j cost[d, j] - price[j]. The prices are the dual
   variables (`routing.assignment.dual_prices`) of the exact solution on the k-means fit sample,
   so this first assignment is already close to balanced and close to optimal (the paper's
   bias adjustment). Without prices it is the nearest centroid.
2. **Repair** (passes over the chunks, while a bound fails): the same greedy moves as the in-memory `_repair`, cheapest
   first, out of clusters above their cap and then into clusters below their floor. Each pass keeps
   only the candidates that can move (at most the surplus of each cluster), so its memory is the
   size of the violation, not of the corpus. From here on every bound holds.
3. **Boundary solve**: the `pool_docs` documents of smallest margin (cheapest other priced cost
   minus their own: those a small error in the prices would move, and those the repair moved) are
   solved exactly with `balanced_assign_costs`, all others fixed and the bounds reduced by them.
   With prices from a good sample the optimum differs from the priced assignment only near the
   boundaries, so this lands on it or next to it in one (pool, k) solve.
4. **Optimality** (passes over the chunks): each pass builds the residual graph of
   `routing.assignment` (edge a -> b = the cheapest move of one document from a to b, plus the
   spare-capacity node) and keeps, per pair (a, b), the `m` cheapest documents. No negative cycle
   means the total cost is minimal: done. Otherwise the pooled documents are re-solved exactly
   (`balanced_assign_costs`, all other documents fixed, bounds reduced by them). The pool holds the
   cheapest document of every edge, so the negative cycle found is in the pool's own graph and
   the re-solve lowers the total cost strictly; the pass after it checks again.

Guaranteed: floor <= sizes <= cap for every cluster, always (verified before returning; bounds
computed by the caller for the full N), and, when `ChunkedAssignment.optimal` is true, the
minimum total cost given the costs (the centroids): the same total as `balanced_assign_costs`
on the whole matrix, and the same labels when the optimum is unique (no ties). `optimal` is
false only if `max_passes` ran out or, with `min_gain` > 0, a pass lowered the total cost by less
than that fraction (the result is then feasible, and no worse than the pass before), which the
caller reports. Cost comparisons use the in-memory solver's tolerance
(1e-9 of the largest row-normalised cost).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from routing.assignment import _negative_cycle, _rank_within, balanced_assign_costs, spare_edges

Log = Callable[[str], None]
POOL_DOCS = 65_536  # documents solved exactly at once, at most (bounds the (pool, k) matrix held)
MAX_PASSES = 100


@dataclass
class ChunkedCosts:
    """An (n, k) cost matrix that is never materialised: `rows(a, b)` computes rows [a, b),
    `take(idx)` the rows of sorted document indices; both return float64."""

    n: int
    k: int
    chunk: int
    rows: Callable[[int, int], np.ndarray]
    take: Callable[[np.ndarray], np.ndarray]

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")

    def chunks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(start, rows) of each chunk, every row shifted by its minimum: the same optimum, and
        the same normalisation as `balanced_assign_costs`, so tolerances agree."""
        for start in range(0, self.n, self.chunk):
            c = self.rows(start, min(start + self.chunk, self.n))
            yield start, c - c.min(axis=1, keepdims=True)

    def at(self, idx: np.ndarray) -> np.ndarray:
        c = self.take(idx)
        return c - c.min(axis=1, keepdims=True)


def feature_costs(features: Any, cost: Callable[[torch.Tensor], torch.Tensor],
                  k: int, chunk: int) -> ChunkedCosts:
    """`ChunkedCosts` of `cost(features[rows])` (e.g. squared distances to the centroids) over a
    2-D array that may be a numpy memmap: only the rows asked for are read."""
    n = len(features)

    def compute(x: object) -> np.ndarray:
        return cost(torch.as_tensor(np.asarray(x))).detach().cpu().double().numpy()

    return ChunkedCosts(n, k, chunk, rows=lambda a, b: compute(features[a:b]),
                        take=lambda idx: compute(features[idx]))


@dataclass
class ChunkedAssignment:
    labels: np.ndarray  # (N,) int64
    cost: float  # total cost of the assignment (the costs as given, not row-normalised)
    passes: int  # passes over the chunks after the first assignment
    optimal: bool  # True: minimum total cost under the bounds, proven by the last pass


def _check_bounds(n: int, k: int, cap: int | Sequence[int] | np.ndarray,
                  floor: int | Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cap_np = np.broadcast_to(np.asarray(cap, dtype=np.int64), (k,)).copy()
    floor_np = np.broadcast_to(np.asarray(floor, dtype=np.int64), (k,)).copy()
    if cap_np.sum() < n or floor_np.sum() > n or (floor_np > cap_np).any():
        raise ValueError(f"infeasible bounds for N={n} documents in {k} clusters: "
                         f"sum(cap)={cap_np.sum()}, sum(floor)={floor_np.sum()}")
    return cap_np, floor_np


def _shift(costs: ChunkedCosts, prices: np.ndarray | None) -> np.ndarray:
    return np.zeros(costs.k) if prices is None else np.asarray(prices, dtype=np.float64)


def priced_labels(costs: ChunkedCosts, prices: np.ndarray | None) -> tuple[np.ndarray, float]:
    """argmin_j cost - price of every document, and the solver's tolerance (1e-9 of the largest
    row-normalised cost, as `balanced_assign_costs` uses)."""
    labels = np.empty(costs.n, dtype=np.int64)
    top = 0.0
    shift = _shift(costs, prices)
    for start, c in costs.chunks():
        labels[start : start + len(c)] = (c - shift).argmin(axis=1)
        top = max(top, float(c.max()))
    return labels, 1e-9 * (top + 1e-30)


def _merge_smallest_flat(vals: np.ndarray, docs: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    if vals.size <= budget:
        return vals, docs
    keep = np.argpartition(vals, budget - 1)[:budget]
    return vals[keep], docs[keep]


def boundary_pool(costs: ChunkedCosts, labels: np.ndarray, prices: np.ndarray | None, budget: int) -> np.ndarray:
    """Sorted indices of the ``budget`` documents of smallest margin: each document's cheapest other
    priced cost minus its own cluster's. Small: a small error in the prices would move it; negative:
    the repair moved it off its priced best. Selected chunk by chunk, so memory is O(budget + chunk):
    an (N,) array of margins and the (N,) int64 argpartition of it were 120 MB at 10M documents."""
    if costs.n <= budget:
        return np.arange(costs.n)
    shift = _shift(costs, prices)
    best_vals, best_docs = np.empty(0, dtype=np.float32), np.empty(0, dtype=np.int64)
    for start, c in costs.chunks():
        priced = c - shift
        rows = np.arange(len(c))
        own = labels[start : start + len(c)]
        mine = priced[rows, own].copy()
        priced[rows, own] = math.inf
        vals, docs = _merge_smallest_flat((priced.min(axis=1) - mine).astype(np.float32), rows + start, budget)
        best_vals, best_docs = _merge_smallest_flat(np.concatenate([best_vals, vals]),
                                                    np.concatenate([best_docs, docs]), budget)
    return np.sort(best_docs)


def solve_boundary(costs: ChunkedCosts, labels: np.ndarray, prices: np.ndarray | None, cap: np.ndarray,
                   floor: np.ndarray, budget: int, log: Log | None = None) -> None:
    """In place: re-solve exactly the `budget` documents of smallest margin (`boundary_pool`), every other
    document fixed where it is. With good prices the optimum differs from the priced assignment only
    near the boundaries, so this lands on it or next to it, in one (budget, k) solve instead of many
    passes. The assignment given is feasible, so the pool's reduced bounds are too."""
    k = costs.k
    pool = boundary_pool(costs, labels, prices, budget)
    fixed = np.bincount(labels, minlength=k) - np.bincount(labels[pool], minlength=k)
    pool_cap, pool_floor = cap - fixed, np.maximum(floor - fixed, 0)
    labels[pool] = balanced_assign_costs(costs.at(pool), pool_cap, pool_floor, start=labels[pool]).numpy()
    if log is not None:
        log(f"balanced assignment: {pool.size:,} boundary documents solved exactly")


def _keep_cheapest(docs: np.ndarray, target: np.ndarray, extra: np.ndarray, source: np.ndarray,
                   give: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The candidates a greedy pass can still use, cheapest first: at most give[a] per source a.
    Stable, so equal costs keep document order, as in the in-memory repair."""
    order = np.argsort(extra, kind="stable")
    docs, target, extra, source = docs[order], target[order], extra[order], source[order]
    keep = _rank_within(source) < give[source]
    return docs[keep], target[keep], extra[keep], source[keep]


def _greedy_pass(costs: ChunkedCosts, labels: np.ndarray, give: np.ndarray, take: np.ndarray) -> None:
    """`routing.assignment._greedy_moves` over chunks: each document of a cluster with give > 0 finds
    its cheapest cluster with take > 0; cheapest moves first, within each give and take."""
    open_ = np.flatnonzero(take > 0)
    empty = np.empty(0, dtype=np.int64)
    kept: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = (empty, empty, np.empty(0), empty)
    for start, c in costs.chunks():
        lab = labels[start : start + len(c)]
        rows = np.flatnonzero(give[lab] > 0)
        if not rows.size:
            continue
        extra = c[np.ix_(rows, open_)] - c[rows, lab[rows]][:, None]
        best = extra.argmin(axis=1)
        new = (rows + start, open_[best], extra[np.arange(rows.size), best], lab[rows])
        docs, target, extra_cost, source = (np.concatenate([old, add]) for old, add in zip(kept, new))
        kept = _keep_cheapest(docs, target, extra_cost, source, give)
    docs, target, _, source = kept  # sorted by extra cost, at most give[a] per source
    ok = (_rank_within(source) < give[source]) & (_rank_within(target) < take[target])
    labels[docs[ok]] = target[ok]


def repair(costs: ChunkedCosts, labels: np.ndarray, cap: np.ndarray, floor: np.ndarray, log: Log | None = None) -> int:
    """In place: make floor <= sizes <= cap, as `routing.assignment._repair` does. Returns the passes."""
    passes = 0
    for bound in ("cap", "floor"):
        while True:
            counts = np.bincount(labels, minlength=costs.k)
            give = np.maximum(counts - cap, 0) if bound == "cap" else np.maximum(counts - floor, 0)
            take = np.maximum(cap - counts, 0) if bound == "cap" else np.maximum(floor - counts, 0)
            if not (give if bound == "cap" else take).any():
                break
            if log is not None:
                log(f"balanced assignment: {int((give if bound == 'cap' else take).sum()):,} documents "
                    f"to move for the {bound}s (pass {passes + 1})")
            _greedy_pass(costs, labels, give, take)  # moves at least one document
            passes += 1
    return passes


def _merge_smallest(vals: np.ndarray, docs: np.ndarray, new_vals: np.ndarray, new_docs: np.ndarray,
                    m: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise the m smallest of two (k, *) value arrays, with their documents."""
    v = np.concatenate([vals, new_vals], axis=1)
    d = np.concatenate([docs, new_docs], axis=1)
    if v.shape[1] > m:
        part = np.argpartition(v, m - 1, axis=1)[:, :m]
        v, d = np.take_along_axis(v, part, axis=1), np.take_along_axis(d, part, axis=1)
    return v, d


def cheapest_moves(costs: ChunkedCosts, labels: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, float]:
    """One pass: (k, k, m) costs of the m cheapest moves of a document from cluster a to cluster b,
    the (k, k, m) documents (-1: none), and the assignment's total row-normalised cost."""
    k = costs.k
    vals = np.full((k, k, m), math.inf)
    docs = np.full((k, k, m), -1, dtype=np.int64)
    total = 0.0
    for start, c in costs.chunks():
        lab = labels[start : start + len(c)]
        own = c[np.arange(len(c)), lab]
        total += float(own.sum())
        delta = c - own[:, None]
        order = np.argsort(lab, kind="stable")
        bounds = np.searchsorted(lab[order], np.arange(k + 1))
        for a in np.flatnonzero(np.diff(bounds)):
            rows = order[bounds[a] : bounds[a + 1]]
            sub = delta[rows]  # (n_a, k)
            if rows.size > m:
                part = np.argpartition(sub, m - 1, axis=0)[:m]
                sub, rows_m = np.take_along_axis(sub, part, axis=0), rows[part]
            else:
                rows_m = np.broadcast_to(rows[:, None], sub.shape)
            vals[a], docs[a] = _merge_smallest(vals[a], docs[a], sub.T, (rows_m + start).T, m)
    diag = np.arange(k)
    vals[diag, diag], docs[diag, diag] = math.inf, -1  # staying put is no move
    return vals, docs, total


def _resolve_pool(costs: ChunkedCosts, labels: np.ndarray, pool: np.ndarray, cap: np.ndarray,
                  floor: np.ndarray) -> float:
    """Re-solve the pooled documents exactly with every other document fixed; returns the cost saved."""
    k = costs.k
    c = costs.at(pool)
    old = labels[pool]
    fixed = np.bincount(labels, minlength=k) - np.bincount(old, minlength=k)
    new = balanced_assign_costs(c, cap - fixed, np.maximum(floor - fixed, 0), start=old).numpy()
    rows = np.arange(pool.size)
    saved = float(c[rows, old].sum() - c[rows, new].sum())
    if saved > 0:
        labels[pool] = new
    return saved


def improve(costs: ChunkedCosts, labels: np.ndarray, cap: np.ndarray, floor: np.ndarray, tol: float,
            pool_docs: int = POOL_DOCS, max_passes: int = MAX_PASSES, log: Log | None = None,
            min_gain: float = 0.0) -> tuple[int, bool]:
    """In place: a feasible assignment improved to minimum total cost (module docstring, step 4).
    Returns the passes made and whether the last one proved optimality. ``min_gain`` > 0 stops early,
    not proven optimal, after a pass that lowered the total cost (as given: the inertia, not the
    row-shifted cost the passes compare) by less than that fraction of it."""
    k = costs.k
    m = int(np.clip(pool_docs // (k * k), 1, 64))  # cheapest documents kept per pair of clusters
    w = np.full((k + 1, k + 1), math.inf)
    enough = min_gain * abs(total_cost(costs, labels)) if min_gain > 0 else 0.0
    for passes in range(1, max_passes + 1):
        vals, docs, total = cheapest_moves(costs, labels, m)
        w[:k, :k] = vals.min(axis=2)
        spare_edges(w, np.bincount(labels, minlength=k), cap, floor)
        if _negative_cycle(w, tol) is None:
            return passes, True
        pool = np.unique(docs[docs >= 0])
        saved = _resolve_pool(costs, labels, pool, cap, floor)
        if log is not None:
            log(f"balanced assignment pass {passes}: {pool.size:,} boundary documents re-solved, "
                f"cost {total:.6g} -> {total - max(saved, 0.0):.6g}")
        if saved <= tol:  # the pool could not use the cycle: stop rather than loop (flagged not optimal)
            return passes, False
        if min_gain > 0 and saved < enough:  # each pass reads the whole corpus; this one was not worth it
            return passes, False
    return max_passes, False


def total_cost(costs: ChunkedCosts, labels: np.ndarray) -> float:
    """Sum of cost[d, labels[d]] over all documents, as given (not row-normalised), chunk by chunk."""
    total = 0.0
    for a in range(0, costs.n, costs.chunk):
        c = costs.rows(a, min(a + costs.chunk, costs.n))
        total += float(c[np.arange(len(c)), labels[a : a + len(c)]].sum())
    return total


def chunked_balanced_assign(
    costs: ChunkedCosts,
    cap: int | Sequence[int] | np.ndarray,
    floor: int | Sequence[int] | np.ndarray = 0,
    prices: np.ndarray | None = None,
    *,
    pool_docs: int = POOL_DOCS,
    max_passes: int = MAX_PASSES,
    min_gain: float = 0.0,
    log: Log | None = None,
) -> ChunkedAssignment:
    """Assign each of `costs.n` documents to one of `costs.k` clusters with floor <= sizes <= cap and
    minimum total cost, reading the costs chunk by chunk (module docstring: method and guarantee).
    ValueError if no assignment can satisfy the bounds; RuntimeError if the result would violate
    them (a bug)."""
    started = time.monotonic()
    n, k = costs.n, costs.k
    cap_np, floor_np = _check_bounds(n, k, cap, floor)
    labels, tol = priced_labels(costs, prices)
    passes = repair(costs, labels, cap_np, floor_np, log)
    solve_boundary(costs, labels, prices, cap_np, floor_np, pool_docs, log)
    more, optimal = improve(costs, labels, cap_np, floor_np, tol, pool_docs, max_passes, log, min_gain)
    counts = np.bincount(labels, minlength=k)
    if (counts > cap_np).any() or (counts < floor_np).any():
        raise RuntimeError(f"chunked balanced assignment violated its bounds: sizes {counts.tolist()}")
    total = total_cost(costs, labels)
    if log is not None:
        log(f"balanced assignment of {n:,} documents to {k} clusters in chunks of {costs.chunk:,}: "
            f"{passes + more} passes, {'optimal' if optimal else 'feasible, not proven optimal'}, "
            f"cost {total:.6g}, {time.monotonic() - started:.1f}s")
    return ChunkedAssignment(labels, total, passes + more, optimal)
