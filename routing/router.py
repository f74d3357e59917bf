"""The Router artifact: what routing learned, saved once and reused by training and serving.

A router maps a document's feature vector to a path id in [0, num_paths). Three kinds:

- "kmeans": one centroid per path (plain k-means, one level with P = radices[0]).
- "product_kmeans": one centroid set per level over a contiguous group of feature dims
  (see `routing.kmeans.split_dims`); path = mixed-radix number of the per-level nearest
  centroids, level 0 most significant, and score(path) = -sum_l d_l(digit_l).
- "linear": a logistic-regression classifier (discriminative re-routing, DiPaCo §2.4.2):
  score = x @ weight.T + bias.

On disk a router is a directory with `router.safetensors` (centroids, classifier, the text
featurizer's arrays, feature transform) and `router.json` (everything else, including the
featurizer spec, the text featurizer's vocabulary and any topology dict the caller passed, stored
verbatim).

A router may hold a fitted `FeatureTransform` (centring, PCA whitening, L2 normalisation): its
centroids or classifier live in the transformed space, and `scores`/`assign` apply the transform
to the raw features they are given, so callers always pass what the featurizer produced.

Balancing: `assign` is always the unconstrained rule (nearest centroid / best score).
Capacity-constrained assignment (`assign_balanced`) is for sharding the training set the
router was fitted on; new documents (validation, serving prompts) are routed one at a time
and must not depend on which other documents happen to be in the same batch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from routing.assignment import balanced_assign_costs, capacity, dual_prices, floor_size
from routing.chunked import ChunkedAssignment, Log, chunked_balanced_assign, feature_costs
from routing.featurize import TEXT_MODELS, DocTopics, TfidfSvd, encoder_features, lm_prefix_features, load_encoder
from routing.kmeans import (
    Metric,
    balanced_kmeans,
    check_metric,
    kmeans,
    mixed_radix_encode,
    nearest,
    prepare,
    product_kmeans,
    split_dims,
    sq_distances,
)
from routing.transform import FeatureTransform
from routing.validate import Features, as_features

FORMAT = "dipaco-router"
FORMAT_VERSION = 1
JSON_NAME = "router.json"
TENSORS_NAME = "router.safetensors"
KINDS = ("kmeans", "product_kmeans", "linear")


class RouterFileError(ValueError):
    """A router directory is missing, incomplete, corrupt, or from an unknown format version."""


@dataclass
class Router:
    kind: str  # one of KINDS
    radices: list[int]  # per-level ks; plain k-means and linear routers usually have one level
    metric: str = "euclidean"  # for centroid kinds
    centroids: list[torch.Tensor] = field(default_factory=list)  # one (radix, dims) per level
    weight: torch.Tensor | None = None  # linear: (P, D)
    bias: torch.Tensor | None = None  # linear: (P,)
    featurizer: dict[str, Any] = field(default_factory=dict)  # e.g. {"kind": "lm_prefix", "prefix_tokens": 32}
    text_model: TfidfSvd | DocTopics | None = None  # fitted text featurizer (kinds "tfidf_svd", "doc_topics")
    balance_slack: float | None = None  # slack used to shard the training set, None = unbalanced
    balance_min_fraction: float = 0.0  # and each shard's floor, as a fraction of N/P (see floor_size)
    topology: dict[str, Any] | None = None  # caller's topology, stored verbatim
    meta: dict[str, Any] = field(default_factory=dict)  # provenance: seed, inertia, sizes...
    transform: FeatureTransform | None = None  # applied to raw features before routing

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"router kind must be one of {KINDS}, got {self.kind!r}")
        self.radices = [int(r) for r in self.radices]
        if not self.radices or min(self.radices) < 1:
            raise ValueError(f"radices must be a non-empty list of positive ints, got {self.radices}")
        check_metric(self.metric)
        if self.kind == "linear":
            self._check_linear()
        else:
            self._check_centroids()
        if self.transform is not None and self.transform.out_dim != self._routed_dim():
            raise ValueError(f"feature transform gives {self.transform.out_dim}-dim features but the "
                             f"{self.kind} router routes {self._routed_dim()}-dim ones")

    def _check_centroids(self) -> None:
        self.centroids = [as_features(c, "centroids").cpu() for c in self.centroids]
        if self.kind == "kmeans" and len(self.radices) != 1:
            raise ValueError(f"a kmeans router has one level, got radices {self.radices}")
        if len(self.centroids) != len(self.radices):
            raise ValueError(
                f"{len(self.centroids)} centroid sets for {len(self.radices)} levels {self.radices}"
            )
        for level, (c, r) in enumerate(zip(self.centroids, self.radices)):
            if c.shape[0] != r:
                raise ValueError(f"level {level}: {c.shape[0]} centroids but radix {r}")
        dims = [c.shape[1] for c in self.centroids]
        expected = [b - a for a, b in split_dims(sum(dims), len(dims))]
        if dims != expected:
            raise ValueError(f"level feature widths {dims} do not match split_dims: {expected}")

    def _check_linear(self) -> None:
        if self.weight is None or self.bias is None:
            raise ValueError("a linear router needs weight (P, D) and bias (P,)")
        self.weight = as_features(self.weight, "weight").cpu()
        self.bias = torch.as_tensor(self.bias, dtype=torch.float32).cpu()
        p = self.weight.shape[0]
        if self.bias.shape != (p,):
            raise ValueError(f"bias shape {tuple(self.bias.shape)} does not match weight {tuple(self.weight.shape)}")
        if p != self.num_paths:
            raise ValueError(f"classifier has {p} classes but radices {self.radices} give {self.num_paths} paths")

    # ------------------------------------------------------------------------------------
    # Shape of the artifact

    @property
    def num_paths(self) -> int:
        return math.prod(self.radices)

    @property
    def dim(self) -> int:
        """Feature width the router expects (the featurizer's, before any transform)."""
        return self._routed_dim() if self.transform is None else self.transform.in_dim

    def _routed_dim(self) -> int:
        if self.kind == "linear":
            assert self.weight is not None
            return int(self.weight.shape[1])
        return sum(int(c.shape[1]) for c in self.centroids)

    def check_fits(self, num_paths: int, radices: Sequence[int] | None = None) -> None:
        """Raise ValueError (naming both sides) if this router cannot shard a run with this topology.

        Path ids of "kmeans" and "linear" routers are plain indices, so any topology with the
        same number of paths fits. A product router's digits are per-level clusters, so its
        radices must equal the run's levels too.
        """
        if num_paths != self.num_paths:
            raise ValueError(
                f"router was fitted for {self.num_paths} paths (radices {self.radices}), "
                f"but the run has {num_paths} paths"
                + (f" (radices {list(radices)})" if radices is not None else "")
            )
        if radices is not None and self.kind == "product_kmeans" and list(radices) != self.radices:
            raise ValueError(
                f"product router levels {self.radices} do not match the run's levels {list(radices)}"
            )

    def renumbered(self, perm: Sequence[int], **meta: Any) -> Router:
        """The same router with cluster c routed to path ``perm[c]`` (see routing.arrange); ``meta`` is
        added to its provenance. Only a plain k-means router's numbering is free: a product router's
        path is its per-level digits, and a classifier's classes are the paths it was trained on."""
        if self.kind != "kmeans":
            raise ValueError(f"only a kmeans router can be renumbered, not a {self.kind} router")
        order = torch.as_tensor(list(perm), dtype=torch.long)
        if sorted(order.tolist()) != list(range(self.num_paths)):
            raise ValueError(f"perm must be a permutation of range({self.num_paths}), got {order.tolist()}")
        centroids = torch.empty_like(self.centroids[0])
        centroids[order] = self.centroids[0]
        return replace(self, centroids=[centroids], meta={**self.meta, **meta})

    # ------------------------------------------------------------------------------------
    # Routing

    def _features(self, features: Features) -> torch.Tensor:
        x = as_features(features)
        if x.shape[1] != self.dim:
            raise ValueError(f"router expects {self.dim}-dim features, got {x.shape[1]}")
        return x if self.transform is None else self.transform(x)

    def transformed(self, features: Features) -> torch.Tensor:
        """The features as the centroids or classifier see them (after the router's transform)."""
        return self._features(features)

    def _level_inputs(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(features, centroids) of each level, as the metric sees them, on x's device."""
        bounds = split_dims(x.shape[1], len(self.centroids))
        return [
            (prepare(x[:, a:b], self.metric), prepare(c.to(x.device), self.metric))
            for (a, b), c in zip(bounds, self.centroids)
        ]

    def scores(self, features: Features) -> torch.Tensor:
        """(N, P) scores, higher is better: negative (summed per-level) squared distances or logits."""
        return self._scores(self._features(features))

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            assert self.weight is not None and self.bias is not None
            return torch.addmm(self.bias.to(x.device), x, self.weight.to(x.device).T)
        out: torch.Tensor | None = None
        for xl, cl in self._level_inputs(x):
            d = sq_distances(xl, cl)
            # Appending a level makes it the least significant digit: (N, P_so_far, r) -> flat.
            out = -d if out is None else (out.unsqueeze(2) - d.unsqueeze(1)).flatten(1)
        assert out is not None
        return out

    def assign(self, features: Features) -> torch.Tensor:
        """Path id of each document by the unconstrained rule (for new documents)."""
        x = self._features(features)
        if self.kind == "linear":
            return self._scores(x).argmax(dim=1).cpu()
        # Per-level argmin equals the argmax of the summed scores, without the (N, P) matrix.
        digits = torch.stack([nearest(xl, cl)[0] for xl, cl in self._level_inputs(x)], dim=1)
        return mixed_radix_encode(digits.cpu(), self.radices)

    def assign_balanced(self, features: Features, slack: float | None = None) -> torch.Tensor:
        """Capacity-constrained path ids for the training set: each path <= ceil(N/P * (1+slack))
        and >= floor(N/P * balance_min_fraction).

        Uses the router's own `balance_slack` when `slack` is None (0 if that is None too).
        Minimises the summed negative score under the bounds; see `balanced_assign_costs`.
        """
        slack = self.balance_slack if slack is None else slack
        slack = 0.0 if slack is None else float(slack)
        cost = -self.scores(features)
        n, p = cost.shape
        return balanced_assign_costs(cost, capacity(n, p, slack), floor_size(n, p, slack, self.balance_min_fraction))

    def assign_balanced_chunked(
        self,
        features: Any,
        chunk: int,
        slack: float | None = None,
        sample: np.ndarray | None = None,
        sample_labels: np.ndarray | torch.Tensor | None = None,
        log: Log | None = None,
        min_gain: float = 0.0,
    ) -> ChunkedAssignment:
        """`assign_balanced` for a corpus read in chunks: `features` is any (N, D) array that slices
        by rows (a numpy memmap), bounds are those of the full N, and no (N, P) matrix is built.

        ``sample_labels``, an optimal balanced assignment of the rows ``sample`` (the k-means fit's own),
        give the per-path prices that start it (`routing.assignment.dual_prices`); see
        `routing.chunked` for the guarantee (bounds always, minimum cost when ``optimal``)."""
        slack = self.balance_slack if slack is None else slack
        slack = 0.0 if slack is None else float(slack)
        n, p = len(features), self.num_paths
        costs = feature_costs(features, lambda x: -self.scores(x), p, chunk)
        prices = None
        if sample is not None and sample_labels is not None:
            m = len(sample)
            prices = dual_prices(costs.take(np.asarray(sample)), np.asarray(sample_labels),
                                 capacity(m, p, slack), floor_size(m, p, slack, self.balance_min_fraction))
        return chunked_balanced_assign(costs, capacity(n, p, slack), floor_size(n, p, slack, self.balance_min_fraction),
                                       prices, min_gain=min_gain, log=log)

    def refine_chunked(
        self,
        features: Any,
        chunk: int,
        sample: np.ndarray,
        sample_labels: np.ndarray | torch.Tensor,
        rounds: int,
        log: Log | None = None,
    ) -> np.ndarray:
        """Lloyd rounds over the whole corpus for a one-level k-means router fitted on a ``sample`` of it;
        returns the sample's balanced labels under the new centroids (to price `assign_balanced_chunked`).

        Fitted on a sample, centroids carry its noise: at 256 clusters and 50k fit documents (195 a
        cluster) the balanced route of 100k documents had more inertia than a fit on all of them
        (docs/notes/2026-11-27-corpora-larger-than-memory.md).
        Each round reads the corpus once, in chunks: every document takes its priced cluster
        (argmin of distance - price, with the dual prices of the sample's optimal balanced assignment:
        near the balanced optimum of the whole corpus, see `routing.chunked`), each centroid moves to
        the mean of its documents (a cluster left empty keeps its centroid), and the sample is solved
        exactly again under the new centroids. Memory: the (k, D) sums, never an (N, k) matrix.
        What it guarantees is only what the final assignment does: the rounds move centroids, and
        the bounds are enforced by `assign_balanced_chunked` after them."""
        if self.kind != "kmeans":
            raise ValueError(f"refine_chunked refines one-level k-means routers, not {self.kind!r}")
        slack = 0.0 if self.balance_slack is None else float(self.balance_slack)
        k, m, n = self.num_paths, len(sample), len(features)
        cap, floor = capacity(m, k, slack), floor_size(m, k, slack, self.balance_min_fraction)
        costs = feature_costs(features, lambda x: -self.scores(x), k, chunk)  # reads self.centroids when called
        labels = np.asarray(sample_labels, dtype=np.int64)
        for r in range(rounds):
            prices = torch.from_numpy(dual_prices(costs.take(sample), labels, cap, floor))
            centers = prepare(self.centroids[0], self.metric)
            sums = torch.zeros(centers.shape, dtype=torch.float64)
            counts = torch.zeros(k, dtype=torch.int64)
            inertia = 0.0
            for a in range(0, n, chunk):
                x = prepare(self._features(np.asarray(features[a : a + chunk])), self.metric)
                d = sq_distances(x, centers)
                own = (d.double() - prices).argmin(dim=1)
                sums.index_add_(0, own, x.double())
                counts += torch.bincount(own, minlength=k)
                inertia += float(d.gather(1, own[:, None]).sum(dtype=torch.float64))
            moved = torch.where((counts > 0)[:, None], sums / counts.clamp_min(1)[:, None], centers.double())
            self.centroids = [prepare(moved.to(self.centroids[0].dtype), self.metric)]
            labels = balanced_assign_costs(costs.take(sample), cap, floor).numpy().astype(np.int64)
            if log is not None:
                log(f"refinement round {r + 1}/{rounds} over all {n:,} documents: priced inertia {inertia:.6g} "
                    f"before the centroids moved")
        return labels

    def assign_chunked(self, features: Any, chunk: int) -> np.ndarray:
        """`assign` of an (N, D) array read `chunk` rows at a time (a memmap stays on disk): (N,) int64,
        filled in place (a list of chunks and their concatenation held it twice)."""
        out = np.empty(len(features), dtype=np.int64)
        for a in range(0, len(features), chunk):
            out[a : a + chunk] = self.assign(np.asarray(features[a : a + chunk])).numpy()
        return out

    def assign_topk_chunked(self, features: Any, k: int, chunk: int) -> np.ndarray:
        """`assign_topk` of an (N, D) array read `chunk` rows at a time: (N, k) int64."""
        return np.concatenate([self.assign_topk(np.asarray(features[a : a + chunk]), k).numpy().astype(np.int64)
                               for a in range(0, len(features), chunk)])

    def assign_topk(self, features: Features, k: int) -> torch.Tensor:
        """(N, k) best paths per document, best first (overlapping training shards only)."""
        if not 1 <= k <= self.num_paths:
            raise ValueError(f"k must be in [1, {self.num_paths}], got {k}")
        return self.scores(features).topk(k, dim=1).indices.cpu()

    def featurize(
        self,
        texts: Sequence[str],
        model: Any = None,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Raw features of new texts with this router's featurizer (``lm_prefix`` needs the caller's
        model and tokenizer; ``encoder`` loads its encoder by the name or directory it records)."""
        kind = self.featurizer.get("kind")
        pooling = {"layers": self.featurizer.get("layers", [-1]), "skip_tokens": int(self.featurizer.get("skip_tokens", 0))}
        if kind in TEXT_MODELS:
            if self.text_model is None or self.text_model.kind != kind:
                raise ValueError(f"featurizer is {kind} but the router holds no fitted {kind} arrays")
            return torch.from_numpy(self.text_model.transform(texts))
        if kind == "lm_prefix":
            if model is None or tokenizer is None:
                raise ValueError("the lm_prefix featurizer needs the caller's model and tokenizer")
            prefix = int(self.featurizer.get("prefix_tokens", 32))
            return lm_prefix_features(model, tokenizer, texts, prefix_tokens=prefix, **pooling, **kwargs)
        if kind == "encoder":
            device = kwargs.pop("device", "cpu")
            if model is None or tokenizer is None:
                model, tokenizer = load_encoder(self.featurizer["model"], device)
            return encoder_features(model, tokenizer, texts, max_tokens=int(self.featurizer.get("max_tokens", 128)),
                                    device=device, **pooling, **kwargs)
        raise ValueError(f"cannot featurize texts with featurizer spec {self.featurizer!r}")

    # ------------------------------------------------------------------------------------
    # Persistence

    def save(self, directory: str | os.PathLike) -> Path:
        """Write router.safetensors + router.json into `directory` (created if needed)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for level, c in enumerate(self.centroids):
            tensors[f"centroids.{level}"] = c.contiguous()
        if self.weight is not None and self.bias is not None:
            tensors["weight"], tensors["bias"] = self.weight.contiguous(), self.bias.contiguous()
        if self.text_model is not None:
            for name, arr in self.text_model.arrays().items():
                tensors[f"text_model.{name}"] = torch.from_numpy(arr).contiguous()
        if self.transform is not None:
            for name, t in self.transform.tensors().items():
                tensors[f"transform.{name}"] = t
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "radices": self.radices,
            "num_paths": self.num_paths,
            "levels": len(self.centroids),
            "metric": self.metric,
            "featurizer": self.featurizer,
            "balance_slack": self.balance_slack,
            "balance_min_fraction": self.balance_min_fraction,
            "topology": self.topology,
            "meta": self.meta,
            "text_model": None if self.text_model is None else {"kind": self.text_model.kind, **self.text_model.state()},
            "transform": None if self.transform is None else self.transform.state(),
        }
        # Write to temporary names and rename, so a crash never leaves a half-written router.
        tmp_t, tmp_j = d / (TENSORS_NAME + ".tmp"), d / (JSON_NAME + ".tmp")
        save_file(tensors, str(tmp_t), metadata={"format": FORMAT})
        tmp_j.write_text(json.dumps(doc, indent=1, allow_nan=False))
        os.replace(tmp_t, d / TENSORS_NAME)
        os.replace(tmp_j, d / JSON_NAME)
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Router:
        """Read a router saved by `save`; RouterFileError says what is missing or wrong."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        d = Path(directory)
        if not d.is_dir():
            raise RouterFileError(f"router directory {d} does not exist")
        for name in (JSON_NAME, TENSORS_NAME):
            if not (d / name).is_file():
                raise RouterFileError(f"router directory {d} has no {name}")
        try:
            doc = json.loads((d / JSON_NAME).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RouterFileError(f"{d / JSON_NAME} is not valid JSON: {e}") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise RouterFileError(f"{d / JSON_NAME} is not a {FORMAT} file")
        if doc.get("format_version") != FORMAT_VERSION:
            raise RouterFileError(
                f"{d / JSON_NAME} has format_version {doc.get('format_version')}, "
                f"this code reads version {FORMAT_VERSION}"
            )
        try:
            tensors = load_file(str(d / TENSORS_NAME))
        except (SafetensorError, OSError, ValueError) as e:
            raise RouterFileError(f"{d / TENSORS_NAME} is corrupt: {e}") from e
        try:
            levels = int(doc["levels"])
            text_model = _load_text_model(doc, tensors)
            transform = None
            if doc.get("transform") is not None:
                parts = {k[len("transform."):]: v for k, v in tensors.items() if k.startswith("transform.")}
                transform = FeatureTransform.from_parts(doc["transform"], parts)
            router = cls(
                kind=doc["kind"],
                radices=doc["radices"],
                metric=doc["metric"],
                centroids=[tensors[f"centroids.{level}"] for level in range(levels)],
                weight=tensors.get("weight"),
                bias=tensors.get("bias"),
                featurizer=doc.get("featurizer") or {},
                text_model=text_model,
                balance_slack=doc.get("balance_slack"),
                balance_min_fraction=doc.get("balance_min_fraction", 0.0),
                topology=doc.get("topology"),
                meta=doc.get("meta") or {},
                transform=transform,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RouterFileError(f"router in {d} is incomplete or inconsistent: {e!r}") from e
        if doc.get("num_paths") != router.num_paths:
            raise RouterFileError(
                f"{d / JSON_NAME} says num_paths={doc.get('num_paths')} but radices give {router.num_paths}"
            )
        return router


def _load_text_model(doc: dict[str, Any], tensors: dict[str, torch.Tensor]) -> TfidfSvd | DocTopics | None:
    """The fitted text featurizer of a saved router; routers saved before `text_model` existed kept a
    TF-IDF transform under "tfidf"."""
    state, prefix = doc.get("text_model"), "text_model."
    if state is None and doc.get("tfidf") is not None:
        state, prefix = {"kind": "tfidf_svd", **doc["tfidf"]}, "tfidf."
    if state is None:
        return None
    if state.get("kind") not in TEXT_MODELS:
        raise ValueError(f"unknown text featurizer kind {state.get('kind')!r}")
    arrays = {k[len(prefix):]: v.numpy() for k, v in tensors.items() if k.startswith(prefix)}
    return TEXT_MODELS[state["kind"]].from_parts(state, arrays)


def fit_router(
    features: Features,
    radices: Sequence[int],
    *,
    metric: Metric = "euclidean",
    slack: float | None = None,
    min_fraction: float = 0.0,
    featurizer: dict[str, Any] | None = None,
    text_model: TfidfSvd | DocTopics | None = None,
    topology: dict[str, Any] | None = None,
    seed: int = 0,
    transform: FeatureTransform | None = None,
    **kmeans_kwargs: Any,
) -> tuple[Router, torch.Tensor]:
    """Fit a k-means router (product k-means when len(radices) > 1) and shard the training set.

    Returns the router and the training documents' path ids: balanced (capacity
    ceil(N/P * (1+slack)), floor floor(N/P * min_fraction)) when `slack` is not None,
    nearest-centroid otherwise. For one
    level with a slack, centroids are refined by balanced k-means so they match the shards.
    `featurizer` defaults to `text_model.spec()` when a fitted text featurizer is given.
    With a `transform` (fitted on these features), k-means runs on the transformed features and
    the router keeps the transform, so it routes raw features of new documents the same way.
    """
    radices = [int(r) for r in radices]
    if featurizer is None:
        featurizer = text_model.spec() if text_model is not None else {}
    common: dict[str, Any] = dict(featurizer=featurizer, text_model=text_model, balance_slack=slack, topology=topology,
                                  balance_min_fraction=min_fraction, transform=transform)
    raw = features
    if transform is not None:
        features = transform(features)
    if len(radices) == 1:
        if slack is None:
            res = kmeans(features, radices[0], metric=metric, seed=seed, **kmeans_kwargs)
            meta: dict[str, Any] = {"inertia": res.inertia, "n_iter": res.n_iter}
        else:
            res = balanced_kmeans(features, radices[0], slack, metric=metric, min_fraction=min_fraction, seed=seed,
                                  **kmeans_kwargs)
            meta = {"inertia": res.inertia, "unbalanced_inertia": res.unbalanced_inertia}
        router = Router("kmeans", radices, metric, [res.centroids], meta=meta | {"seed": seed}, **common)
        return router, res.labels
    prod = product_kmeans(features, radices, metric=metric, seed=seed, **kmeans_kwargs)
    meta = {"inertia_per_level": prod.inertia, "seed": seed}
    router = Router("product_kmeans", radices, metric, prod.centroids, meta=meta, **common)
    labels = prod.paths if slack is None else router.assign_balanced(raw, slack)
    return router, labels
