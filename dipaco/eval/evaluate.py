"""`dipaco eval`: validation perplexity per path and overall, with the routing prefix excluded.

Each validation document is routed by the same rule as training documents, scored on its own (no
packing with other documents) by its path's model, and only tokens after the first
``data.prefix_tokens`` count: the paper measures every model, baselines included, this way.
Perplexities are token-weighted: overall ppl = exp(total NLL / total scored tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, PreTrainedModel

from dipaco import json_text
from dipaco.atomic import write_text
from dipaco.checkpoint.experiment import experiment_checkpoint, read_bank
from dipaco.config import EvalConfig
from dipaco.data.packing import DocumentTokens, count_eval_windows
from dipaco.data.prepare import Prepared
from dipaco.errors import ConfigError
from dipaco.eval.report import REPORT
from dipaco.metrics import echo
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.scoring import Scores, Scoring, score_documents
from dipaco.model.topology import Topology
from dipaco.paths.early_stopping import load_best_path
from dipaco.precision import resolve_precision
from dipaco.route.shards import assign_paths
from dipaco.run_dir import RunDir


@dataclass(frozen=True)
class EvalJob:
    """What evaluation reads: the experiment, how its documents are routed, and how they are scored."""

    eval: EvalConfig
    run_dir: Path
    name: str  # the experiment: <run.dir>/train/<name>
    sharding: str  # train.sharding: the rule that routes validation documents as it sharded the training ones
    shard_column: str
    seed: int
    topology: Topology
    llama: LlamaConfig
    seq_len: int
    prefix_tokens: int
    device: torch.device
    inner_steps: int  # train.inner_steps: a checkpoint's steps per path, for the report
    progress: bool = True  # run.progress: a bar over the evaluation windows

    @property
    def routed(self) -> bool:
        return self.sharding == "kmeans"

    @property
    def dir(self) -> Path:
        return RunDir(self.run_dir).experiment(self.name)


def check_eval(section: EvalConfig) -> None:
    """The ``eval`` section."""
    if section.batch_size <= 0:
        raise ConfigError(f"eval.batch_size: must be > 0, got {section.batch_size}")
    if section.max_docs is not None and section.max_docs <= 0:
        raise ConfigError(f"eval.max_docs: must be > 0 or null, got {section.max_docs}")
    if section.every < 0:
        raise ConfigError(f"eval.every: must be >= 0 (0: no validation during training), got {section.every}")


def _summary(scores: Scores, n_docs: int, what: str = "validation") -> dict:
    """``what``: the documents' name in the reason for a null perplexity ("validation", "corpus")."""
    out: dict[str, int | float | str] = {
        "docs": n_docs,
        "scored_tokens": int(scores.tokens.sum()),
        "nll": float(scores.nll.sum()),
        "ppl": scores.perplexity,
    }
    if not out["scored_tokens"]:  # eval.json writes the NaN as null, with this reason beside it
        out["ppl_null_reason"] = (f"no {what} document is routed to this path" if not n_docs else
                                  f"no scored tokens: the {n_docs} {what} documents routed here end within "
                                  "the routing prefix")
    return out


EVAL_CHUNK_DOCS = 10_000  # documents read and scored at a time: eval's memory does not grow with the split


def validation_split(section: EvalConfig, prepared: Prepared) -> datasets.Dataset:
    """The validation documents evaluation scores: the first ``eval.max_docs``, or all."""
    val = prepared.validation
    if section.max_docs is not None:
        val = val.select(range(min(section.max_docs, len(val))))
    return val


def score_rows(model: PreTrainedModel, tokens: DocumentTokens, rows: np.ndarray, scoring: Scoring,
               on_batch: Callable[[int], object]) -> Scores:
    """:func:`score_documents` of the documents ``rows``, read from the token files and scored
    ``EVAL_CHUNK_DOCS`` at a time (the same scores: each document is scored on its own)."""
    nll, counts = [np.zeros(0)], [np.zeros(0, dtype=np.int64)]
    for i in range(0, len(rows), EVAL_CHUNK_DOCS):
        scores = score_documents(model, tokens.documents(rows[i : i + EVAL_CHUNK_DOCS]), scoring, on_batch)
        nll.append(scores.nll)
        counts.append(scores.tokens)
    return Scores(np.concatenate(nll), np.concatenate(counts))


def _windows(tokens: DocumentTokens, n_docs: int, seq_len: int, prefix_tokens: int) -> int:
    return count_eval_windows(tokens.spans(np.arange(n_docs))[2], seq_len, prefix_tokens)


def load_eval_path(job: EvalJob, bank: ModuleBank, path: int, model: PreTrainedModel) -> PreTrainedModel:
    """Loads what evaluation scores for ``path`` into ``model``: its early-stopped parameters with
    ``eval.early_stopping``, else its composition from the checkpoint's bank."""
    if job.eval.early_stopping:
        return load_best_path(job.dir / "early_stopping", path, model)
    return bank.compose(path, model)


def evaluate_experiment(job: EvalJob, prepared: Prepared, checkpoint: str | None = None) -> dict:
    """Scores every path of the experiment's newest (or given) checkpoint on its routed validation docs."""
    check_eval(job.eval)
    exp_dir, ckpt = experiment_checkpoint(job.run_dir, job.name, job.routed, checkpoint)
    val = validation_split(job.eval, prepared)
    routes = assign_paths(val, job.topology.num_paths, job.sharding, job.seed, job.shard_column)
    report = score_routed(job, ckpt, RoutedDocs(DocumentTokens(val), routes, prepared.tokenizer.pad_token_id))
    write_report(report, exp_dir / REPORT)
    print_path_table(report)
    return report


