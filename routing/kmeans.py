"""k-means in torch, and the assignment rules built on it.

- `kmeans`: greedy k-means++ init, Lloyd iterations (or minibatch updates), `n_init`
  restarts keeping the lowest inertia, euclidean or cosine (spherical) metric, any device.
  Deterministic for a given seed on CPU (CUDA's index_add_ sums in a nondeterministic order).
- `balanced_assign` / `balanced_kmeans`: c-BTM-style capacity-constrained assignment, each
  cluster holding at most ceil(N/k * (1 + slack)) documents, guaranteed (solved exactly as a
  min-cost flow by `routing.assignment`).
- `product_kmeans`: one k-means per contiguous group of feature dims; a document's path is
  the mixed-radix number of its per-level clusters (level 0 most significant), the same
  numbering as the trainer's topology.
- `topk_assign`: the k nearest clusters of each document (overlapping training shards).

Distances are squared euclidean, computed as ||x||^2 - 2 x.c + ||c||^2 with one matmul per
chunk of rows, so memory stays bounded for large N. With metric "cosine", features and
centroids are L2-normalised and the same squared distance is used (it equals 2 - 2 cos).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from routing.assignment import balanced_assign_costs, capacity, floor_size
from routing.validate import Features, as_features

Metric = Literal["euclidean", "cosine"]
METRICS = ("euclidean", "cosine")

# Rows per chunk are chosen so one (rows, k) distance block has about this many floats (16 MB).
CHUNK_ELEMENTS = 1 << 22

Log = Callable[[str], None]
LOG_EVERY_S = 10.0  # a long fit reports its iterations this often, so a large corpus never goes silent


class _Throttled:
    """Passes a message on to `log` when LOG_EVERY_S have passed since the last one (or none is set)."""

    def __init__(self, log: Log | None):
        self.log, self.last = log, time.monotonic()

    def __call__(self, message: Callable[[], str]) -> None:
        if self.log is not None and time.monotonic() - self.last >= LOG_EVERY_S:
            self.log(message())
            self.last = time.monotonic()


# ----------------------------------------------------------------------------------------
# Distances


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")


def prepare(x: torch.Tensor, metric: str) -> torch.Tensor:
    """Features as the metric sees them: unit rows for cosine (zero rows stay zero)."""
    check_metric(metric)
    return F.normalize(x, dim=1) if metric == "cosine" else x


def _chunk_rows(k: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(k, 1))


def sq_distances(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Full (N, k) squared euclidean distances (for scores and balanced assignment)."""
    out = torch.addmm((c * c).sum(1), x, c.T, alpha=-2.0)
    out += (x * x).sum(1, keepdim=True)
    return out.clamp_min_(0.0)  # cancellation can leave tiny negatives


