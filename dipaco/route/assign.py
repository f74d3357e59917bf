"""`dipaco route`: documents -> features -> paths, stored for training and serving.

``route`` featurizes every train and validation document (by default the DiPaCo way: the
pretrained dense model's mean last hidden state over the first ``data.prefix_tokens`` tokens;
``route.layers`` and ``route.skip_tokens`` choose the states and tokens pooled, ``route.featurizer``
``tfidf_svd``, ``encoder`` or ``doc_topics`` other features), optionally fits a feature transform
(``route.transform``: centring, PCA whitening, L2 normalisation) on the train features, fits
(balanced, optionally product) k-means on the train features and assigns both splits. It
writes, under ``<run.dir>/routing/``:

    data/                 the `path` column of each split (and `paths_topk`), HF Arrow; joined to the
                          prepared splits row by row (``dipaco.route.shards.with_routing``), never a copy
    router/               the Router artifact (safetensors + JSON), reused for new documents
    features.safetensors  the features, so re-routing does not featurize again
    routing_report.json   docs/tokens per path, balance, inertia, time, NMI/ARI/purity vs labels

A corpus need not fit in memory. Documents are read, featurized and assigned ``route.chunk_docs``
at a time, each chunk through its own memory map (``dipaco.data.reading``); the features go to
``.npy`` files in ``<run.dir>/routing.work/``, written and read a chunk at a time, with a
record of the chunks done and of what produced them (prepare hash, featurizer settings, seed, the
pretrained model's files), so a killed ``dipaco route`` resumes at the next chunk and changed
settings start over; the folder is removed once ``routing/`` is written. Text featurizers and
k-means are fitted on a seeded sample of at most ``route.fit_docs`` training documents (all of
them when there are no more: the routing is then exactly the in-memory one), and every document
is assigned under the capacity bounds of the full N by ``routing.chunked`` (bounds guaranteed,
minimum total cost given the centroids when it reports ``optimal``).

This module also writes the routing of ``dipaco reroute`` (:func:`write_routing`, :class:`Assignments`),
DiPaCo's discriminative re-routing from a checkpoint, which lives in :mod:`dipaco.train.reroute`
(it scores the paths of a trained checkpoint, so it belongs above the trainer).

The k-means, balancing and classifier live in the trainer-independent ``routing`` package.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import datasets
import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedModel

from dipaco import json_text
from dipaco.atomic import remove_tree, replacing, write_text
from dipaco.config import RouteConfig
from dipaco.data.prepare import Prepared
from dipaco.data.reading import ChunkedArray, SplitReader, in_memory_dataset
from dipaco.data.tokenizer import decode_batch
from dipaco.errors import ConfigError, DataError
from dipaco.metrics import echo
from dipaco.model.topology import Topology
from dipaco.precision import resolve_precision
from dipaco.route.provenance import ROUTED_INFO, routing_fingerprint
from dipaco.run_dir import RunDir
from dipaco.runtime import seed_everything
from routing.arrange import arrange_clusters, js_divergences
from routing.featurize import (
    TEXT_MODELS,
    DocTopics,
    TfidfSvd,
    doc_topics_features,
    encoder_features,
    lm_prefix_features,
    load_encoder,
    tfidf_svd_features,
)
from routing.quality import routing_report
from routing.router import Router, fit_router
from routing.transform import FeatureTransform

FEATURES = "features.safetensors"
REPORT = "routing_report.json"
WORK = "routing.work"  # in the run directory, beside routing/ (which is swapped in whole): features in progress
RECORD = "record.json"  # in WORK: what produced the features, and which chunks are done
ROUTING_BATCH_ROWS = 1 << 20  # rows per record batch of routing/data (see _write_routing_dir)
CHUNK_DOCS = 65_536  # route.chunk_docs' default, for callers (re-routing) that pass no job
# The chunked balanced assignment stops improving after a pass over the corpus that lowers its total cost (the
# inertia) by less than this fraction: the caps always hold; the cost is close to the minimum, not proven minimal.
MIN_PASS_GAIN = 1e-3
# The settings that decide the features (and the text model fitted for them): a change to any starts over.
FEATURE_KEYS = ("featurizer", "layers", "skip_tokens", "encoder", "encoder_max_tokens", "precision", "batch_size",
                "svd_components", "topics", "topic_smoothing", "balance_slack", "n_init", "max_iter", "fit_docs",
                "chunk_docs")


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
    if route.fit_docs is not None and route.fit_docs <= 0:
        raise ConfigError(f"route.fit_docs: must be > 0 or null (fit on every training document), got {route.fit_docs}")
    if route.refine_rounds < 0:
        raise ConfigError(f"route.refine_rounds: must be >= 0, got {route.refine_rounds}")
    if route.chunk_docs <= 0:
        raise ConfigError(f"route.chunk_docs: must be > 0, got {route.chunk_docs}")
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


def fit_doc_topics(job: RouteJob, documents: list[str], contexts: list[str], num_paths: int):
    """``doc_topics`` features of the training documents' routing contexts, and the fitted word model.

    The topics come from the whole training documents: they are the training data, and fitting on
    them reads no validation token. Validation documents and served prompts are featurized from their
    routing context only, as the training documents are."""
    topics = job.route.topics or num_paths
    echo(f"[route] doc_topics: {topics} topics from whole training documents (TF-IDF + SVD({job.route.svd_components}), "
         f"cosine k-means), read from the first {job.prefix_tokens} tokens by a naive Bayes word model")
    try:
        train_x, model, _ = doc_topics_features(
            documents, contexts, topics, n_components=job.route.svd_components,
            smoothing=job.route.topic_smoothing, slack=job.route.balance_slack, seed=job.seed,
            n_init=job.route.n_init, max_iter=job.route.max_iter)
    except ValueError as exc:
        raise ConfigError(f"route.featurizer=doc_topics: {exc}") from None
    echo(f"[route] doc_topics: word model over {len(model.vocabulary):,} words")
    return train_x, model


def cluster_token_counts(prepared: Prepared, clusters: np.ndarray, num_clusters: int,
                         chunk: int = CHUNK_DOCS) -> np.ndarray:
    """(P, V) token counts of each cluster's training documents, V = the largest token id + 1; read
    ``chunk`` documents at a time, so only the (P, V) counts grow with the corpus's vocabulary."""
    counts = np.zeros((num_clusters, 0), dtype=np.int64)
    for start, batch in _batches(prepared.train, ["input_ids"], chunk):
        ids = batch["input_ids"]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        tokens = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
        vocab = max(counts.shape[1], int(tokens.max(initial=-1)) + 1)
        flat = np.repeat(clusters[start : start + len(ids)], lengths) * vocab + tokens
        part = np.bincount(flat, minlength=num_clusters * vocab).reshape(num_clusters, vocab)
        part[:, : counts.shape[1]] += counts  # a later chunk may hold a larger id: widen, then add
        counts = part
    return counts


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


