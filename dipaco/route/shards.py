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
* ``kmeans``: the ``path`` column that ``dipaco route`` adds to both splits (``routing/data``).

A run has one ``routing/`` directory, and ``dipaco reroute`` rewrites it for the experiment it
re-routes. Every other experiment of the run would then silently resume, evaluate and serve on
shards it was never trained on; so each kmeans experiment records the fingerprint of the routing it
trained on (``train/<name>/routing.json``) and every job that reads routing for it checks it.
An experiment's own re-routing (``dipaco reroute``, or ``route.em_rounds`` inside ``dipaco train``)
notes the fingerprint it is about to write there before it replaces the routing, so a stop between
the two still finds the experiment's own routing accepted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Sequence

import datasets
import numpy as np
import torch

from dipaco.atomic import write_text
from dipaco.config import Config
from dipaco.data.corpus import stable_hash
from dipaco.data.packing import pack_documents
from dipaco.errors import DataError
from dipaco.run_dir import RunDir

ROUTED_INFO = "routing_info.json"
EXPERIMENT_ROUTING = "routing.json"  # in an experiment directory: the fingerprint of its routing


def iid_paths(ids: Sequence[str], num_paths: int, seed: int) -> np.ndarray:
    # Salted so the shard does not correlate with the train/validation split, which hashes ids too.
    return np.array([stable_hash(f"shard:{seed}:{i}") % num_paths for i in ids], dtype=np.int64)


def column_paths(ds: datasets.Dataset, column: str, num_paths: int) -> np.ndarray:
    if column not in ds.column_names:
        raise DataError(f"sharding=column needs a {column!r} column; the dataset has {ds.column_names}")
    try:
        paths = np.asarray(ds[column], dtype=np.int64)
    except (TypeError, ValueError):
        raise DataError(f"column {column!r} must hold integer path ids") from None
    bad = np.flatnonzero((paths < 0) | (paths >= num_paths))
    if bad.size:
        ids = [ds["id"][int(i)] for i in bad[:5]]
        raise DataError(f"column {column!r}: {bad.size} docs have a path outside [0, {num_paths}), e.g. ids {ids}")
    return paths


def routed_splits(run: RunDir, prepare_hash: str) -> datasets.DatasetDict:
    """The train/validation splits with the ``path`` column written by ``dipaco route``."""
    info_path = run.routing / "data" / ROUTED_INFO
    if not info_path.is_file():
        raise DataError(f"sharding=kmeans needs routed data in {run.routing / 'data'}; run `dipaco route` first")
    info = json.loads(info_path.read_text())
    if info.get("prepare_hash") != prepare_hash:
        raise DataError(f"{run.routing} was routed from different prepared data; rerun `dipaco route`")
    return datasets.load_from_disk(str(run.routing / "data"))