def nearest(
    x: torch.Tensor, c: torch.Tensor, x_sq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the nearest centroid and the squared distance to it, chunk by chunk."""
    if x_sq is None:
        x_sq = (x * x).sum(1)
    c_sq = (c * c).sum(1)
    labels = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    dists = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    step = _chunk_rows(c.shape[0])
    for s in range(0, x.shape[0], step):
        # ||x||^2 is constant per row, so the argmin only needs ||c||^2 - 2 x.c
        d = torch.addmm(c_sq, x[s : s + step], c.T, alpha=-2.0)
        m, labels[s : s + step] = d.min(dim=1)
        dists[s : s + step] = (m + x_sq[s : s + step]).clamp_min_(0.0)
    return labels, dists


def nearest_centroid(
    features: Features, centroids: torch.Tensor, metric: Metric = "euclidean"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Public nearest-centroid rule: (labels, squared distances) of each row of `features`."""
    x = prepare(as_features(features), metric)
    c = prepare(as_features(centroids, "centroids").to(x.device), metric)
    return nearest(x, c)


# ----------------------------------------------------------------------------------------
# k-means


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # (k, D) float32, on CPU; unit rows for cosine
    labels: torch.Tensor  # (N,) long, on CPU
    inertia: float  # sum of squared distances to the assigned centroid (metric space)
    n_iter: int  # Lloyd iterations (or minibatch epochs) of the kept run
    metric: str = "euclidean"


def kmeans_plus_plus(
    x: torch.Tensor, x_sq: torch.Tensor, k: int, gen: torch.Generator
) -> torch.Tensor:
    """Greedy k-means++: sample a few candidates per step, keep the one lowering the potential most.

    The greedy variant (several local trials) gives noticeably better starts than plain
    k-means++, so Lloyd needs fewer iterations and fewer restarts.
    """
    n = x.shape[0]
    trials = 2 + int(math.log(k))
    first = int(torch.randint(n, (1,), generator=gen, device=gen.device).item())
    idx = [first]
    closest = (x_sq + x_sq[first] - 2.0 * (x @ x[first])).clamp_min_(0.0)
    for _ in range(1, k):
        # Sample proportionally to the squared distance to the closest chosen centre;
        # cumulative sums in float64 so large N keeps its resolution.
        cum = closest.cumsum(0, dtype=torch.float64)
        r = torch.rand(trials, generator=gen, device=gen.device, dtype=torch.float64) * cum[-1]
        cand = torch.searchsorted(cum, r).clamp_max_(n - 1)
        # Squared distances to the candidates, reusing ||x||^2; then the potential of each.
        d = torch.addmm(x_sq[cand], x, x[cand].T, alpha=-2.0).add_(x_sq.unsqueeze(1))
        d = torch.minimum(d, closest.unsqueeze(1))
        best = int(d.sum(0).argmin().item())
        closest = d[:, best].clamp_min(0.0)
        idx.append(int(cand[best].item()))
    return x[torch.tensor(idx, device=x.device)].clone()


def _update_centers(
    x: torch.Tensor,
    labels: torch.Tensor,
    dists: torch.Tensor,
    k: int,
    cosine: bool,
) -> torch.Tensor:
    """Mean of each cluster; empty clusters restart at the points farthest from their centre."""
    counts = torch.bincount(labels, minlength=k)
    sums = torch.zeros(k, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, labels, x)
    centers = sums / counts.clamp_min(1).unsqueeze(1).to(x.dtype)
    empty = torch.nonzero(counts == 0).flatten()
    if empty.numel():
        far = dists.topk(empty.numel()).indices
        centers[empty] = x[far]
    return F.normalize(centers, dim=1) if cosine else centers


def _lloyd(
    x: torch.Tensor, x_sq: torch.Tensor, centers: torch.Tensor, max_iter: int, tol: float, cosine: bool,
    report: _Throttled,
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    prev = math.inf
    it = 0
    for it in range(1, max_iter + 1):
        labels, dists = nearest(x, centers, x_sq)
        inertia = float(dists.sum(dtype=torch.float64))
        centers = _update_centers(x, labels, dists, centers.shape[0], cosine)
        report(lambda: f"k-means iteration {it}/{max_iter}: inertia {inertia:.6g}")
        # Relative inertia change; the inertia is of the centres before this update.
        if abs(prev - inertia) <= tol * max(inertia, 1e-30):
            break
        prev = inertia
    labels, dists = nearest(x, centers, x_sq)
    return centers, labels, float(dists.sum(dtype=torch.float64)), it


def _minibatch(
    x: torch.Tensor,
    x_sq: torch.Tensor,
    centers: torch.Tensor,
    batch_size: int,
    max_iter: int,
    tol: float,
    cosine: bool,
    gen: torch.Generator,
    report: _Throttled,
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Minibatch k-means (Sculley 2010): each centre is the running mean of the points it won."""
    n, k = x.shape[0], centers.shape[0]
    counts = torch.zeros(k, dtype=x.dtype, device=x.device)
    prev = math.inf
    epoch = 0
    for epoch in range(1, max_iter + 1):
        perm = torch.randperm(n, generator=gen, device=gen.device).to(x.device)
        total = 0.0
        for s in range(0, n, batch_size):
            b = perm[s : s + batch_size]
            xb = x[b]
            labels, dists = nearest(xb, centers, x_sq[b])
            total += float(dists.sum(dtype=torch.float64))
            bc = torch.bincount(labels, minlength=k).to(x.dtype)
            sums = torch.zeros_like(centers).index_add_(0, labels, xb)
            counts += bc
            # c <- c + (sum_b - n_b c) / count: per-centre learning rate 1/count.
            centers = centers + (sums - bc.unsqueeze(1) * centers) / counts.clamp_min(1).unsqueeze(1)
            if cosine:
                centers = F.normalize(centers, dim=1)
        never = torch.nonzero(counts == 0).flatten()
        if never.numel():  # centres no point has chosen yet: restart at far points of the last batch
            never = never[: dists.numel()]
            centers[never] = xb[dists.topk(never.numel()).indices]
        report(lambda: f"minibatch k-means epoch {epoch}/{max_iter}: inertia {total:.6g}")
        if abs(prev - total) <= tol * max(total, 1e-30):
            break
        prev = total
    labels, dists = nearest(x, centers, x_sq)  # final full assignment
    return centers, labels, float(dists.sum(dtype=torch.float64)), epoch


def kmeans(
    features: Features,
    k: int,
    *,
    metric: Metric = "euclidean",
    n_init: int = 1,
    max_iter: int = 300,
    tol: float = 1e-4,
    batch_size: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    log: Log | None = None,
) -> KMeansResult:
    """Cluster `features` (N, D) into k clusters; deterministic for a given seed and device.

    Stops when the relative change of inertia between iterations is <= tol, or after
    max_iter iterations (epochs in minibatch mode, `batch_size` not None). `log` gets a line per
    fit and, during a long one, a line every LOG_EVERY_S seconds.
    """
    x = prepare(as_features(features), metric).to(device)
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, N={n}], got k={k}")
    if n_init < 1:
        raise ValueError(f"n_init must be >= 1, got {n_init}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    cosine = metric == "cosine"
    x_sq = (x * x).sum(1)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    best: KMeansResult | None = None
    report = _Throttled(log)
    for init in range(n_init):
        start = time.monotonic()
        if batch_size is None:
            centers = kmeans_plus_plus(x, x_sq, k, gen)
            centers, labels, inertia, it = _lloyd(x, x_sq, centers, max_iter, tol, cosine, report)
        else:
            # Seed on a sample: k-means++ over all of a huge N would cost more than the fit.
            m = min(n, max(3 * batch_size, 10 * k))
            sample = torch.randperm(n, generator=gen, device=gen.device)[:m].to(x.device)
            centers = kmeans_plus_plus(x[sample], x_sq[sample], k, gen)
            centers, labels, inertia, it = _minibatch(
                x, x_sq, centers, batch_size, max_iter, tol, cosine, gen, report
            )
        if log is not None:
            log(f"k-means k={k} on {n:,} x {x.shape[1]}, start {init + 1}/{n_init}: {it} "
                f"{'epochs' if batch_size else 'iterations'}, inertia {inertia:.6g}, {time.monotonic() - start:.1f}s")
        if best is None or inertia < best.inertia:
            best = KMeansResult(centers.cpu(), labels.cpu(), inertia, it, metric)
    assert best is not None
    return best


# ----------------------------------------------------------------------------------------
# Balanced (capacity-constrained) assignment


def balanced_assign(
    features: Features,
    centroids: torch.Tensor,
    slack: float = 0.0,
    metric: Metric = "euclidean",
    min_fraction: float = 0.0,
) -> torch.Tensor:
    """Nearest-centroid assignment under a hard capacity of ceil(N/k * (1 + slack)) per cluster
    and a floor of floor(N/k * min_fraction) (see `floor_size`).

    slack=0 imposes floor(N/k) per cluster, so sizes differ by at most 1.
    Minimises the total squared distance subject to those bounds.
    """
    x = prepare(as_features(features), metric)
    c = prepare(as_features(centroids, "centroids").to(x.device), metric)
    n, k = x.shape[0], c.shape[0]
    return balanced_assign_costs(sq_distances(x, c), capacity(n, k, slack), floor_size(n, k, slack, min_fraction))


@dataclass
class BalancedKMeansResult(KMeansResult):
    unbalanced_inertia: float = math.nan  # inertia of the plain k-means it started from

    @property
    def inertia_cost(self) -> float:
        """Relative inertia paid for balance: balanced / unbalanced - 1."""
        return self.inertia / self.unbalanced_inertia - 1.0


def balanced_kmeans(
    features: Features,
    k: int,
    slack: float = 0.0,
    *,
    metric: Metric = "euclidean",
    min_fraction: float = 0.0,
    n_iter: int = 20,
    seed: int = 0,
    device: str | torch.device = "cpu",
    log: Log | None = None,
    **kmeans_kwargs,
) -> BalancedKMeansResult:
    """Plain k-means, then alternate balanced assignment and centroid update.

    Each step can only lower the (capacity-constrained) inertia, so this converges; it stops
    when the assignment no longer changes, when the inertia improves by less than `tol`
    (relative, as in `kmeans`), or after n_iter rounds.
    """
    x = prepare(as_features(features), metric).to(device)
    tol = kmeans_kwargs.get("tol", 1e-4)
    base = kmeans(x, k, metric=metric, seed=seed, device=device, log=log, **kmeans_kwargs)
    start, report = time.monotonic(), _Throttled(log)
    centers = base.centroids.to(x.device)
    labels = balanced_assign(x, centers, slack, metric, min_fraction).to(x.device)
    inertia = float(((x - centers[labels]) ** 2).sum(dtype=torch.float64))
    it = 0
    for it in range(1, n_iter + 1):
        dists = ((x - centers[labels]) ** 2).sum(1)
        centers = _update_centers(x, labels, dists, k, metric == "cosine")
        new = balanced_assign(x, centers, slack, metric, min_fraction).to(x.device)
        prev, inertia = inertia, float(((x - centers[new]) ** 2).sum(dtype=torch.float64))
        done = torch.equal(new, labels) or prev - inertia <= tol * inertia
        labels = new
        report(lambda: f"balanced k-means round {it}/{n_iter}: inertia {inertia:.6g}")
        if done:
            break
    if log is not None:
        change = inertia / base.inertia - 1 if base.inertia > 0 else 0.0
        log(f"balanced k-means (slack {slack}): {it} rounds, inertia {inertia:.6g} ({change:+.1%} against "
            f"plain k-means), {time.monotonic() - start:.1f}s")
    return BalancedKMeansResult(
        centers.cpu(), labels.cpu(), inertia, it, metric, unbalanced_inertia=base.inertia
    )


# ----------------------------------------------------------------------------------------
# Product k-means and mixed-radix path numbers


def mixed_radix_encode(digits, radices: Sequence[int]):
    """Path index of per-level digits, level 0 most significant: ((d0*r1 + d1)*r2 + d2)...

    `digits` is a sequence of L ints (returns an int) or a (..., L) tensor (returns (...)).
    """
    d = torch.as_tensor(digits, dtype=torch.long)
    if d.shape[-1:] != (len(radices),):
        raise ValueError(f"expected {len(radices)} digits per path, got shape {tuple(d.shape)}")
    r = torch.as_tensor(list(radices), dtype=torch.long)
    if bool((d < 0).any()) or bool((d >= r).any()):
        raise ValueError(f"digits out of range for radices {list(radices)}")
    index = torch.zeros(d.shape[:-1], dtype=torch.long)
    for level, radix in enumerate(radices):
        index = index * radix + d[..., level]
    return int(index) if d.dim() == 1 else index


def mixed_radix_decode(index, radices: Sequence[int]):
    """Inverse of `mixed_radix_encode`: an int gives a list of L ints, a tensor gives (..., L)."""
    i = torch.as_tensor(index, dtype=torch.long)
    total = math.prod(radices)
    if bool((i < 0).any()) or bool((i >= total).any()):
        raise ValueError(f"path index out of range [0, {total}) for radices {list(radices)}")
    digits = []
    for radix in reversed(radices):
        digits.append(i % radix)
        i = torch.div(i, radix, rounding_mode="floor")
    out = torch.stack(digits[::-1], dim=-1)
    return out.tolist() if out.dim() == 1 else out


def split_dims(dim: int, levels: int) -> list[tuple[int, int]]:
    """[start, end) of `levels` contiguous groups of `dim` features, sizes differing by <= 1."""
    if not 1 <= levels <= dim:
        raise ValueError(f"cannot split {dim} feature dims into {levels} levels")
    base, extra = divmod(dim, levels)
    bounds, start = [], 0
    for level in range(levels):
        end = start + base + (1 if level < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class ProductKMeansResult:
    centroids: list[torch.Tensor]  # one (ks[l], dims of group l) tensor per level
    digits: torch.Tensor  # (N, L) long: cluster of each document at each level
    paths: torch.Tensor  # (N,) long: mixed_radix_encode(digits, ks)
    inertia: list[float]  # per level
    radices: list[int]
    metric: str = "euclidean"


def product_kmeans(
    features: Features,
    ks: Sequence[int],
    *,
    metric: Metric = "euclidean",
    seed: int = 0,
    **kmeans_kwargs,
) -> ProductKMeansResult:
    """Product k-means (DiPaCo §2): level l clusters feature group l into ks[l] centroids.

    With cosine, each group is normalised on its own, so each level is a spherical k-means.
    """
    x = as_features(features)
    results = [
        kmeans(x[:, a:b], k, metric=metric, seed=seed + level, **kmeans_kwargs)
        for level, ((a, b), k) in enumerate(zip(split_dims(x.shape[1], len(ks)), ks))
    ]
    digits = torch.stack([r.labels for r in results], dim=1)
    return ProductKMeansResult(
        centroids=[r.centroids for r in results],
        digits=digits,
        paths=mixed_radix_encode(digits, ks),
        inertia=[r.inertia for r in results],
        radices=list(ks),
        metric=metric,
    )


def topk_assign(
    features: Features, centroids: torch.Tensor, k: int, metric: Metric = "euclidean"
) -> torch.Tensor:
    """(N, k) indices of each document's k nearest centroids, nearest first."""
    x = prepare(as_features(features), metric)
    c = prepare(as_features(centroids, "centroids").to(x.device), metric)
    if not 1 <= k <= c.shape[0]:
        raise ValueError(f"k must be in [1, {c.shape[0]}] (number of centroids), got {k}")
    step = _chunk_rows(c.shape[0])
    return torch.cat(
        [sq_distances(x[s : s + step], c).topk(k, dim=1, largest=False).indices
         for s in range(0, x.shape[0], step)]
    ).cpu()