def _batches(ds: datasets.Dataset, columns: list[str], chunk: int,
             numpy: bool = False) -> Iterator[tuple[int, dict]]:
    """(first row, columns of rows [first, first + chunk)) over the dataset: never a whole column, and
    each chunk through its own mapping of the files (:class:`SplitReader`)."""
    yield from SplitReader(ds).chunks(columns, chunk, numpy)


def column_numbers(ds: datasets.Dataset, column: str, chunk: int = CHUNK_DOCS, dtype: type = np.int32) -> np.ndarray:
    """A numeric column as one (N,) array (int32 by default: 4 bytes a document), read in chunks (no
    Python list of N values); a value that does not fit ``dtype`` is an error, not a wrapped number."""
    out: np.ndarray = np.empty(len(ds), dtype=dtype)
    top = np.iinfo(dtype).max
    for start, batch in _batches(ds, [column], chunk, numpy=True):
        values = np.asarray(batch[column])
        if values.size and values.max() > top:
            raise DataError(f"{column}: a value of {int(values.max()):,} does not fit {np.dtype(dtype).name}")
        out[start : start + len(values)] = values
    return out


def routing_context(ds: datasets.Dataset, prepared: Prepared, prefix_tokens: int,
                    chunk: int = CHUNK_DOCS) -> list[str]:
    """The text of each document's first ``prefix_tokens`` tokens: all any featurizer may see.

    Routing must not read the tokens evaluation scores (everything after the prefix), or the
    router would pick a validation document's path from the very text it is judged on. Training
    documents are cut the same way so the router is fitted on what it will see at test time.
    """
    reader, texts = SplitReader(ds), []
    for start in range(0, len(ds), chunk):
        ids = reader.rows(start, min(start + chunk, len(ds)), ["input_ids"], list_prefix=prefix_tokens)["input_ids"]
        texts += decode_batch(prepared.tokenizer, ids)
    return texts


