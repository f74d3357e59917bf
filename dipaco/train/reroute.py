"""`dipaco reroute`: discriminative re-routing (DiPaCo, arXiv 2403.10616, section 2.4.2).

The trained paths score a held-out slice of the training documents; each document's best path is
its label; a linear classifier from routing features to paths (its bias adjusted to the wanted
shard sizes, see :mod:`routing.discriminative`) re-shards every document. Training then continues
on the new shards with ``dipaco train --resume``; ``route.em_rounds`` makes ``dipaco train`` do both
at the rounds it lists (:mod:`dipaco.train.resharding`). With ``route.topk`` > 1 the new router's
best paths are stored too (``paths_topk``), so overlapping shards follow the re-routing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import LlamaConfig

from dipaco.checkpoint.experiment import experiment_checkpoint, read_bank
from dipaco.config import RouteConfig
from dipaco.data.hashing import holdout_mask
from dipaco.data.packing import DocumentTokens
from dipaco.data.prepare import Prepared
from dipaco.data.reading import SplitReader
from dipaco.errors import ConfigError, DataError
from dipaco.metrics import echo
from dipaco.model.llama import build_model
from dipaco.model.scoring import Scoring, score_documents
from dipaco.model.topology import Topology
from dipaco.precision import Precision
from dipaco.route.artifact import load_router
from dipaco.route.assign import (
    CHUNK_DOCS,
    FEATURES,
    Assignments,
    column_numbers,
    print_report,
    routing_summary,
    stored_features,
    write_routing,
)
from dipaco.route.provenance import record_routing
from dipaco.run_dir import RunDir
from dipaco.runtime import seed_everything
from routing.discriminative import fit_discriminative_router
from routing.router import Router


@dataclass(frozen=True)
class RerouteJob:
    """What re-routing an experiment reads: its routing keys, the experiment, and how paths are scored."""

    route: RouteConfig  # reroute_holdout, reroute_target, topk
    run_dir: Path
    name: str  # the experiment: <run.dir>/train/<name>
    routed: bool  # it trains on routed shards (train.sharding=kmeans): nothing to re-route otherwise
    topology: Topology
    llama: LlamaConfig
    seed: int
    device: torch.device
    precision: Precision  # of the paths' forward passes (eval.precision)
    seq_len: int
    prefix_tokens: int
    batch_size: int  # eval.batch_size
    deterministic: bool | None = None


def holdout_rows(ds: datasets.Dataset, fraction: float, salt: str, chunk: int = CHUNK_DOCS) -> np.ndarray:
    """The rows of ``ds`` that :func:`holdout_mask` holds out, from its ids read ``chunk`` at a time (not
    one Python list of every id: about 70 bytes a document)."""
    parts = [np.zeros(0, dtype=np.int64)]
    for first, batch in SplitReader(ds).chunks(["id"], chunk):
        parts.append(first + np.flatnonzero(holdout_mask(batch["id"], fraction, salt)))
    return np.concatenate(parts)


def reroute(job: RerouteJob, load_prepared: Callable[[], Prepared], checkpoint: str | None = None,
            hint: bool = True) -> dict:
    """Discriminative re-routing from the experiment's checkpoint; writes new routing in place.
    ``load_prepared``: the routed splits; ``hint``: end with what to run next."""
    seed_everything(job.seed, job.device, job.deterministic)
    if not job.routed:
        raise ConfigError("dipaco reroute re-shards routed data: set train.sharding=kmeans (and run `dipaco route` first)")
    prepared = load_prepared()
    run, topology = RunDir(job.run_dir), job.topology
    exp_dir, ckpt = experiment_checkpoint(job.run_dir, job.name, job.routed, checkpoint)
    bank = read_bank(ckpt, topology, job.llama)
    old = load_router(run, topology.num_paths)
    features_file = run.routing / FEATURES
    stored = stored_features(features_file)  # rows are read as asked for: 4.6 GB at 10M documents stay on disk

    start = time.perf_counter()
    rows = holdout_rows(prepared.train, job.route.reroute_holdout, f"reroute:{job.seed}")
    if len(rows) < topology.num_paths:
        raise DataError(f"route.reroute_holdout={job.route.reroute_holdout} leaves {len(rows)} documents to score "
                        f"{topology.num_paths} paths; raise it")
    docs = DocumentTokens(prepared.train).documents(rows, dtype=np.int32)
    model = build_model(job.llama, device=job.device)
    loglik = torch.empty(len(docs), topology.num_paths, dtype=torch.float64)
    scoring = Scoring(job.seq_len, job.prefix_tokens, job.batch_size, prepared.tokenizer.pad_token_id, job.precision)
    for p in range(topology.num_paths):
        scores = score_documents(bank.compose(p, model), docs, scoring)
        loglik[:, p] = -torch.from_numpy(scores.nll)
    del docs
    scored = torch.from_numpy(scores.tokens > 0)  # documents within the prefix carry no signal
    current = column_numbers(prepared.train, "path")
    target = "uniform" if job.route.reroute_target == "uniform" else np.bincount(current, minlength=topology.num_paths).tolist()
    # The classifier sees features as the old router did (after its transform) and keeps that transform.
    holdout_x = torch.from_numpy(stored["train"][rows])[scored]
    weight, bias = fit_discriminative_router(old.transformed(holdout_x), loglik[scored], target)
    router = Router("linear", [topology.num_paths], weight=weight.float(), bias=bias.float(), featurizer=old.featurizer,
                    text_model=old.text_model, topology=topology.to_dict(), meta={"checkpoint": ckpt.name},
                    transform=old.transform)
    doc_paths = {s: router.assign_chunked(stored[s], CHUNK_DOCS) for s in ("train", "validation")}
    topk = router.assign_topk_chunked(stored["train"], job.route.topk, CHUNK_DOCS) if job.route.topk > 1 else None
    best = loglik[scored].argmax(dim=1).numpy()
    seconds = time.perf_counter() - start
    report = routing_summary(router, doc_paths, prepared, seconds, {
        "checkpoint": str(ckpt), "holdout_docs": int(scored.sum()),
        "holdout_best_equals_current": float(np.mean(best == current[rows][scored.numpy()])),
        "holdout_best_distribution": np.bincount(best, minlength=topology.num_paths).tolist(),
        "moved_train_docs": float(np.mean(doc_paths["train"] != current)),
        "moved_train_docs_count": int(np.sum(doc_paths["train"] != current)),
    })
    # The new fingerprint is noted as this experiment's own before the swap, so a stop in between leaves
    # the experiment resumable; once written, it is what the experiment trains on and the others are refused it.
    write_routing(run, prepared, Assignments(router, doc_paths, topk), features_file, report,
                  before_swap=lambda fingerprint: record_routing(job.run_dir, exp_dir, True, rerouting=fingerprint))
    record_routing(job.run_dir, exp_dir, True)
    print_report(report)
    if hint:
        echo(f"[reroute] {report['moved_train_docs']:.1%} of train docs moved; continue with `dipaco train --resume`")
    return report
