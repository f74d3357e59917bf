"""`dipaco route` and `dipaco reroute`: documents -> features -> paths, stored for training and serving.

``route`` featurizes every train and validation document (by default the DiPaCo way: the
pretrained dense model's mean last hidden state over the first ``data.prefix_tokens`` tokens;
``route.layers`` and ``route.skip_tokens`` choose the states and tokens pooled, ``route.featurizer``
``tfidf_svd``, ``encoder`` or ``doc_topics`` other features), optionally fits a feature transform
(``route.transform``: centring, PCA whitening, L2 normalisation) on the train features, fits
(balanced, optionally product) k-means on the train features and assigns both splits. It
writes, under ``<run.dir>/routing/``:

    data/                 the prepared splits plus a `path` column (and `paths_topk`), HF Arrow
    router/               the Router artifact (safetensors + JSON), reused for new documents
    features.safetensors  the features, so re-routing does not featurize again
    routing_report.json   docs/tokens per path, balance, inertia, time, NMI/ARI/purity vs labels

``reroute`` is DiPaCo's discriminative re-routing (section 2.4.2): every path of the current
checkpoint scores a held-out slice of the training documents, a logistic regression learns
features -> best path with its biases adjusted to the wanted shard sizes, and all documents are
re-sharded with it. ``dipaco train --resume`` then continues from the checkpoint on the new shards.

The k-means, balancing and classifier live in the trainer-independent ``routing`` package.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import PreTrainedModel

from dipaco.atomic import replacing
from dipaco.config import RouteConfig
from dipaco.data.prepare import Prepared
from dipaco.errors import ConfigError, DataError
from dipaco.metrics import echo
from dipaco.model.topology import Topology
from dipaco.precision import resolve_precision
from dipaco.route.provenance import ROUTED_INFO, routing_fingerprint
from dipaco.run_dir import RunDir
from dipaco.runtime import seed_everything
from dipaco.tensor_io import save_tensors
from routing.arrange import arrange_clusters, js_divergences
from routing.featurize import doc_topics_features, encoder_features, lm_prefix_features, load_encoder, tfidf_svd_features
from routing.quality import routing_report
from routing.router import Router, fit_router
from routing.transform import FeatureTransform

FEATURES = "features.safetensors"
REPORT = "routing_report.json"


@dataclass(frozen=True)
class RouteJob:
    """What routing reads besides the documents: the ``route`` section and the run's settings."""

    route: RouteConfig
    run_dir: Path
    prefix_tokens: int  # data.prefix_tokens: the routing context
    seed: int
    device: torch.device
    deterministic: bool | None = None
    progress: bool = True
    pretrained: Callable[[], PreTrainedModel] | None = None  # the LM-prefix featurizer's model, loaded on demand


def check_route(route: RouteConfig, prefix_tokens: int) -> None:
    """The ``route`` section's values (``route.em_rounds`` is the trainer's: dipaco.train.resharding)."""
    for key in ("n_init", "max_iter", "topk", "svd_components", "batch_size", "encoder_max_tokens"):
        if getattr(route, key) <= 0:
            raise ConfigError(f"route.{key}: must be > 0, got {getattr(route, key)}")
    if route.balance_slack is not None and not (math.isfinite(route.balance_slack) and route.balance_slack >= 0):
        raise ConfigError(f"route.balance_slack: must be a finite number >= 0 or null, got {route.balance_slack}")
    if not 0.0 <= route.min_shard_fraction <= 1.0:
        raise ConfigError(f"route.min_shard_fraction: must be in [0, 1], got {route.min_shard_fraction}")
    if not 0.0 < route.reroute_holdout < 1.0:
        raise ConfigError(f"route.reroute_holdout: must be in (0, 1), got {route.reroute_holdout}")
    if not route.layers:
        raise ConfigError("route.layers: must name at least one hidden state, e.g. [-1]")
    if route.skip_tokens < 0 or (route.featurizer == "lm_prefix" and route.skip_tokens >= max(prefix_tokens, 1)):
        raise ConfigError(f"route.skip_tokens: must be in [0, data.prefix_tokens={prefix_tokens}), "
                          f"got {route.skip_tokens}")
    if route.transform_components is not None and route.transform_components <= 0:
        raise ConfigError(f"route.transform_components: must be > 0 or null, got {route.transform_components}")
    if route.topics < 0 or route.topics == 1:
        raise ConfigError(f"route.topics: must be 0 (one topic per path) or >= 2, got {route.topics}")
    if not (math.isfinite(route.topic_smoothing) and route.topic_smoothing > 0):
        raise ConfigError(f"route.topic_smoothing: must be > 0, got {route.topic_smoothing}")
    if route.arrange != "none" and route.method != "kmeans":
        raise ConfigError(f"route.arrange={route.arrange}: needs route.method=kmeans (a product router's path is "
                          f"its per-level clusters; there is no numbering to choose)")
    if route.featurizer == "encoder" and not route.encoder:
        raise ConfigError("route.encoder: route.featurizer=encoder needs a Hugging Face encoder name or local directory")