def document_texts(ds: datasets.Dataset, prepared: Prepared, chunk: int = CHUNK_DOCS) -> list[str]:
    """Each document's whole text: its ``text`` column, or, in data prepared with ``data.keep_text=false``,
    its tokens decoded (the byte-level BPE gives the text back)."""
    if "text" in ds.column_names:
        return ds["text"]
    reader, texts = SplitReader(ds), []
    for start in range(0, len(ds), chunk):
        texts += decode_batch(prepared.tokenizer, reader.rows(start, min(start + chunk, len(ds)), ["input_ids"])["input_ids"])
    return texts


def _check_texts(ds: datasets.Dataset, split: str, chunk: int = CHUNK_DOCS) -> None:
    rows = np.flatnonzero(column_numbers(ds, "num_tokens", chunk) == 0)
    empty = ds.select(rows[:10])["id"] if rows.size else []
    if empty:
        raise DataError(f"{split}: {rows.size} documents have no tokens and cannot be routed, e.g. {empty}")


@dataclass(frozen=True)
class Assignments:
    """A router and the paths it gave every document."""

    router: Router
    doc_paths: dict[str, np.ndarray]  # split -> each document's path
    topk: np.ndarray | None = None  # (N, k) training documents' k best paths (route.topk > 1)


def write_routing(run: RunDir, prepared: Prepared, assigned: Assignments, features: Mapping[str, Any] | Path,
                  report: dict, before_swap: Callable[[str], None] | None = None) -> None:
    """Writes the routed splits, artifact, features and report next to the old ones, then swaps;
    ``before_swap(fingerprint)`` runs once the new routing is complete, before it replaces the old.
    ``features``: (N, D) arrays per split (tensors, or arrays on disk streamed to the file), or a
    features file to link."""
    with replacing(run.routing) as tmp:
        fingerprint = _write_routing_dir(tmp, prepared, assigned, features, report)
        if before_swap is not None:
            before_swap(fingerprint)


def _topk_column(topk: np.ndarray) -> pa.Array:
    """The (N, k) top-k paths as an Arrow list<int64> column (what ``add_column`` makes of nested lists),
    built from the array without a Python list per document."""
    n, k = topk.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(topk, dtype=np.int64).ravel()))


def save_routing_columns(splits: Mapping[str, datasets.Dataset], path: Path) -> None:
    """``splits`` saved as a DatasetDict, in record batches of ``ROUTING_BATCH_ROWS`` rows.

    save_to_disk writes batches of datasets.config.DEFAULT_MAX_BATCH_SIZE (1,000) rows, 8 KB of paths
    each: opening the file then touched every page of it (77 MB at 10M documents) and joining it to the
    splits made an Arrow slice per batch (39 MB)."""
    with mock.patch.object(datasets.config, "DEFAULT_MAX_BATCH_SIZE", ROUTING_BATCH_ROWS):
        datasets.DatasetDict(dict(splits)).save_to_disk(str(path))


