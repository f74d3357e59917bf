"""Capacity-constrained assignment: N documents to k clusters, floor <= sizes <= cap, minimum cost.

This is c-BTM's balancing step, solved exactly as a min-cost flow (transportation problem)
on a dense cost matrix (N, k), e.g. squared distances to centroids or negative router scores:

1. every document takes its cheapest cluster;
2. a greedy repair moves the cheapest documents out of overfull clusters (and into clusters
   below their floor) until every bound holds: from here on the assignment is feasible;
3. negative-cycle canceling on the small residual graph of clusters improves it to the
   optimum: a negative cycle a -> b -> ... -> a is a chain of document moves that keeps all
   sizes within bounds and lowers the total cost; when none is left the cost is minimal.

The capacity is therefore guaranteed by construction (and verified before returning), not
likely. The work is many small steps over a (k+1)-node graph, so it runs in numpy on the
CPU, where per-call overhead is far below torch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from routing.validate import check_finite


def capacity(n: int, k: int, slack: float) -> int:
    """Most documents a cluster may hold: ceil(N/k * (1 + slack))."""
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    return math.ceil(n * (1.0 + slack) / k - 1e-9)  # 1e-9: 0.1 is not exact in binary


def floor_size(n: int, k: int, slack: float, min_fraction: float = 0.0) -> int:
    """Fewest documents a cluster must hold: floor(N/k) when slack is 0 (sizes then differ by at most
    one), else floor(N/k * min_fraction). The cap alone lets a cluster shrink to a handful of
    documents, too few to train a path on; product k-means cells, which no level fits to the joint
    data, do so readily."""
    if not 0.0 <= min_fraction <= 1.0:
        raise ValueError(f"min_fraction must be in [0, 1], got {min_fraction}")
    return n // k if slack == 0 else math.floor(n * min_fraction / k + 1e-9)


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """Position of each element among the elements of its group, in input order."""
    perm = np.argsort(groups, kind="stable")
    sorted_g = groups[perm]
    start = np.searchsorted(sorted_g, sorted_g)  # first position of each element's group
    rank = np.empty_like(groups)
    rank[perm] = np.arange(groups.size) - start
    return rank


def _greedy_moves(labels: np.ndarray, cost: np.ndarray, give: np.ndarray, take: np.ndarray) -> None:
    """Move documents out of clusters with give > 0 into clusters with take > 0, cheapest first.

    At most give[c] leave and take[c] arrive per cluster; at least one document moves
    whenever some give and take are positive, so callers can loop until done.
    """
    cand = np.flatnonzero(give[labels] > 0)
    open_ = np.flatnonzero(take > 0)
    extra = cost[np.ix_(cand, open_)] - cost[cand, labels[cand]][:, None]
    best = extra.argmin(axis=1)
    order = np.argsort(extra[np.arange(cand.size), best], kind="stable")
    cand, target = cand[order], open_[best[order]]
    source = labels[cand]
    ok = (_rank_within(source) < give[source]) & (_rank_within(target) < take[target])
    labels[cand[ok]] = target[ok]


def _repair(labels: np.ndarray, cost: np.ndarray, cap: np.ndarray, floor: np.ndarray) -> None:
    """In place: make floor <= sizes <= cap (feasible whenever sum(floor) <= N <= sum(cap))."""
    k = cost.shape[1]
    while True:
        counts = np.bincount(labels, minlength=k)
        give = np.maximum(counts - cap, 0)
        if not give.any():
            break
        _greedy_moves(labels, cost, give, np.maximum(cap - counts, 0))
    while True:
        counts = np.bincount(labels, minlength=k)
        take = np.maximum(floor - counts, 0)
        if not take.any():
            break
        _greedy_moves(labels, cost, np.maximum(counts - floor, 0), take)


def _cycle_through_preds(pred: list[int], start: int) -> list[int] | None:
    """The cycle reached by following predecessors from `start`, in edge order, or None."""
    seen: dict[int, int] = {}
    path: list[int] = []
    v = start
    while v >= 0 and v not in seen:
        seen[v] = len(path)
        path.append(v)
        v = pred[v]
    if v < 0:
        return None
    return path[seen[v] :][::-1]  # predecessors point backwards along edges


def _negative_cycle(w: np.ndarray, tol: float, check_every: int = 4) -> list[int] | None:
    """A cycle of negative total weight in the dense graph w (inf = no edge), or None.

    Bellman-Ford from a virtual source joined to every node. A cycle in the predecessor
    graph is a negative cycle, so we look for one every few rounds instead of waiting for
    the m rounds that prove one exists. The graph has only k + 1 nodes, so numpy (no thread
    pool, tiny per-call cost) does it.
    """
    m = w.shape[0]
    dist = np.zeros(m)
    pred = np.full(m, -1)
    cols = np.arange(m)
    for it in range(1, m + 2):
        cand = dist[:, None] + w
        arg = cand.argmin(axis=0)
        best = cand[arg, cols]
        dropped = best < dist - tol
        if not dropped.any():
            return None
        dist = np.where(dropped, best, dist)
        pred = np.where(dropped, arg, pred)
        if it % check_every == 0 or it > m:
            cycle = _cycle_through_preds(pred.tolist(), int(np.flatnonzero(dropped)[0]))
            if cycle is not None:
                weight = sum(float(w[a, b]) for a, b in zip(cycle, cycle[1:] + cycle[:1]))
                if weight < -tol:
                    return cycle
    return None


def _push_along(
    cycle: list[int],
    labels: np.ndarray,
    cost: np.ndarray,
    counts: np.ndarray,
    cap: np.ndarray,
    floor: np.ndarray,
    tol: float,
) -> list[int]:
    """Move as many documents around a negative cycle as still lowers the cost (at least one).

    The t-th unit moves the t-th cheapest document on every edge, so its cost is the sum of
    the t-th smallest move costs; those sums only grow, so we stop at the first >= 0.
    Pushing many units per cycle found keeps the number of cycle searches small.
    Updates labels and counts in place; returns the clusters whose members changed.
    """
    k = cost.shape[1]
    limit = labels.size
    chosen: list[tuple[np.ndarray, np.ndarray, int, int]] = []  # (docs, move costs, from, to)
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        if a == k:  # S -> b: b gives documents away, down to its floor
            limit = min(limit, int(counts[b] - floor[b]))
        elif b == k:  # a -> S: a takes documents in, up to its cap
            limit = min(limit, int(cap[a] - counts[a]))
        else:
            members = np.flatnonzero(labels == a)
            moves = cost[members, b] - cost[members, a]
            order = np.argsort(moves, kind="stable")
            chosen.append((members[order], moves[order], a, b))
    limit = min([limit] + [c.size for _, c, _, _ in chosen])
    marginal = sum(c[:limit] for _, c, _, _ in chosen)
    units = max(1, int(np.sum(marginal < -tol)))
    for docs, _, a, b in chosen:
        labels[docs[:units]] = b
        counts[a] -= units
        counts[b] += units
    return [c for c in cycle if c < k]


def _move_costs(labels: np.ndarray, cost: np.ndarray, a: int) -> np.ndarray:
    """(k,) cheapest cost of moving one document of cluster a to each cluster (inf for a itself or
    when a is empty): row a of the residual graph."""
    members = np.flatnonzero(labels == a)
    if not members.size:
        return np.full(cost.shape[1], math.inf)
    sub = cost[members]
    row = (sub - sub[:, a : a + 1]).min(axis=0)
    row[a] = math.inf
    return row


def spare_edges(w: np.ndarray, counts: np.ndarray, cap: np.ndarray, floor: np.ndarray) -> None:
    """In place: the edges of the spare-capacity node S (the last row and column of the (k+1, k+1)
    residual graph w): S -> a when a may lose a document, a -> S when it may gain one, both free."""
    k = counts.size
    w[k, :k] = np.where(counts > floor, 0.0, math.inf)
    w[:k, k] = np.where(counts < cap, 0.0, math.inf)
    w[k, k] = math.inf


def _cancel_negative_cycles(
    labels: np.ndarray, cost: np.ndarray, cap: np.ndarray, floor: np.ndarray, max_cycles: int
) -> int:
    """In place: improve a feasible assignment to the optimum by cycle canceling (min-cost flow).

    Residual graph on the k clusters plus a node S for spare capacity: edge a -> b costs the
    cheapest move of one document from a to b; S -> a exists if a may lose a document
    (size > floor), b -> S if b may gain one (size < cap). A negative cycle is a set of
    moves that keeps every bound and lowers the total cost; none left means optimal.
    Row a of the graph depends only on a's members, so after a push only the rows of the
    clusters on the cycle are recomputed. Every step keeps the bounds, so stopping early
    (max_cycles) still returns a feasible result. Returns the number of cycles canceled.

    """
    k = cost.shape[1]
    tol = 1e-9 * (float(cost.max()) + 1e-30)
    counts = np.bincount(labels, minlength=k)
    w = np.full((k + 1, k + 1), math.inf)

    def refresh(a: int) -> None:
        w[a, :k] = _move_costs(labels, cost, a)

    for a in range(k):
        refresh(a)
    for done in range(max_cycles):
        spare_edges(w, counts, cap, floor)
        cycle = _negative_cycle(w, tol)
        if cycle is None:
            return done
        for a in _push_along(cycle, labels, cost, counts, cap, floor, tol):
            refresh(a)
    return max_cycles


def balanced_assign_costs(
    cost: torch.Tensor | np.ndarray,
    cap: int | Sequence[int] | np.ndarray,
    floor: int | Sequence[int] | np.ndarray = 0,
    max_cycles: int = 100_000,
    start: np.ndarray | None = None,
) -> torch.Tensor:
    """Assign each row of `cost` (N, k) to a column, minimising total cost, with floor <= sizes <= cap.

    `start`, a feasible assignment, is improved from instead of the cheapest columns (a warm start:
    the chunked solver re-solves a few documents that already satisfy their bounds).

    A transportation problem (min-cost flow), solved in three steps: start from the cheapest
    column, repair greedily until every bound holds, then cancel negative cycles until the
    total cost is minimal (at most `max_cycles` cycles; every intermediate result is feasible).
    The bounds are verified before returning: RuntimeError if violated (a bug), ValueError
    if no assignment can satisfy them.

    Runs in numpy on the CPU, in float64: the work is many small steps, where torch's per-call
    and thread-pool overhead would dominate, and small cost differences decide the moves.
    """
    t = torch.as_tensor(cost).detach().cpu().double()
    if t.dim() != 2:
        raise ValueError(f"cost must be 2-D (N, k), got shape {tuple(t.shape)}")
    check_finite(t, "cost")
    c = t.numpy()
    c = c - c.min(axis=1, keepdims=True)  # same optimum; makes the tolerance scale-free
    n, k = c.shape
    cap_np = np.broadcast_to(np.asarray(cap, dtype=np.int64), (k,)).copy()
    floor_np = np.broadcast_to(np.asarray(floor, dtype=np.int64), (k,)).copy()
    if cap_np.sum() < n or floor_np.sum() > n or (floor_np > cap_np).any():
        raise ValueError(
            f"infeasible bounds for N={n} documents in {k} clusters: "
            f"sum(cap)={cap_np.sum()}, sum(floor)={floor_np.sum()}"
        )
    labels = c.argmin(axis=1) if start is None else np.array(start, dtype=np.int64)
    if labels.shape != (n,) or labels.min(initial=0) < 0 or labels.max(initial=0) >= k:
        raise ValueError(f"start must hold N={n} cluster ids in [0, {k})")
    _repair(labels, c, cap_np, floor_np)
    _cancel_negative_cycles(labels, c, cap_np, floor_np, max_cycles)
    counts = np.bincount(labels, minlength=k)
    if (counts > cap_np).any() or (counts < floor_np).any():
        raise RuntimeError(f"balanced assignment violated its bounds: sizes {counts.tolist()}")
    return torch.from_numpy(labels)


def dual_prices(
    cost: torch.Tensor | np.ndarray,
    labels: np.ndarray | torch.Tensor,
    cap: int | Sequence[int] | np.ndarray,
    floor: int | Sequence[int] | np.ndarray = 0,
) -> np.ndarray:
    """(k,) per-cluster prices p of an optimal assignment: every document's cluster minimises
    cost[d, j] - p[j] over j (up to ties), the dual variables of the transportation problem.

    They are the shortest-path distances of the residual graph `_cancel_negative_cycles` builds
    (from a virtual source joined to every cluster), which exist because an optimal assignment
    leaves no negative cycle. Prices fitted on a sample transfer to the whole corpus: they are
    per-document marginal costs, so argmin(cost - p) over all documents lands near the optimum
    of the full problem (the paper's bias adjustment). If `labels` is not optimal the distances
    are those after k + 1 Bellman-Ford rounds: still a usable warm start, no longer exact.
    """
    c = torch.as_tensor(cost).detach().cpu().double().numpy()
    c = c - c.min(axis=1, keepdims=True)
    n, k = c.shape
    lab = np.asarray(labels, dtype=np.int64)
    cap_np = np.broadcast_to(np.asarray(cap, dtype=np.int64), (k,))
    floor_np = np.broadcast_to(np.asarray(floor, dtype=np.int64), (k,))
    w = np.full((k + 1, k + 1), math.inf)
    for a in range(k):
        w[a, :k] = _move_costs(lab, c, a)
    spare_edges(w, np.bincount(lab, minlength=k), cap_np, floor_np)
    dist = np.zeros(k + 1)
    for _ in range(k + 2):
        best = (dist[:, None] + w).min(axis=0)
        if not (best < dist).any():
            break
        dist = np.minimum(dist, best)
    return dist[:k]