def router_radices(job: RouteJob, topology: Topology) -> list[int]:
    """Cluster counts per level: [P] for plain k-means, the grid's K_l for product k-means."""
    if job.route.method == "kmeans":
        return [topology.num_paths]
    if topology.replicas != 1:
        raise ConfigError("route.method=product needs topology.replicas=1 (a replica digit has no feature half)")
    radices = list(topology.radices[:-1])
    if len(radices) < 2:
        raise ConfigError(f"route.method=product needs a grid of >= 2 levels; this topology has radices {radices}")
    return radices


def lm_features(job: RouteJob, prepared: Prepared, texts: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """LM-prefix features of each split's texts, from one load of the pretrained model."""
    device = job.device
    if job.pretrained is None:
        raise ConfigError("route.featurizer=lm_prefix needs the pretrained model (`dipaco pretrain`)")
    model = job.pretrained().to(device)
    with resolve_precision(job.route.precision, device, "route.precision").autocast():
        return {
            split: lm_prefix_features(model, prepared.tokenizer, t, prefix_tokens=job.prefix_tokens,
                                      batch_size=job.route.batch_size, device=device,
                                      show_progress=job.progress, layers=job.route.layers,
                                      skip_tokens=job.route.skip_tokens).float().cpu()
            for split, t in texts.items()
        }


def hf_encoder_features(job: RouteJob, texts: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Features of each split's routing contexts from the encoder ``route.encoder`` names."""
    device = job.device
    try:
        model, tokenizer = load_encoder(job.route.encoder, device)
    except ValueError as exc:
        raise ConfigError(f"route.encoder: {exc}") from None
    return {
        split: encoder_features(model, tokenizer, t, max_tokens=job.route.encoder_max_tokens,
                                batch_size=job.route.batch_size, device=device, show_progress=job.progress,
                                layers=job.route.layers, skip_tokens=job.route.skip_tokens).float().cpu()
        for split, t in texts.items()
    }


def fit_doc_topics(job: RouteJob, prepared: Prepared, contexts: list[str], num_paths: int):
    """``doc_topics`` features of the training documents' routing contexts, and the fitted word model.

    The topics come from the whole training documents: they are the training data, and fitting on
    them reads no validation token. Validation documents and served prompts are featurized from their
    routing context only, as the training documents are."""
    topics = job.route.topics or num_paths
    echo(f"[route] doc_topics: {topics} topics from whole training documents (TF-IDF + SVD({job.route.svd_components}), "
         f"cosine k-means), read from the first {job.prefix_tokens} tokens by a naive Bayes word model")
    try:
        train_x, model, _ = doc_topics_features(
            prepared.train["text"], contexts, topics, n_components=job.route.svd_components,
            smoothing=job.route.topic_smoothing, slack=job.route.balance_slack, seed=job.seed,
            n_init=job.route.n_init, max_iter=job.route.max_iter)
    except ValueError as exc:
        raise ConfigError(f"route.featurizer=doc_topics: {exc}") from None
    echo(f"[route] doc_topics: word model over {len(model.vocabulary):,} words")
    return train_x, model


def cluster_token_counts(prepared: Prepared, clusters: np.ndarray, num_clusters: int) -> np.ndarray:
    """(P, V) token counts of each cluster's training documents."""
    lengths = np.asarray(prepared.train["num_tokens"], dtype=np.int64)
    tokens = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in prepared.train["input_ids"]])
    vocab = int(tokens.max()) + 1
    flat = np.repeat(clusters, lengths) * vocab + tokens
    return np.bincount(flat, minlength=num_clusters * vocab).reshape(num_clusters, vocab)


def arrange_paths(job: RouteJob, topology: Topology, prepared: Prepared, router: Router,
                  clusters: np.ndarray) -> tuple[Router, np.ndarray]:
    """``route.arrange``: number the k-means clusters as paths so that clusters whose token distributions
    are alike (Jensen-Shannon) go to paths that share transformer blocks (routing.arrange)."""
    if job.route.arrange == "none":
        return router, clusters
    counts = cluster_token_counts(prepared, clusters, router.num_paths)
    found = arrange_clusters(np.asarray(topology.shared_blocks()), js_divergences(counts), job.route.arrange,
                             seed=job.seed)
    echo(f"[route] arrange={job.route.arrange}: cluster -> path {found.perm.tolist()}, shared-block-weighted "
         f"Jensen-Shannon divergence {found.identity_cost:.4f} -> {found.cost:.4f}"
         + ("" if found.exact else " (pairwise-swap local optimum)"))
    router = router.renumbered(found.perm.tolist(), arrangement={"mode": job.route.arrange, **found.to_dict()})
    return router, found.perm[clusters]