def _write_routing_dir(tmp: Path, prepared: Prepared, assigned: Assignments, features: Mapping[str, Any] | Path,
                       report: dict) -> str:
    router, doc_paths, topk = assigned.router, assigned.doc_paths, assigned.topk
    # Only the routing columns: training joins them to the prepared splits row by row
    # (:func:`dipaco.route.shards.with_routing`), so routing never copies the corpus.
    splits = {}
    for split in ("train", "validation"):
        columns = {"path": pa.array(np.asarray(doc_paths[split], dtype=np.int64))}
        if topk is not None and split == "train":
            columns["paths_topk"] = _topk_column(topk)
        splits[split] = in_memory_dataset(pa.table(columns))
    save_routing_columns(splits, tmp / "data")
    router.save(tmp / "router")
    routed = {**doc_paths, **({"train_topk": topk} if topk is not None else {})}
    info = {"prepare_hash": prepared.info["prepare_hash"], "router": router.kind, "num_paths": router.num_paths,
            "fingerprint": routing_fingerprint(routed, tmp / "router")}
    (tmp / "data" / ROUTED_INFO).write_text(json_text.dumps(info, indent=2))
    if isinstance(features, Path):  # unchanged (re-routing): the old routing's file, linked, not copied
        link_or_copy(features, tmp / FEATURES)
    else:
        save_features(features, tmp / FEATURES)
    (tmp / REPORT).write_text(json_text.dumps(report, indent=2, default=float))
    return info["fingerprint"]


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link of ``source``, or a copy where the file system cannot link."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def save_features(features: Mapping[str, Any], path: Path, chunk_bytes: int = 8 << 20) -> None:
    """(N, D) float32 arrays per name as one safetensors file, written about ``chunk_bytes`` at a time
    (each chunk once in memory: a 65k-row chunk and its ``tobytes`` copy were 67 MB at 128 dims).

    The file is what ``safetensors.save_file`` writes (an 8-byte header length, a JSON header
    padded to 8 bytes, the row-major little-endian data), so ``load_tensors`` reads it; streaming
    it keeps a memory-mapped corpus's features on disk instead of in memory."""
    header: dict[str, Any] = {}
    offset = 0
    for name, x in features.items():
        rows, dim = (int(d) for d in x.shape)
        size = rows * dim * 4
        header[name] = {"dtype": "F32", "shape": [rows, dim], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for x in features.values():
            rows = max(chunk_bytes // (4 * max(int(x.shape[1]), 1)), 1)
            for a in range(0, len(x), rows):
                part = x[a : a + rows]
                part = part.detach().cpu().numpy() if isinstance(part, torch.Tensor) else np.asarray(part)
                out.write(np.ascontiguousarray(part, dtype="<f4").data)  # its buffer: no bytes copy


_SAFETENSORS_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}


def stored_features(path: Path) -> dict[str, ChunkedArray]:
    """The (N, D) feature arrays of a features file (:func:`save_features`, or ``safetensors.save_file``),
    each read from the file as rows are asked for, never the whole file in memory (4.6 GB at 10M documents)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        arrays = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _SAFETENSORS_DTYPES or len(entry["shape"]) != 2:
                raise ValueError(f"{name!r} is {entry['dtype']} of shape {entry['shape']}, not a 2-d float array")
            arrays[name] = ChunkedArray.at(path, 8 + size + entry["data_offsets"][0], tuple(entry["shape"]),
                                           _SAFETENSORS_DTYPES[entry["dtype"]])
    except (OSError, ValueError, KeyError, TypeError, EOFError) as exc:
        raise DataError(f"{path}: not a readable features file ({exc}); run `dipaco route` again") from None
    return arrays


def _label_codes(ds: datasets.Dataset, chunk: int) -> np.ndarray:
    """The label column as (N,) int32 codes, read in chunks: NMI, ARI and purity do not depend on the
    labels' names, and codes keep N strings out of memory."""
    codes: dict[Any, int] = {}
    out = np.empty(len(ds), dtype=np.int32)
    for start, batch in _batches(ds, ["label"], chunk):
        out[start : start + len(batch["label"])] = [codes.setdefault(v, len(codes)) for v in batch["label"]]
    return out


def routing_summary(router: Router, doc_paths: dict[str, np.ndarray], prepared: Prepared, seconds: float, extra: dict,
                    chunk: int = CHUNK_DOCS) -> dict:
    report = {
        "router": router.kind, "featurizer": router.featurizer, "radices": router.radices,
        "balance_slack": router.balance_slack, "wall_time_s": seconds, **extra,
    }
    for split, ds in (("train", prepared.train), ("validation", prepared.validation)):
        labels = _label_codes(ds, chunk) if "label" in ds.column_names else None
        report[split] = routing_report(doc_paths[split], router.num_paths, column_numbers(ds, "num_tokens", chunk), labels,
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


def fit_sample(n: int, fit_docs: int | None, seed: int) -> np.ndarray:
    """Sorted rows of the training documents the text featurizer and k-means are fitted on: all of them
    when ``fit_docs`` is null or at least N (then routing is exactly the in-memory one), else a seeded
    uniform sample of ``fit_docs``."""
    if fit_docs is None or n <= fit_docs:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=fit_docs, replace=False))


