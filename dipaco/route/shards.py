"""Shards: which path each document belongs to, and each path's packed training sequences.

Shards are one-to-one with paths: shard p holds the documents routed to path p. The same rule
routes training and validation documents, so a path is evaluated on the kind of text it trained on.

Overlapping shards (``route.topk`` = k > 1, the paper's top-k routing at training time): a training
document also trains its next-best paths, k in all (its routed path first, then the best others by
the router's scores, ``paths_topk``). Validation documents keep their one path. The outer weight of
a path counts each document's tokens once over all the paths it trains (1/k to each), so a module's
average does not count a duplicated document k times (:func:`overlap_token_shares`).

Sharding rules:

* ``iid``: a salted hash of the document id, uniform over paths (for DiLoCo-style baselines);
* ``column``: an integer path column already in the dataset;
* ``kmeans``: the ``path`` column that ``dipaco route`` writes for both splits (``routing/data``, joined to
  the prepared rows by :func:`with_routing`).

Which routing an experiment trained on is recorded and checked by :mod:`dipaco.route.provenance`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import datasets
import numpy as np

from dipaco.config import DataConfig, TokenizerConfig
from dipaco.data.corpus import numpy_column, stable_hash
from dipaco.data.packing import DocumentTokens, PackedShard
from dipaco.data.prepare import Prepared, load_prepared
from dipaco.data.reading import SplitReader
from dipaco.errors import ConfigError, DataError
from dipaco.route.provenance import routed_info
from dipaco.run_dir import RunDir


def iid_paths(ids: Iterable[str], num_paths: int, seed: int) -> np.ndarray:
    # Salted so the shard does not correlate with the train/validation split, which hashes ids too.
    return np.fromiter((stable_hash(f"shard:{seed}:{i}") % num_paths for i in ids), dtype=np.int64)


def document_ids(ds: datasets.Dataset, batch_size: int = 100_000) -> Iterator[str]:
    # Chunks through their own maps: the ids lie between the texts in the file (dipaco.data.reading).
    for _, batch in SplitReader(ds).chunks(["id"], batch_size):
        yield from batch["id"]


def column_paths(ds: datasets.Dataset, column: str, num_paths: int) -> np.ndarray:
    if column not in ds.column_names:
        raise DataError(f"sharding=column needs a {column!r} column; the dataset has {ds.column_names}")
    paths = numpy_column(ds, column)
    try:
        if not np.issubdtype(paths.dtype, np.integer):
            paths = paths.astype(np.int64)
        bad = np.flatnonzero((paths < 0) | (paths >= num_paths))
    except (TypeError, ValueError):
        raise DataError(f"column {column!r} must hold integer path ids") from None
    if bad.size:
        ids = [ds["id"][int(i)] for i in bad[:5]]
        raise DataError(f"column {column!r}: {bad.size} docs have a path outside [0, {num_paths}), e.g. ids {ids}")
    return paths.astype(np.int32)  # checked first, so none wraps; int64 took 80 MB of a 10M-document split


ROUTING_COLUMNS = ("path", "paths_topk")


def routed_data(run_dir: str | Path, data: DataConfig, tokenizer: TokenizerConfig, routed: bool) -> Prepared:
    """The run's prepared data; ``routed``: with the ``path`` columns of `dipaco route` (training on
    train.sharding=kmeans, and everything that reads such an experiment back)."""
    prepared = load_prepared(run_dir, data, tokenizer)
    return with_routing(prepared, run_dir) if routed else prepared


def with_routing(prepared: Prepared, run_dir: str | Path) -> Prepared:
    """``prepared`` with the ``path`` (and ``paths_topk``) columns ``dipaco route`` wrote, joined row by
    row without a copy. Routing from before that (a full copy of the splits with the columns) is read as is."""
    run = RunDir(run_dir)
    info = routed_info(run)
    if info is None:
        raise DataError(f"sharding=kmeans needs routed data in {run.routing / 'data'}; run `dipaco route` first")
    if info.get("prepare_hash") != prepared.info["prepare_hash"]:
        raise DataError(f"{run.routing} was routed from different prepared data; rerun `dipaco route`")
    routed = datasets.load_from_disk(str(run.routing / "data"))
    splits = {}
    for split, ds in (("train", prepared.train), ("validation", prepared.validation)):
        columns = routed[split]
        if "input_ids" in columns.column_names:  # the old layout: the whole split, routed
            splits[split] = columns
            continue
        if len(columns) != len(ds):
            raise DataError(f"{run.routing / 'data'}: {len(columns):,} routed {split} documents, but the prepared "
                            f"data has {len(ds):,}; rerun `dipaco route`")
        ds = ds.remove_columns([c for c in ROUTING_COLUMNS if c in ds.column_names])
        splits[split] = datasets.concatenate_datasets([ds, columns], axis=1)
    return replace(prepared, train=splits["train"], validation=splits["validation"])


def assign_paths(ds: datasets.Dataset, num_paths: int, sharding: str, seed: int, column: str = "path") -> np.ndarray:
    """Path id of every document of ``ds``."""
    if sharding == "iid":
        return iid_paths(document_ids(ds), num_paths, seed)
    if sharding == "column":
        return column_paths(ds, column, num_paths)
    if sharding == "kmeans":
        return column_paths(ds, "path", num_paths)
    raise DataError(f"unknown sharding {sharding!r}")


def overlapping_paths(ds: datasets.Dataset, doc_paths: np.ndarray, k: int) -> np.ndarray:
    """(N, k) paths each training document trains: its routed path, then its best other paths from
    the ``paths_topk`` column ``dipaco route`` writes with ``route.topk`` >= k."""
    if k == 1:
        return doc_paths[:, None]
    if "paths_topk" not in ds.column_names:
        raise DataError(f"route.topk={k} needs the `paths_topk` column: run `dipaco route` with route.topk={k}")
    ranked = numpy_column(ds, "paths_topk").astype(np.int64)
    if ranked.ndim != 2 or ranked.shape[1] < k:
        raise DataError(f"route.topk={k} but the routed data holds {ranked.shape[-1]} best paths per document; "
                        f"run `dipaco route` with route.topk={k}")
    out = np.empty((len(doc_paths), k), dtype=np.int64)
    for i, (own, best) in enumerate(zip(doc_paths, ranked)):
        out[i] = [own, *[q for q in best if q != own][: k - 1]]
    return out


def training_paths(train_ds: datasets.Dataset, doc_paths: np.ndarray, num_paths: int, topk: int,
                   sharding: str) -> np.ndarray:
    """(N, k) paths each training document trains: k = ``route.topk`` for routed shards (overlapping
    when > 1), one path otherwise."""
    if topk == 1:
        return doc_paths[:, None]
    if sharding != "kmeans":
        raise ConfigError(f"route.topk={topk}: overlapping shards need train.sharding=kmeans, got {sharding}")
    if topk > num_paths:
        raise ConfigError(f"route.topk={topk} is more than the topology's {num_paths} paths")
    return overlapping_paths(train_ds, doc_paths, topk)


MEMBER_CHUNK = 1 << 20  # documents compared at a time by shard_members


def shard_members(doc_paths: np.ndarray, path: int) -> np.ndarray:
    """Sorted document indices of ``path``'s shard (int32 below 2**31 documents); ``doc_paths`` is (N,) or
    (N, k) for overlapping shards. Found a chunk at a time: an (N,) mask and int64 indices of the whole
    split were 13 bytes a document of garbage for each shard built."""
    doc_paths = doc_paths.reshape(len(doc_paths), -1)
    dtype = np.int32 if len(doc_paths) < 2**31 else np.int64
    parts = [np.empty(0, dtype=dtype)]
    for a in range(0, len(doc_paths), MEMBER_CHUNK):
        block = doc_paths[a : a + MEMBER_CHUNK]
        hit = block[:, 0] == path if block.shape[1] == 1 else (block == path).any(axis=1)
        parts.append((np.flatnonzero(hit) + a).astype(dtype))
    return np.concatenate(parts)


def overlap_token_shares(doc_paths: np.ndarray, num_paths: int, tokens: Sequence[int] | np.ndarray) -> list[float]:
    """Per path, the fraction of its documents' tokens that are its own: sum_d t_d / m_d over sum_d t_d,
    with m_d the number of paths document d trains. 1.0 everywhere without overlap."""
    doc_paths = doc_paths.reshape(len(doc_paths), -1)
    t = np.asarray(tokens, dtype=np.float64)
    ranked = np.sort(doc_paths, axis=1)
    multiplicity = 1.0 + (np.diff(ranked, axis=1) != 0).sum(axis=1)  # distinct paths per document
    shares = []
    for members in (shard_members(doc_paths, p) for p in range(num_paths)):
        total = t[members].sum()
        shares.append(float((t[members] / multiplicity[members]).sum() / total) if total > 0 else 1.0)
    return shares


def build_shards(
    ds: datasets.Dataset, doc_paths: np.ndarray, num_paths: int, seq_len: int, eos_id: int
) -> list[PackedShard]:
    """Each path's packed sequences, (n_seqs, seq_len), read from ``ds``'s memory-mapped token column on
    demand; an empty shard is an error. ``doc_paths`` is each document's path (N,), or the paths it trains
    (N, k) for overlapping shards."""
    docs = DocumentTokens(ds)
    shards = []
    for p in range(num_paths):
        members = shard_members(doc_paths, p)
        if members.size == 0:
            raise DataError(
                f"shard of path {p} is empty: no training document was routed to it; "
                f"use fewer paths, more data, or balanced routing"
            )
        try:
            shards.append(PackedShard(docs, members, seq_len, eos_id))
        except DataError as exc:
            raise DataError(f"shard of path {p} ({members.size} docs): {exc}") from None
    return shards


def path_weights(shards: Sequence[PackedShard], weighting: str,
                 token_shares: Sequence[float] | None = None) -> dict[int, float]:
    """Outer-step weights w_p: proportional to shard tokens, or uniform. With overlapping shards,
    ``token_shares`` (:func:`overlap_token_shares`) counts a document's tokens once over its paths."""
    if weighting == "uniform":
        return {p: 1.0 for p in range(len(shards))}
    shares = token_shares or [1.0] * len(shards)
    return {p: float(s.numel()) * shares[p] for p, s in enumerate(shards)}