def pooling_spec(job: RouteJob) -> dict:
    return {"layers": list(job.route.layers), "skip_tokens": job.route.skip_tokens}


def fit_transform(job: RouteJob, train_features: torch.Tensor) -> FeatureTransform | None:
    """``route.transform`` fitted on the train features (None for ``none``)."""
    if job.route.transform == "none":
        return None
    return FeatureTransform.fit(train_features, job.route.transform, job.route.transform_components)


def routing_context(ds: datasets.Dataset, prepared: Prepared, prefix_tokens: int) -> list[str]:
    """The text of each document's first ``prefix_tokens`` tokens: all any featurizer may see.

    Routing must not read the tokens evaluation scores (everything after the prefix), or the
    router would pick a validation document's path from the very text it is judged on. Training
    documents are cut the same way so the router is fitted on what it will see at test time.
    """
    return prepared.tokenizer.batch_decode([ids[:prefix_tokens] for ids in ds["input_ids"]])


def _check_texts(ds: datasets.Dataset, split: str) -> None:
    empty = [i for i, n in zip(ds["id"], ds["num_tokens"]) if n == 0]
    if empty:
        raise DataError(f"{split}: {len(empty)} documents have no tokens and cannot be routed, e.g. {empty[:10]}")


def write_routing(run: RunDir, prepared: Prepared, router: Router, paths: dict[str, np.ndarray],
                   topk: np.ndarray | None, features: dict[str, torch.Tensor], report: dict,
                   before_swap: Callable[[str], None] | None = None) -> None:
    """Writes the routed splits, artifact, features and report next to the old ones, then swaps;
    ``before_swap(fingerprint)`` runs once the new routing is complete, before it replaces the old."""
    with replacing(run.routing) as tmp:
        fingerprint = _write_routing_dir(tmp, prepared, router, paths, topk, features, report)
        if before_swap is not None:
            before_swap(fingerprint)


def _write_routing_dir(tmp: Path, prepared: Prepared, router: Router, paths: dict[str, np.ndarray],
                       topk: np.ndarray | None, features: dict[str, torch.Tensor], report: dict) -> str:
    splits = {}
    for split, ds in (("train", prepared.train), ("validation", prepared.validation)):
        ds = ds.remove_columns([c for c in ("path", "paths_topk") if c in ds.column_names])
        ds = ds.add_column("path", paths[split].tolist())
        if topk is not None and split == "train":
            ds = ds.add_column("paths_topk", topk.tolist())
        splits[split] = ds
    datasets.DatasetDict(splits).save_to_disk(str(tmp / "data"))
    router.save(tmp / "router")
    routed = {**paths, **({"train_topk": topk} if topk is not None else {})}
    info = {"prepare_hash": prepared.info["prepare_hash"], "router": router.kind, "num_paths": router.num_paths,
            "fingerprint": routing_fingerprint(routed, tmp / "router")}
    (tmp / "data" / ROUTED_INFO).write_text(json.dumps(info, indent=2))
    save_tensors(features, tmp / FEATURES)
    (tmp / REPORT).write_text(json.dumps(report, indent=2, default=float))
    return info["fingerprint"]


def routing_summary(router: Router, paths: dict[str, np.ndarray], prepared: Prepared, seconds: float, extra: dict) -> dict:
    labels = {s: (ds["label"] if "label" in ds.column_names else None)
              for s, ds in (("train", prepared.train), ("validation", prepared.validation))}
    tokens = {"train": prepared.train["num_tokens"], "validation": prepared.validation["num_tokens"]}
    report = {
        "router": router.kind, "featurizer": router.featurizer, "radices": router.radices,
        "balance_slack": router.balance_slack, "wall_time_s": seconds, **extra,
    }
    for split in ("train", "validation"):
        report[split] = routing_report(paths[split], router.num_paths, tokens[split], labels[split],
                                       wall_time=seconds if split == "train" else None)
    return report