def _files_stamp(directory: Path) -> list:
    """Name, size and modification time of each file under ``directory``: the pretrained model's
    identity, so features of an older model are not resumed."""
    if not directory.is_dir():
        return []
    return [[str(f.relative_to(directory)), f.stat().st_size, f.stat().st_mtime_ns]
            for f in sorted(directory.rglob("*")) if f.is_file()]


def produced_by(job: RouteJob, prepared: Prepared) -> dict:
    """What the features depend on; stored in the work record, and compared before resuming."""
    doc = {"prepare_hash": prepared.info.get("prepare_hash"), "seed": job.seed, "prefix_tokens": job.prefix_tokens,
           "rows": {"train": len(prepared.train), "validation": len(prepared.validation)},
           "route": {key: getattr(job.route, key) for key in FEATURE_KEYS},
           "model": _files_stamp(RunDir(job.run_dir).pretrain) if job.route.featurizer == "lm_prefix" else None}
    return json.loads(json.dumps(doc))  # as it reads back: tuples become lists


class FeatureWork:
    """Features in progress in ``<run.dir>/routing.work/``: ``<split>.npy`` (memory-mapped, (N, D)
    float32), the fitted text model (``text_model.json`` + ``.npz``) and ``record.json``: what produced
    them and which chunks are done. A record from other settings is discarded, and the work restarts."""

    def __init__(self, root: Path, produced: dict):
        self.root = root
        record = None
        if (root / RECORD).is_file():
            try:
                record = json.loads((root / RECORD).read_text())
            except ValueError:
                record = None  # a torn record: start over
        missing = [] if record is None else self._missing_files(record)
        if record is not None and record.get("produced_by") == produced and not missing:
            done = {split: len(entry["done"]) for split, entry in record["splits"].items()}
            echo(f"[route] resuming the features in {root}: chunks done {done}")
        else:
            if missing:
                echo(f"[route] the features in {root} lack {', '.join(missing)}; starting over")
            elif record is not None:
                echo(f"[route] the features in {root} are from other settings; starting over")
            remove_tree(root)
            root.mkdir(parents=True)
            record = {"produced_by": produced, "splits": {}, "text_model": None}
        self.record = record
        self._save()

    def _missing_files(self, record: dict) -> list[str]:
        """The files ``record`` says exist and do not (a removal killed by an older version, a hand-deleted file)."""
        names = [f"{split}.npy" for split in record.get("splits", {})]
        if record.get("text_model") is not None:
            names += ["text_model.json", "text_model.npz"]
        return [name for name in names if not (self.root / name).is_file()]

    def _save(self) -> None:
        write_text(self.root / RECORD, json.dumps(self.record, indent=1))

    def done(self, split: str) -> set[int]:
        return set(self.record["splits"].get(split, {}).get("done", []))

    def array(self, split: str, rows: int, dim: int | None = None) -> ChunkedArray | None:
        """The split's features, read and written a chunk at a time; created when ``dim`` is given and
        there are none yet (None then)."""
        entry = self.record["splits"].get(split)
        path = self.root / f"{split}.npy"
        if entry is None:
            if dim is None:
                return None
            out = ChunkedArray.create(path, rows, dim)
            self.record["splits"][split] = {"dim": dim, "done": []}
            self._save()
            return out
        return ChunkedArray(path)

    def mark(self, split: str, chunk: int, out: ChunkedArray) -> None:
        """Chunk ``chunk`` of ``split`` is written (each write is flushed: the record never runs ahead)."""
        self.record["splits"][split]["done"].append(chunk)
        self._save()

    def save_text_model(self, model: TfidfSvd | DocTopics) -> None:
        np.savez(self.root / "text_model.npz", allow_pickle=False, **model.arrays())
        (self.root / "text_model.json").write_text(json_text.dumps({"kind": model.kind, **model.state()}))
        self.record["text_model"] = model.kind
        self._save()

    def text_model(self) -> TfidfSvd | DocTopics | None:
        kind = self.record.get("text_model")
        if kind is None:
            return None
        state = json.loads((self.root / "text_model.json").read_text())
        with np.load(self.root / "text_model.npz") as arrays:
            return TEXT_MODELS[kind].from_parts(state, {k: arrays[k] for k in arrays.files})

    def remove(self) -> None:
        remove_tree(self.root)