@dataclass(frozen=True)
class RoutedDocs:
    """Documents to score, each with the path that routing gave it."""

    tokens: DocumentTokens
    routes: np.ndarray  # row -> path
    pad_token_id: int
    what: str = "validation"  # the documents' name in the report ("validation", "corpus")


def score_routed(job: EvalJob, ckpt: Path, docs: RoutedDocs) -> dict:
    """The report of every path of checkpoint ``ckpt`` scored on the documents routed to it, and overall:
    the one scoring of `dipaco eval`, for the validation split and for any other corpus."""
    topology = job.topology
    bank = read_bank(ckpt, topology, job.llama)
    model = build_model(job.llama, device=job.device)
    scoring = Scoring(job.seq_len, job.prefix_tokens, job.eval.batch_size, docs.pad_token_id,
                      resolve_precision(job.eval.precision, job.device, "eval.precision"))
    per_path, nll_total, tok_total = [], 0.0, 0
    n_docs = len(docs.routes)
    bar = tqdm(total=_windows(docs.tokens, n_docs, job.seq_len, job.prefix_tokens), desc=f"eval {job.name}",
               unit="window", disable=not job.progress, dynamic_ncols=True, leave=False)
    for p in range(topology.num_paths):
        members = np.flatnonzero(docs.routes == p)
        bar.set_postfix(path=p)
        scores = score_rows(load_eval_path(job, bank, p, model), docs.tokens, members, scoring, bar.update)
        per_path.append({"path": p, "modules": [topology.modules[m].name for m in topology.path_modules(p)],
                         **_summary(scores, members.size, docs.what)})
        nll_total += float(scores.nll.sum())
        tok_total += int(scores.tokens.sum())
    bar.close()
    return {
        "experiment": job.name,
        "checkpoint": ckpt.name + (" (early-stopped paths)" if job.eval.early_stopping else ""),
        "topology": topology.describe(),
        "num_paths": topology.num_paths,
        "params_per_path": sum(p.numel() for p in model.parameters()),
        "params_total": sum(p.numel() for p in bank.params),
        "steps_per_path": int(ckpt.name.split("_")[-1]) * job.inner_steps,
        "prefix_tokens": job.prefix_tokens,
        "paths": per_path,
        "overall": {"docs": n_docs, "scored_tokens": tok_total, "nll": nll_total,
                    "ppl": math.exp(nll_total / tok_total) if tok_total else float("nan")},
    }


@dataclass(frozen=True)
class PretrainedEval:
    """The dense pretrained model's evaluation job (the initialisation every module starts from)."""

    eval: EvalConfig
    run_dir: Path
    seq_len: int
    prefix_tokens: int
    steps: int  # pretrain.steps, for the report
    device: torch.device
    progress: bool = True


def evaluate_pretrained(job: PretrainedEval, model: PreTrainedModel, prepared: Prepared) -> dict:
    """The dense pretrained ``model`` on all validation docs (the initialisation every module starts from)."""
    section, run_dir, seq_len, prefix_tokens = job.eval, job.run_dir, job.seq_len, job.prefix_tokens
    steps, device, progress = job.steps, job.device, job.progress
    check_eval(section)
    model = model.to(device)
    val = validation_split(section, prepared)
    tokens = DocumentTokens(val)
    with tqdm(total=_windows(tokens, len(val), seq_len, prefix_tokens), desc="eval pretrained", unit="window",
              disable=not progress, dynamic_ncols=True, leave=False) as bar:
        scoring = Scoring(seq_len, prefix_tokens, section.batch_size, prepared.tokenizer.pad_token_id,
                          resolve_precision(section.precision, device, "eval.precision"))
        scores = score_rows(model, tokens, np.arange(len(val)), scoring, bar.update)
    n = sum(p.numel() for p in model.parameters())
    report = {
        "experiment": "pretrained",
        "topology": "dense init",
        "num_paths": 1,
        "params_per_path": n,
        "params_total": n,
        "steps_per_path": steps,
        "prefix_tokens": prefix_tokens,
        "overall": _summary(scores, len(val)),
    }
    write_report(report, RunDir(run_dir).pretrain / REPORT)
    echo(f"[eval] pretrained dense model: validation ppl {report['overall']['ppl']:.2f} "
         f"on {report['overall']['scored_tokens']:,} tokens")
    return report


def write_report(report: dict, path: Path) -> None:
    """An eval report as JSON, written atomically (NaN as null)."""
    write_text(path, json_text.dumps(report, indent=2))


def print_path_table(report: dict) -> None:
    echo(f"[eval] {report['experiment']} ({report['topology']}), checkpoint {report['checkpoint']}")
    echo(f"{'path':>6} {'modules':<36} {'docs':>6} {'tokens':>9} {'ppl':>9}")
    for row in report["paths"]:
        echo(f"{row['path']:>6} {' '.join(row['modules']):<36} {row['docs']:>6} {row['scored_tokens']:>9} {row['ppl']:>9.2f}")
    o = report["overall"]
    echo(f"{'all':>6} {'':<36} {o['docs']:>6} {o['scored_tokens']:>9} {o['ppl']:>9.2f}")