def routing_fingerprint(paths: dict[str, np.ndarray], router_dir: Path) -> str:
    """sha256 of every routed path id and of the router's files: equal only for the same routing."""
    digest = hashlib.sha256()
    for split in sorted(paths):
        digest.update(split.encode())
        digest.update(np.ascontiguousarray(paths[split], dtype=np.int64).tobytes())
    for file in sorted(router_dir.iterdir()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def current_fingerprint(run: RunDir) -> str | None:
    """The fingerprint of the run's routing now (None without one, or from before fingerprints existed)."""
    info_path = run.routing / "data" / ROUTED_INFO
    return json.loads(info_path.read_text()).get("fingerprint") if info_path.is_file() else None


def _recorded(exp_dir: Path) -> dict | None:
    record = exp_dir / EXPERIMENT_ROUTING
    return json.loads(record.read_text()) if record.is_file() else None


def record_routing(cfg: Config, exp_dir: Path, rerouting: str | None = None) -> None:
    """Notes which routing the experiment trains on (kmeans sharding only; routing from before
    fingerprints existed is not recorded). ``rerouting``: the fingerprint of a re-routing of this
    experiment that is about to replace the run's routing; it stays accepted as the experiment's own
    until the next record (see :func:`check_routing`)."""
    fingerprint = current_fingerprint(RunDir(cfg.run.dir)) if cfg.train.sharding == "kmeans" else None
    if fingerprint is not None:
        exp_dir.mkdir(parents=True, exist_ok=True)
        entry = {"fingerprint": fingerprint, **({"rerouting": rerouting} if rerouting else {})}
        write_text(exp_dir / EXPERIMENT_ROUTING, json.dumps(entry) + "\n")


def pending_rerouting(exp_dir: Path) -> str | None:
    """The fingerprint of the experiment's own re-routing that was written (or about to be) but not
    recorded as the routing it trains on: a stop came in between."""
    record = _recorded(exp_dir)
    return None if record is None else record.get("rerouting")


def check_routing(cfg: Config, exp_dir: Path) -> None:
    """Refuses an experiment whose run's routing is no longer the one it was trained on, nor its own re-routing."""
    record = _recorded(exp_dir)
    if cfg.train.sharding != "kmeans" or record is None:
        return
    run = RunDir(cfg.run.dir)
    trained_on, current = record["fingerprint"], current_fingerprint(run)
    if current not in (trained_on, record.get("rerouting")):
        raise DataError(
            f"{run.routing} is not the routing experiment {exp_dir.name!r} was trained on (fingerprint "
            f"{str(current)[:12]} vs {trained_on[:12]}): a `dipaco route`, or a `dipaco reroute` of another "
            f"experiment, replaced it. Give each re-routed experiment its own run directory, or route again "
            f"with the settings this experiment used."
        )


def assign_paths(ds: datasets.Dataset, num_paths: int, sharding: str, seed: int, column: str = "path") -> np.ndarray:
    """Path id of every document of ``ds``."""
    if sharding == "iid":
        return iid_paths(ds["id"], num_paths, seed)
    if sharding == "column":
        return column_paths(ds, column, num_paths)
    if sharding == "kmeans":
        return column_paths(ds, "path", num_paths)
    raise DataError(f"unknown sharding {sharding!r}")


def overlapping_paths(ds: datasets.Dataset, paths: np.ndarray, k: int) -> np.ndarray:
    """(N, k) paths each training document trains: its routed path, then its best other paths from
    the ``paths_topk`` column ``dipaco route`` writes with ``route.topk`` >= k."""
    if k == 1:
        return paths[:, None]
    if "paths_topk" not in ds.column_names:
        raise DataError(f"route.topk={k} needs the `paths_topk` column: run `dipaco route` with route.topk={k}")
    ranked = np.asarray(ds["paths_topk"], dtype=np.int64)
    if ranked.ndim != 2 or ranked.shape[1] < k:
        raise DataError(f"route.topk={k} but the routed data holds {ranked.shape[-1]} best paths per document; "
                        f"run `dipaco route` with route.topk={k}")
    out = np.empty((len(paths), k), dtype=np.int64)
    for i, (own, best) in enumerate(zip(paths, ranked)):
        out[i] = [own, *[q for q in best if q != own][: k - 1]]
    return out


def shard_members(paths: np.ndarray, num_paths: int) -> list[np.ndarray]:
    """Document indices of each path's shard; ``paths`` is (N,) or (N, k) for overlapping shards."""
    paths = paths.reshape(len(paths), -1)
    return [np.flatnonzero((paths == p).any(axis=1)) for p in range(num_paths)]


def overlap_token_shares(paths: np.ndarray, num_paths: int, tokens: Sequence[int]) -> list[float]:
    """Per path, the fraction of its documents' tokens that are its own: sum_d t_d / m_d over sum_d t_d,
    with m_d the number of paths document d trains. 1.0 everywhere without overlap."""
    paths = paths.reshape(len(paths), -1)
    t = np.asarray(tokens, dtype=np.float64)
    multiplicity = np.array([len(set(row.tolist())) for row in paths], dtype=np.float64)
    shares = []
    for members in shard_members(paths, num_paths):
        total = t[members].sum()
        shares.append(float((t[members] / multiplicity[members]).sum() / total) if total > 0 else 1.0)
    return shares


def build_shards(
    ds: datasets.Dataset, paths: np.ndarray, num_paths: int, seq_len: int, eos_id: int
) -> list[torch.Tensor]:
    """One (n_seqs, seq_len) tensor of packed sequences per path; an empty shard is an error.
    ``paths`` is each document's path (N,), or the paths it trains (N, k) for overlapping shards."""
    docs = ds["input_ids"]
    shards = []
    for p, members in enumerate(shard_members(paths, num_paths)):
        if members.size == 0:
            raise DataError(
                f"shard of path {p} is empty: no training document was routed to it; "
                f"use fewer paths, more data, or balanced routing"
            )
        try:
            shards.append(pack_documents([docs[int(i)] for i in members], seq_len, eos_id))
        except DataError as exc:
            raise DataError(f"shard of path {p} ({members.size} docs): {exc}") from None
    return shards


def path_weights(shards: Sequence[torch.Tensor], weighting: str,
                 token_shares: Sequence[float] | None = None) -> dict[int, float]:
    """Outer-step weights w_p: proportional to shard tokens, or uniform. With overlapping shards,
    ``token_shares`` (:func:`overlap_token_shares`) counts a document's tokens once over its paths."""
    if weighting == "uniform":
        return {p: 1.0 for p in range(len(shards))}
    shares = token_shares or [1.0] * len(shards)
    return {p: float(s.numel()) * shares[p] for p, s in enumerate(shards)}