def print_report(report: dict) -> None:
    train = report["train"]
    if train["empty_paths"]:
        echo(f"[route] WARNING: paths {train['empty_paths']} received no training document; training will refuse "
             f"empty shards (use fewer paths, route.method=kmeans, or more data)")
    ratio = train["docs_max_min_ratio"]  # None when a path is empty
    echo(f"[route] {report['router']} ({report['featurizer'].get('kind')}): docs per path {train['docs_per_path']}, "
         f"max/min {'inf' if ratio is None else f'{ratio:.2f}'}")
    if "nmi" in train:
        echo(f"[route] agreement with labels (train): NMI {train['nmi']:.3f}, ARI {train['ari']:.3f}, "
             f"purity {train['purity']:.3f}")


def route(job: RouteJob, prepared: Prepared, topology: Topology) -> dict:
    """`dipaco route`: features of every document's routing context -> (balanced, product) k-means ->
    one path per document, written under ``<run.dir>/routing``; returns the routing report."""
    check_route(job.route, job.prefix_tokens)
    seed_everything(job.seed, job.device, job.deterministic)
    run = RunDir(job.run_dir)
    radices = router_radices(job, topology)
    for split, ds in (("train", prepared.train), ("validation", prepared.validation)):
        _check_texts(ds, split)
    if topology.num_paths > len(prepared.train):
        raise ConfigError(f"topology has {topology.num_paths} paths but the train split has only {len(prepared.train)} documents")

    start = time.perf_counter()
    texts = {"train": routing_context(prepared.train, prepared, job.prefix_tokens),
             "validation": routing_context(prepared.validation, prepared, job.prefix_tokens)}
    text_model = None
    if job.route.featurizer == "tfidf_svd":
        echo(f"[route] TF-IDF + SVD({job.route.svd_components}) features")
        train_x, text_model = tfidf_svd_features(texts["train"], n_components=job.route.svd_components, seed=job.seed)
    elif job.route.featurizer == "doc_topics":
        train_x, text_model = fit_doc_topics(job, prepared, texts["train"], topology.num_paths)
    if text_model is not None:
        features = {"train": torch.from_numpy(train_x),
                    "validation": torch.from_numpy(text_model.transform(texts["validation"]))}
        spec = text_model.spec()
    elif job.route.featurizer == "encoder":
        echo(f"[route] encoder features from {job.route.encoder}, hidden states {list(job.route.layers)}")
        features = hf_encoder_features(job, texts)
        spec = {"kind": "encoder", "model": job.route.encoder, "max_tokens": job.route.encoder_max_tokens,
                "prefix_tokens": job.prefix_tokens, **pooling_spec(job)}
    else:
        echo(f"[route] LM prefix features ({job.prefix_tokens} tokens, hidden states {list(job.route.layers)}, "
             f"first {job.route.skip_tokens} skipped) from {run.pretrain}")
        features = lm_features(job, prepared, texts)
        spec = {"kind": "lm_prefix", "prefix_tokens": job.prefix_tokens, **pooling_spec(job)}
    featurize_s = time.perf_counter() - start
    try:
        transform = fit_transform(job, features["train"])
    except ValueError as exc:
        raise ConfigError(f"route.transform={job.route.transform}: {exc}") from None
    if transform is not None:
        echo(f"[route] feature transform {transform.kind}: {transform.in_dim} -> {transform.out_dim} dims")

    echo(f"[route] {'product ' if len(radices) > 1 else ''}k-means, radices {radices}, slack {job.route.balance_slack}"
         + (f", min shard fraction {job.route.min_shard_fraction}" if job.route.min_shard_fraction else ""))
    router, fitted_paths = fit_router(
        features["train"], radices, metric=job.route.metric, slack=job.route.balance_slack,
        min_fraction=job.route.min_shard_fraction, featurizer=spec,
        text_model=text_model, topology=topology.to_dict(), seed=job.seed, n_init=job.route.n_init, max_iter=job.route.max_iter,
        transform=transform, log=lambda line: echo(f"[route] {line}"),
    )
    router, train_paths = arrange_paths(job, topology, prepared, router, np.asarray(fitted_paths, dtype=np.int64))
    paths: dict[str, np.ndarray] = {"train": train_paths,
             "validation": router.assign(features["validation"]).numpy().astype(np.int64)}
    topk = router.assign_topk(features["train"], job.route.topk).numpy() if job.route.topk > 1 else None
    seconds = time.perf_counter() - start
    report = routing_summary(router, paths, prepared, seconds, {
        "featurize_s": featurize_s, "docs_per_s": (len(texts["train"]) + len(texts["validation"])) / seconds,
        **{k: v for k, v in router.meta.items() if "inertia" in k or k == "arrangement"},
    })
    write_routing(run, prepared, router, paths, topk, features, report)
    print_report(report)
    echo(f"[route] wrote {run.routing} in {seconds:.1f}s; train with train.sharding=kmeans")
    return report
