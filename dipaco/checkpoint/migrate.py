"""What an experiment is, described once from its config: the spec training writes, and the migration of
runs trained before specs existed.

:func:`describe_experiment` is the one place a spec is made from config sections: the training build
(:func:`dipaco.build.build_trainer`) calls it, and so does :func:`convert_experiment`, which writes the spec
of an old experiment from the ``config.yaml`` it kept, deriving its shards' sizes once from the run's data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dipaco.checkpoint.spec import SPEC, ExperimentSpec, ShardingRef, TokenizerRef, spec_file
from dipaco.checkpoint.store import CONFIG, CheckpointManager
from dipaco.config import DataConfig, EvalConfig, ModelConfig, RunConfig, TrainConfig, merge_config
from dipaco.data.corpus import numpy_column
from dipaco.errors import ConfigError
from dipaco.metrics import echo
from dipaco.model.topology import Topology, topology_from_config
from dipaco.route.shards import assign_paths, routed_data
from dipaco.run_dir import RunDir


@dataclass(frozen=True)
class ExperimentSections:
    """The config sections a spec records."""

    run: RunConfig
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    eval: EvalConfig


def describe_experiment(sections: ExperimentSections, tokenizer: Any, topology: Topology, doc_paths: np.ndarray,
                        tokens: np.ndarray) -> ExperimentSpec:
    """The spec of the experiment ``sections.train.name``; ``doc_paths``/``tokens``: every training document's
    first path and its tokens (the shards' sizes)."""
    run, train, n = RunDir(sections.run.dir), sections.train, topology.num_paths
    sharding = ShardingRef(rule=train.sharding, column=train.shard_column, seed=sections.run.seed,
                           routing=run.routing.name if train.sharding == "kmeans" else None,
                           docs=np.bincount(doc_paths, minlength=n).tolist(),
                           tokens=np.bincount(doc_paths, weights=tokens, minlength=n).astype(np.int64).tolist())
    tokenizer_ref = TokenizerRef(dir=run.tokenizer.name, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
    return ExperimentSpec(name=train.name, model=asdict(sections.model), topology=topology.to_dict(), tokenizer=tokenizer_ref,
                          seq_len=sections.data.seq_len, prefix_tokens=sections.data.prefix_tokens, sharding=sharding,
                          precision={"train": train.precision, "eval": sections.eval.precision})


def convert_experiment(run_dir: str | Path, experiment: str | None = None) -> Path:
    """Writes the experiment spec of an experiment trained before specs existed (or returns the one it has):
    read once from its stored ``config.yaml``, its shards' sizes derived once from the run's data."""
    run = RunDir(run_dir)
    exp_dir = run.experiment(experiment) if experiment else _only_experiment(run)
    found = spec_file(exp_dir)
    if found is not None:
        return found
    latest = CheckpointManager(exp_dir / "checkpoints").latest()
    if latest is not None and (latest / SPEC).is_file():  # the experiment's copy was removed: the checkpoint has one
        return ExperimentSpec.from_json((latest / SPEC).read_text(encoding="utf-8"), str(latest / SPEC)).write(exp_dir)
    stored = exp_dir / CONFIG
    if not stored.is_file():
        raise ConfigError(f"{exp_dir}: no {stored.name}; it is not a trained experiment (run `dipaco train` first)")
    cfg = merge_config(stored)
    cfg = merge_config(None, [f"run.dir={run.root}"], base=cfg)  # the stored run.dir may be another machine's
    prepared = routed_data(cfg.run.dir, cfg.data, cfg.tokenizer, routed=cfg.train.sharding == "kmeans")
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    doc_paths = assign_paths(prepared.train, topology.num_paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    sections = ExperimentSections(cfg.run, cfg.data, cfg.model, cfg.train, cfg.eval)
    spec = describe_experiment(sections, prepared.tokenizer, topology, doc_paths, numpy_column(prepared.train, "num_tokens"))
    path = spec.write(exp_dir)
    echo(f"[spec] {exp_dir.name}: wrote {path} from its {stored.name} (trained before experiment specs)")
    return path


def _only_experiment(run: RunDir) -> Path:
    found = [e for e in run.experiments() if (e / CONFIG).is_file()]
    if len(found) != 1:
        names = ", ".join(e.name for e in found) or "none"
        raise ConfigError(f"{run.root}: choose the experiment to convert with --experiment (the run has: {names})")
    return found[0]