Featurize = Callable[[list[str]], np.ndarray]  # routing contexts -> (n, D) float32 features


def featurize_chunk(featurize: Featurize, reader: SplitReader, prepared: Prepared, rows: np.ndarray,
                    prefix_tokens: int) -> np.ndarray:
    """Features of the documents ``rows`` (contiguous, or nearly: one chunk) of the reader's split."""
    part = reader.rows(int(rows[0]), int(rows[-1]) + 1, ["input_ids"], list_prefix=prefix_tokens)["input_ids"]
    texts = decode_batch(prepared.tokenizer, [part[i] for i in rows - rows[0]])
    return np.asarray(featurize(texts), dtype=np.float32)


def featurize_split(job: RouteJob, work: FeatureWork, split: str, prepared: Prepared, featurize: Featurize,
                    skip: np.ndarray | None = None, dim: int | None = None) -> ChunkedArray:
    """The split's features, chunk by chunk into the work folder; chunks already done are kept, and rows
    where ``skip`` is true (already written by the text model's fit) are left as they are."""
    ds = prepared.train if split == "train" else prepared.validation
    n, chunk = len(ds), job.route.chunk_docs
    chunks = math.ceil(n / chunk)
    done = work.done(split)
    out = work.array(split, n, dim)
    reader = SplitReader(ds)
    started, computed = time.perf_counter(), 0
    for index in range(chunks):
        if index in done:
            continue
        rows = np.arange(index * chunk, min(n, (index + 1) * chunk))
        if skip is not None:
            rows = rows[~skip[rows]]
        if rows.size:
            x = featurize_chunk(featurize, reader, prepared, rows, job.prefix_tokens)
            if out is None:
                out = work.array(split, n, x.shape[1])
            assert out is not None
            out[rows] = x
            computed += rows.size
        assert out is not None
        work.mark(split, index, out)
        if chunks > 1:
            rate = computed / max(time.perf_counter() - started, 1e-9)
            how = f"{rate:.0f} docs/s" if rows.size else "its rows were the fit sample's"
            echo(f"[route] {split} features: chunk {index + 1}/{chunks} done ({how})")
    out = work.array(split, n)
    assert out is not None
    return out


def _lm_featurizer(job: RouteJob, prepared: Prepared) -> Featurize:
    """LM-prefix features batched on ``job.device`` (CUDA when there is one); the model loads on the
    first chunk that needs it, so a resumed run with every chunk done never loads it."""
    model: list[PreTrainedModel] = []

    def featurize(texts: list[str]) -> np.ndarray:
        if not model:
            if job.pretrained is None:
                raise ConfigError("route.featurizer=lm_prefix needs the pretrained model (`dipaco pretrain`)")
            model.append(job.pretrained().to(job.device))
        with resolve_precision(job.route.precision, job.device, "route.precision").autocast():
            x = lm_prefix_features(model[0], prepared.tokenizer, texts, prefix_tokens=job.prefix_tokens,
                                   batch_size=job.route.batch_size, device=job.device, show_progress=job.progress,
                                   layers=job.route.layers, skip_tokens=job.route.skip_tokens)
        return x.float().cpu().numpy()

    return featurize


