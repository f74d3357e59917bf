"""Which cluster becomes which path: arranging k-means clusters on a grid of shared modules.

Plain k-means numbers its P clusters arbitrarily, and path p of a grid topology goes through the modules
its mixed-radix digits name. So which clusters share a module is an accident of the k-means seed: on a
2x2 grid each path shares a module with two paths and none with the third, and the cluster that lands
diagonally opposite a cluster is the one it never shares weights with. On a flat mixture (no module
shared by some paths but not others) the numbering does not matter.

A module trains on the union of its paths' shards, so it has less to reconcile when those shards are
alike. :func:`arrange_clusters` chooses the numbering that puts alike clusters on paths that share
modules: it minimises

    cost(pi) = sum over cluster pairs c < d of  shared[pi(c), pi(d)] * dissimilarity[c, d],

where ``shared[p, q]`` is how much paths p and q share (the caller's measure, e.g. transformer blocks)
and ``dissimilarity[c, d]`` how unlike clusters c and d are (e.g. the Jensen-Shannon divergence of their
token distributions, :func:`js_divergences`). This is a quadratic assignment problem: solved exactly by
enumerating every numbering for P <= 8 (8! = 40,320), and by pairwise-swap descent from the identity
and from seeded random starts beyond that (a local optimum, never worse than the identity).

``mode="dissimilar"`` maximises the cost instead: the worst numbering, the control that measures what
the arrangement is worth. Ties keep the lower-cost numbering found first, the identity before any other,
so a topology where numbering does not matter keeps k-means' numbering.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

MODES = ("similar", "dissimilar")
EXACT_MAX_PATHS = 8  # 8! numberings, enumerated in chunks


@dataclass(frozen=True)
class Arrangement:
    perm: np.ndarray  # perm[c] = path of cluster c
    cost: float  # of perm
    identity_cost: float  # of k-means' own numbering
    exact: bool  # every numbering was compared (else a local optimum of pairwise swaps)

    def to_dict(self) -> dict:
        return {"perm": self.perm.tolist(), "cost": self.cost, "identity_cost": self.identity_cost,
                "exact": self.exact}


def _check_square(name: str, m: np.ndarray, p: int | None = None) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or (p is not None and m.shape[0] != p):
        want = f"({p}, {p})" if p is not None else "square"
        raise ValueError(f"{name} must be a {want} matrix, got shape {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError(f"{name} holds non-finite values")
    if not np.allclose(m, m.T):
        raise ValueError(f"{name} must be symmetric")
    return m


def arrangement_cost(perm: np.ndarray, shared: np.ndarray, dissimilarity: np.ndarray) -> float:
    """sum over c < d of shared[perm[c], perm[d]] * dissimilarity[c, d]."""
    s = shared[np.ix_(perm, perm)]
    return float(np.triu(s * dissimilarity, k=1).sum())


def _exact(shared: np.ndarray, dis: np.ndarray, sign: float) -> np.ndarray:
    p = shared.shape[0]
    iu = np.triu_indices(p, k=1)
    w = dis[iu]
    best, best_cost = np.arange(p), math.inf
    perms = itertools.permutations(range(p))  # the identity comes first
    while chunk := list(itertools.islice(perms, 8192)):
        a = np.asarray(chunk)
        costs = sign * (shared[a[:, iu[0]], a[:, iu[1]]] @ w)
        i = int(costs.argmin())  # argmin keeps the first of equal costs
        if costs[i] < best_cost - 1e-12:
            best, best_cost = a[i], float(costs[i])
    return best


def _swap_descent(perm: np.ndarray, shared: np.ndarray, dis: np.ndarray, sign: float) -> np.ndarray:
    perm = perm.copy()
    cost = sign * arrangement_cost(perm, shared, dis)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.combinations(range(perm.size), 2):
            trial = perm.copy()
            trial[a], trial[b] = trial[b], trial[a]
            c = sign * arrangement_cost(trial, shared, dis)
            if c < cost - 1e-12:
                perm, cost, improved = trial, c, True
    return perm


def arrange_clusters(shared: np.ndarray, dissimilarity: np.ndarray, mode: str = "similar", *, seed: int = 0,
                     restarts: int = 8) -> Arrangement:
    """The numbering of clusters as paths that puts alike clusters (``similar``) or unlike ones
    (``dissimilar``) on paths that share modules; see the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dis = _check_square("dissimilarity", dissimilarity)
    shared = _check_square("shared", shared, dis.shape[0])
    p = dis.shape[0]
    sign = 1.0 if mode == "similar" else -1.0
    identity = np.arange(p)
    if p <= EXACT_MAX_PATHS:
        perm, exact = _exact(shared, dis, sign), True
    else:
        rng = np.random.default_rng(seed)
        starts = [identity] + [rng.permutation(p) for _ in range(restarts)]
        found = [_swap_descent(s, shared, dis, sign) for s in starts]
        costs = [sign * arrangement_cost(f, shared, dis) for f in found]
        perm, exact = found[int(np.argmin(costs))], False
    return Arrangement(perm=np.asarray(perm, dtype=np.int64), cost=arrangement_cost(perm, shared, dis),
                       identity_cost=arrangement_cost(identity, shared, dis), exact=exact)


def js_divergences(counts: np.ndarray) -> np.ndarray:
    """(P, P) Jensen-Shannon divergences (nats) between the rows of a (P, V) count matrix, e.g. each
    cluster's token counts. Every row needs a positive total."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or (counts < 0).any():
        raise ValueError(f"counts must be a non-negative (P, V) matrix, got shape {counts.shape}")
    totals = counts.sum(axis=1, keepdims=True)
    if (totals <= 0).any():
        raise ValueError(f"clusters {np.flatnonzero(totals[:, 0] <= 0).tolist()} have no tokens")
    prob = counts / totals
    p = prob.shape[0]
    out = np.zeros((p, p))
    for a, b in itertools.combinations(range(p), 2):
        m = (prob[a] + prob[b]) / 2
        out[a, b] = out[b, a] = (_kl(prob[a], m) + _kl(prob[b], m)) / 2
    return out


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    nz = p > 0  # q >= p / 2 > 0 wherever p > 0
    return float(np.sum(p[nz] * np.log(p[nz] / q[nz])))
