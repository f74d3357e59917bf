"""`dipaco eval`: validation perplexity per path and overall, with the routing prefix excluded.

Each validation document is routed by the same rule as training documents, scored on its own (no
packing with other documents) by its path's model, and only tokens after the first
``data.prefix_tokens`` count: the paper measures every model, baselines included, this way.
Perplexities are token-weighted: overall ppl = exp(total NLL / total scored tokens).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from transformers import PreTrainedModel

from dipaco.atomic import write_text
from dipaco.checkpoint.experiment import experiment_checkpoint
from dipaco.config import Config
from dipaco.data.prepare import Prepared, load_prepared
from dipaco.eval.scoring import Scores, score_documents
from dipaco.metrics import echo
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.precision import resolve_precision
from dipaco.route.shards import assign_paths
from dipaco.run_dir import RunDir
from dipaco.runtime import resolve_device
from dipaco.train.early_stopping import load_best_path
from dipaco.train.pretrain import load_pretrained, path_llama_config

REPORT = "eval.json"


def _summary(scores: Scores, n_docs: int) -> dict:
    return {
        "docs": n_docs,
        "scored_tokens": int(scores.tokens.sum()),
        "nll": float(scores.nll.sum()),
        "ppl": scores.perplexity,
    }


def validation_docs(cfg: Config, prepared: Prepared) -> tuple[list[list[int]], object]:
    val = prepared.validation
    if cfg.eval.max_docs is not None:
        val = val.select(range(min(cfg.eval.max_docs, len(val))))
    return val["input_ids"], val


def load_eval_path(cfg: Config, exp_dir: Path, bank: ModuleBank, path: int, model: PreTrainedModel) -> PreTrainedModel:
    """Loads what evaluation scores for ``path`` into ``model``: its early-stopped parameters with
    ``eval.early_stopping``, else its composition from the checkpoint's bank."""
    if cfg.eval.early_stopping:
        return load_best_path(exp_dir / "early_stopping", path, model)
    return bank.compose(path, model)


def evaluate_experiment(cfg: Config, checkpoint: str | None = None) -> dict:
    """Scores every path of the experiment's newest (or given) checkpoint on its routed validation docs."""
    prepared = load_prepared(cfg)
    exp_dir, ckpt, topology, bank = experiment_checkpoint(cfg, prepared, checkpoint)
    docs, val = validation_docs(cfg, prepared)
    routes = assign_paths(val, topology.num_paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)

    device = resolve_device(cfg.run.device)
    model = build_model(path_llama_config(cfg, prepared), device=device)
    precision = resolve_precision(cfg.eval.precision, device, "eval.precision")
    per_path, nll_total, tok_total = [], 0.0, 0
    for p in range(topology.num_paths):
        members = np.flatnonzero(routes == p)
        scores = score_documents(
            load_eval_path(cfg, exp_dir, bank, p, model), [docs[int(i)] for i in members], cfg.data.seq_len,
            cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id, precision,
        )
        per_path.append({"path": p, "modules": [topology.modules[m].name for m in topology.path_modules(p)],
                         **_summary(scores, members.size)})
        nll_total += float(scores.nll.sum())
        tok_total += int(scores.tokens.sum())
    report = {
        "experiment": cfg.train.name,
        "checkpoint": ckpt.name + (" (early-stopped paths)" if cfg.eval.early_stopping else ""),
        "topology": topology.describe(),
        "num_paths": topology.num_paths,
        "params_per_path": sum(p.numel() for p in model.parameters()),
        "params_total": sum(p.numel() for p in bank.params),
        "steps_per_path": int(ckpt.name.split("_")[-1]) * cfg.train.inner_steps,
        "prefix_tokens": cfg.data.prefix_tokens,
        "paths": per_path,
        "overall": {"docs": len(docs), "scored_tokens": tok_total, "nll": nll_total,
                    "ppl": math.exp(nll_total / tok_total) if tok_total else float("nan")},
    }
    _write(report, exp_dir / REPORT)
    print_path_table(report)
    return report


def evaluate_pretrained(cfg: Config) -> dict:
    """The dense pretrained model on all validation docs (the initialisation every module starts from)."""
    prepared = load_prepared(cfg, routed=False)
    device = resolve_device(cfg.run.device)
    model = load_pretrained(cfg, prepared).to(device)
    docs, _ = validation_docs(cfg, prepared)
    scores = score_documents(model, docs, cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size,
                             prepared.tokenizer.pad_token_id, resolve_precision(cfg.eval.precision, device, "eval.precision"))
    n = sum(p.numel() for p in model.parameters())
    report = {
        "experiment": "pretrained",
        "topology": "dense init",
        "num_paths": 1,
        "params_per_path": n,
        "params_total": n,
        "steps_per_path": cfg.pretrain.steps,
        "prefix_tokens": cfg.data.prefix_tokens,
        "overall": _summary(scores, len(docs)),
    }
    _write(report, RunDir(cfg.run.dir).pretrain / REPORT)
    echo(f"[eval] pretrained dense model: validation ppl {report['overall']['ppl']:.2f} "
         f"on {report['overall']['scored_tokens']:,} tokens")
    return report


def _write(report: dict, path: Path) -> None:
    write_text(path, json.dumps(report, indent=2))


def print_path_table(report: dict) -> None:
    echo(f"[eval] {report['experiment']} ({report['topology']}), checkpoint {report['checkpoint']}")
    echo(f"{'path':>6} {'modules':<36} {'docs':>6} {'tokens':>9} {'ppl':>9}")
    for row in report["paths"]:
        echo(f"{row['path']:>6} {' '.join(row['modules']):<36} {row['docs']:>6} {row['scored_tokens']:>9} {row['ppl']:>9.2f}")
    o = report["overall"]
    echo(f"{'all':>6} {'':<36} {o['docs']:>6} {o['scored_tokens']:>9} {o['ppl']:>9.2f}")


def training_compute(report: dict) -> int:
    """Paths x steps per path x parameters per path: training FLOPs up to a constant (each step of
    each path is a forward and backward pass over the same number of tokens)."""
    return report["num_paths"] * report["steps_per_path"] * report["params_per_path"]


def comparison_table(run_dir: str | Path) -> str:
    """One row per evaluated model of a run: the pretrained init and every experiment, with the compute
    each trained for beside its steps per path (relative: to the cheapest experiment)."""
    run = RunDir(run_dir)
    reports = [run.pretrain / REPORT] + [e / REPORT for e in run.experiments()]
    rows = [json.loads(p.read_text()) for p in reports if p.is_file()]
    trained = [training_compute(r) for r in rows if r["experiment"] != "pretrained" and training_compute(r) > 0]
    unit = min(trained) if trained else None
    header = (f"{'model':<18} {'topology':<44} {'params/path':>11} {'params total':>12} {'steps/path':>10} "
              f"{'compute':>9} {'relative':>8} {'val ppl':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        compute = training_compute(r)
        relative = f"{compute / unit:.3g}x" if unit and r["experiment"] != "pretrained" else "-"
        lines.append(
            f"{r['experiment']:<18} {r['topology']:<44} {r['params_per_path']:>11,} {r['params_total']:>12,} "
            f"{r['steps_per_path']:>10} {compute:>9.3g} {relative:>8} {r['overall']['ppl']:>9.2f}"
        )
    lines.append("compute = paths x steps/path x params/path; relative to the cheapest experiment")
    return "\n".join(lines)