def _encoder_featurizer(job: RouteJob) -> Featurize:
    def featurize(texts: list[str]) -> np.ndarray:
        try:
            model, tokenizer = load_encoder(job.route.encoder, job.device)  # cached after the first chunk
        except ValueError as exc:
            raise ConfigError(f"route.encoder: {exc}") from None
        return encoder_features(model, tokenizer, texts, max_tokens=job.route.encoder_max_tokens,
                                batch_size=job.route.batch_size, device=job.device, show_progress=job.progress,
                                layers=job.route.layers, skip_tokens=job.route.skip_tokens).float().cpu().numpy()

    return featurize


def fit_text_model(job: RouteJob, work: FeatureWork, prepared: Prepared, sample: np.ndarray,
                   num_paths: int) -> TfidfSvd | DocTopics:
    """The text featurizer fitted on the sample's routing contexts (doc_topics: and whole texts); the
    fit's own features of the sample are written to the train features, as the in-memory fit gave them."""
    fitted = work.text_model()
    if fitted is not None:
        return fitted
    docs = prepared.train.select(sample)
    contexts = routing_context(docs, prepared, job.prefix_tokens, job.route.chunk_docs)
    if job.route.featurizer == "tfidf_svd":
        echo(f"[route] TF-IDF + SVD({job.route.svd_components}) features, fitted on {len(sample):,} documents")
        x, model = tfidf_svd_features(contexts, n_components=job.route.svd_components, seed=job.seed)
    else:
        x, model = fit_doc_topics(job, document_texts(docs, prepared, job.route.chunk_docs), contexts, num_paths)
    out = work.array("train", len(prepared.train), model.dim)
    assert out is not None
    for a in range(0, len(sample), job.route.chunk_docs):
        out[sample[a : a + job.route.chunk_docs]] = x[a : a + job.route.chunk_docs]
    work.save_text_model(model)
    return model


def compute_features(job: RouteJob, work: FeatureWork, prepared: Prepared, sample: np.ndarray,
                     num_paths: int) -> tuple[dict[str, ChunkedArray], TfidfSvd | DocTopics | None, dict]:
    """Memory-mapped features of both splits, the fitted text model (or None) and the featurizer spec."""
    text_model, skip, dim = None, None, None
    if job.route.featurizer in TEXT_MODELS:
        text_model = fit_text_model(job, work, prepared, sample, num_paths)
        featurize: Featurize = text_model.transform
        skip = np.zeros(len(prepared.train), dtype=bool)
        skip[sample] = True
        spec, dim = text_model.spec(), text_model.dim
    elif job.route.featurizer == "encoder":
        echo(f"[route] encoder features from {job.route.encoder}, hidden states {list(job.route.layers)}")
        featurize = _encoder_featurizer(job)
        spec = {"kind": "encoder", "model": job.route.encoder, "max_tokens": job.route.encoder_max_tokens,
                "prefix_tokens": job.prefix_tokens, **pooling_spec(job)}
    else:
        echo(f"[route] LM prefix features ({job.prefix_tokens} tokens, hidden states {list(job.route.layers)}, "
             f"first {job.route.skip_tokens} skipped) from {RunDir(job.run_dir).pretrain} on {job.device}")
        featurize = _lm_featurizer(job, prepared)
        spec = {"kind": "lm_prefix", "prefix_tokens": job.prefix_tokens, **pooling_spec(job)}
    features = {"train": featurize_split(job, work, "train", prepared, featurize, skip, dim),
                "validation": featurize_split(job, work, "validation", prepared, featurize,
                                              dim=dim)}
    return features, text_model, spec


def assign_train(job: RouteJob, router: Router, train_x: ChunkedArray, sample: np.ndarray,
                 fitted: np.ndarray) -> np.ndarray:
    """Every training document's cluster: the fit's own labels when it saw them all, else assigned in
    chunks (balanced under the full N's bounds, priced from the fit's optimal sample assignment)."""
    chunk = job.route.chunk_docs
    if len(sample) == len(train_x):
        return fitted
    router.meta["fit_docs"] = len(sample)
    if job.route.balance_slack is None:
        return router.assign_chunked(train_x, chunk)
    if job.route.refine_rounds and router.kind == "kmeans":
        fitted = router.refine_chunked(train_x, chunk, sample, fitted, job.route.refine_rounds,
                                       log=lambda line: echo(f"[route] {line}"))
        router.meta["refine_rounds"] = job.route.refine_rounds
    echo(f"[route] assigning {len(train_x):,} documents in chunks of {chunk:,} under the capacity bounds")
    result = router.assign_balanced_chunked(train_x, chunk, sample=sample, sample_labels=fitted,
                                            log=lambda line: echo(f"[route] {line}"), min_gain=MIN_PASS_GAIN)
    router.meta.update({"assigned_inertia": result.cost, "assignment_optimal": result.optimal})
    return result.labels


def route(job: RouteJob, prepared: Prepared, topology: Topology) -> dict:
    """`dipaco route`: features of every document's routing context -> (balanced, product) k-means ->
    one path per document, written under ``<run.dir>/routing``; returns the routing report."""
    check_route(job.route, job.prefix_tokens)
    seed_everything(job.seed, job.device, job.deterministic)
    run = RunDir(job.run_dir)
    radices = router_radices(job, topology)
    chunk = job.route.chunk_docs
    for split, ds in (("train", prepared.train), ("validation", prepared.validation)):
        _check_texts(ds, split, chunk)
    n = len(prepared.train)
    if topology.num_paths > n:
        raise ConfigError(f"topology has {topology.num_paths} paths but the train split has only {n} documents")
    sample = fit_sample(n, job.route.fit_docs, job.seed)
    if len(sample) < topology.num_paths:
        raise ConfigError(f"route.fit_docs={job.route.fit_docs} is fewer than the {topology.num_paths} paths")

    start = time.perf_counter()
    work = FeatureWork(run.root / WORK, produced_by(job, prepared))
    features, text_model, spec = compute_features(job, work, prepared, sample, topology.num_paths)
    featurize_s = time.perf_counter() - start
    fit_x = torch.from_numpy(np.ascontiguousarray(features["train"][sample]))
    try:
        transform = fit_transform(job, fit_x)
    except ValueError as exc:
        raise ConfigError(f"route.transform={job.route.transform}: {exc}") from None
    if transform is not None:
        echo(f"[route] feature transform {transform.kind}: {transform.in_dim} -> {transform.out_dim} dims")

    echo(f"[route] {'product ' if len(radices) > 1 else ''}k-means, radices {radices}, slack {job.route.balance_slack}"
         + (f", min shard fraction {job.route.min_shard_fraction}" if job.route.min_shard_fraction else "")
         + (f", fitted on {len(sample):,} of {n:,} documents" if len(sample) < n else ""))
    router, fitted_paths = fit_router(
        fit_x, radices, metric=job.route.metric, slack=job.route.balance_slack,
        min_fraction=job.route.min_shard_fraction, featurizer=spec,
        text_model=text_model, topology=topology.to_dict(), seed=job.seed, n_init=job.route.n_init, max_iter=job.route.max_iter,
        transform=transform, log=lambda line: echo(f"[route] {line}"),
    )
    del fit_x
    clusters = assign_train(job, router, features["train"], sample, np.asarray(fitted_paths, dtype=np.int64))
    router, train_paths = arrange_paths(job, topology, prepared, router, clusters)
    doc_paths: dict[str, np.ndarray] = {"train": train_paths,
                                    "validation": router.assign_chunked(features["validation"], chunk)}
    topk = router.assign_topk_chunked(features["train"], job.route.topk, chunk) if job.route.topk > 1 else None
    seconds = time.perf_counter() - start
    report = routing_summary(router, doc_paths, prepared, seconds, {
        "featurize_s": featurize_s, "docs_per_s": (n + len(prepared.validation)) / seconds,
        **{k: v for k, v in router.meta.items() if "inertia" in k or k in ("arrangement", "fit_docs")},
    }, chunk)
    write_routing(run, prepared, Assignments(router, doc_paths, topk), features, report)
    work.remove()  # routing/ holds the features now
    print_report(report)
    echo(f"[route] wrote {run.routing} in {seconds:.1f}s; train with train.sharding=kmeans")
    return report
