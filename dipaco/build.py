"""The composition root of `dipaco train`: what one rank trains, built in data-flow order.

    data -> topology -> sharding -> placement -> bank -> loops -> spec -> scheduler -> state -> checkpoints

:func:`build_trainer` reads top to bottom in that order. Each component gets its own config section (and
the few values of other sections it needs, by name); the functions after it build the parts that take
more than one line: the paths' shards, the dense init, and the round scheduler's early stopping and
validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, PreTrainedModel

from dipaco.checkpoint.migrate import ExperimentSections, describe_experiment
from dipaco.checkpoint.state import TrainingState
from dipaco.checkpoint.store import CheckpointManager
from dipaco.comm.placement import module_writers, paths_by_rank
from dipaco.comm.world import World
from dipaco.config import Config, EvalConfig, TrainConfig, parse_config, to_yaml
from dipaco.data.corpus import numpy_column
from dipaco.data.packing import DocumentTokens, PackedShard
from dipaco.data.prepare import Prepared
from dipaco.errors import DataError
from dipaco.eval.evaluate import validation_split
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.pretrained import load_pretrained, path_llama_config
from dipaco.model.scoring import Scoring
from dipaco.model.topology import Topology, topology_from_config
from dipaco.paths.early_stopping import PathEarlyStopping, early_stopping_holdout
from dipaco.paths.factory import LoopSettings, PathLoops
from dipaco.paths.validation import PathValidation
from dipaco.precision import resolve_precision
from dipaco.route.shards import (
    assign_paths,
    build_shards,
    document_ids,
    overlap_token_shares,
    path_weights,
    routed_data,
    training_paths,
)
from dipaco.run_dir import RunDir
from dipaco.sync import SyncContext, build_sync
from dipaco.train.experiment import BuiltExperiment
from dipaco.train.rounds import RoundOptions, RoundScheduler
from dipaco.train.tasks import TaskScheduler
from dipaco.train.trainer import CheckpointPolicy, Trainer, check_train


def build_trainer(cfg: Config, world: World, on_start: Callable[[TaskScheduler], None] | None = None) -> Trainer:
    """The trainer of this rank (``world``) for the experiment ``cfg.train.name``; ``on_start``: given the
    Ray task scheduler before its first task (``train.driver=ray``)."""
    train, device, seed = cfg.train, world.device, cfg.run.seed
    check_train(train)
    prepared, topology, sharding = sharded_data(cfg)
    by_rank = paths_by_rank([s.numel() for s in sharding.shards], world.size)
    mine = by_rank[world.rank]

    llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
    init = dense_init(llama, train.init, RunDir(cfg.run.dir), seed)
    bank = ModuleBank(topology, init.to(device), modules={m for p in mine for m in topology.path_modules(p)})
    path_loops = loops_factory(cfg, sharding)
    loops = {p: path_loops.build(p, bank.compose(p, build_model(llama, device=device)), device) for p in mine}

    sections = ExperimentSections(cfg.run, cfg.data, cfg.model, train, cfg.eval)
    spec = describe_experiment(sections, prepared.tokenizer, topology, sharding.doc_paths,
                               numpy_column(prepared.train, "num_tokens"))
    experiment = BuiltExperiment(spec=spec, config_yaml=to_yaml(cfg), run_dir=Path(cfg.run.dir),
                                 dir=RunDir(cfg.run.dir).experiment(train.name), rounds=train.rounds,
                                 inner_steps=train.inner_steps, topology=topology, world=world, by_rank=by_rank,
                                 weights=sharding.weights, bank=bank, path_loops=path_loops,
                                 load_path_loops=partial(path_loops_of, to_yaml(cfg), str(Path(cfg.run.dir).resolve())),
                                 loops=loops)

    scheduler: RoundScheduler | TaskScheduler
    if train.driver == "ray":
        scheduler = TaskScheduler(experiment, cfg.ray, cfg.outer, train.dynamic_local_steps, on_start)
    else:
        sync = build_sync(SyncContext(cfg.outer, cfg.dist, train.inner_steps, train.rounds, seed, topology, bank,
                                      sharding.weights, by_rank, world))
        scoring = Scoring(cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id,
                          resolve_precision(cfg.eval.precision, device, "eval.precision"))
        early_stopping = (path_early_stopping(experiment, prepared, sharding, train.early_stopping_holdout, scoring,
                                              llama)
                          if sharding.heldout.any() else None)
        validation = path_validation(experiment, prepared, cfg.eval, train, scoring, llama) if cfg.eval.every > 0 else None
        options = RoundOptions(train.log_every, cfg.run.progress, cfg.dist.comm_dtype,
                               report_dropped=cfg.outer.drop_prob > 0, diagnostics=train.diagnostics)
        scheduler = RoundScheduler(experiment, sync, options, early_stopping, validation)

    writers = module_writers(topology, by_rank)
    written_here = frozenset(bank.module_name(m) for m in bank.held if writers[m] == world.rank)
    state = TrainingState(bank, written_here, loops, scheduler.sync, scheduler, world.rank, by_rank)
    checkpoints = CheckpointManager(experiment.dir / "checkpoints", keep=train.keep_checkpoints)
    policy = CheckpointPolicy(every=train.checkpoint_every, background=train.checkpoint_background)
    return Trainer(experiment, scheduler, state, checkpoints, policy=policy)


def sharded_data(cfg: Config) -> tuple[Prepared, Topology, Sharding]:
    """The run's prepared data, the topology, and the training documents split into the paths' shards."""
    prepared = routed_data(cfg.run.dir, cfg.data, cfg.tokenizer, routed=cfg.train.sharding == "kmeans")
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    sharding = shard_documents(prepared, topology.num_paths, cfg.train, cfg.run.seed, cfg.route.topk, cfg.data.seq_len,
                               cfg.outer.weighting)
    return prepared, topology, sharding


def loops_factory(cfg: Config, sharding: Sharding) -> PathLoops:
    """Every path's inner-loop factory: its shard, the loop settings, the seed rule."""
    settings = LoopSettings.from_config(cfg.train, cfg.model, cfg.train.rounds * cfg.train.inner_steps, "train")
    return PathLoops(dict(enumerate(sharding.shards)), settings, cfg.run.seed)


def path_loops_of(config_yaml: str, run_dir: str) -> PathLoops:
    """:func:`loops_factory` built again from a run's resolved config and its prepared data in ``run_dir``: what
    a Ray path worker gets (a few kilobytes), where the factory would be the shards' row tables in the object
    store, which a restarted worker could not get back once the node holding them is gone."""
    cfg = parse_config(config_yaml, "the run's resolved config")
    cfg.run.dir = run_dir
    return loops_factory(cfg, sharded_data(cfg)[2])


@dataclass(frozen=True)
class Sharding:
    """The training documents' split into the paths' shards."""

    doc_paths: np.ndarray  # every training document's first path
    heldout: np.ndarray  # documents kept out of training for early stopping
    shards: list[PackedShard]  # path -> its packed sequences
    weights: dict[int, float]  # path -> its outer weight


def shard_documents(prepared: Prepared, num_paths: int, train: TrainConfig, seed: int, topk: int, seq_len: int,
                    weighting: str) -> Sharding:
    """The paths' shards of the training documents (``train.sharding``, ``route.topk`` paths a document), less
    the early-stopping holdout, and the paths' outer weights (``outer.weighting``)."""
    train_ds = prepared.train
    doc_paths = assign_paths(train_ds, num_paths, train.sharding, seed, train.shard_column)
    heldout = np.zeros(len(doc_paths), dtype=bool)
    if train.early_stopping_holdout > 0:
        heldout = early_stopping_holdout(document_ids(train_ds), train.early_stopping_holdout, seed)
    trains = training_paths(train_ds, doc_paths, num_paths, topk, train.sharding)
    # Without a holdout every document trains: no selection, and no copies of 8 bytes a document.
    kept = np.flatnonzero(~heldout) if heldout.any() else None
    if kept is not None:
        trains = trains[kept]
    shards = build_shards(train_ds if kept is None else train_ds.select(kept), trains, num_paths, seq_len,
                          prepared.tokenizer.eos_token_id)
    shares = None
    if trains.shape[1] > 1:  # overlapping shards; else every share is 1
        tokens = numpy_column(train_ds, "num_tokens")
        shares = overlap_token_shares(trains, num_paths, tokens if kept is None else tokens[kept])
    return Sharding(doc_paths, heldout, shards, path_weights(shards, weighting, shares))


def dense_init(llama: LlamaConfig, init: str, run: RunDir, seed: int) -> PreTrainedModel:
    """The dense model every path starts from: the run's pretrained one (``train.init=pretrained``) or a
    seeded random one."""
    if init == "pretrained":
        return load_pretrained(run.pretrain, llama, hint="run `dipaco pretrain` first, or set train.init=random")
    return build_model(llama, seed=seed)


def path_early_stopping(experiment: BuiltExperiment, prepared: Prepared, sharding: Sharding, fraction: float,
                        scoring: Scoring, llama: LlamaConfig) -> PathEarlyStopping:
    """Early stopping for this rank's paths, each judged on the held-out documents routed to it
    (``train.early_stopping_holdout``: ``fraction``)."""
    # Only the held-out documents of this rank's paths are read, as int32 arrays (a Python list of ints takes
    # several times the memory).
    tokens = DocumentTokens(prepared.train)
    docs = {p: tokens.documents(np.flatnonzero(sharding.heldout & (sharding.doc_paths == p)), np.int32)
            for p in experiment.paths}
    starved = [p for p, d in docs.items() if not d]
    if starved:
        raise DataError(f"train.early_stopping_holdout={fraction} leaves paths {starved} without held-out "
                        f"documents; raise it")
    return PathEarlyStopping(experiment.dir / "early_stopping", docs, scoring,
                             build_model(llama, device=experiment.world.device))


def path_validation(experiment: BuiltExperiment, prepared: Prepared, section: EvalConfig, train: TrainConfig,
                    scoring: Scoring, llama: LlamaConfig) -> PathValidation:
    """``eval.every``: this rank's paths scored on the validation slice (``eval.max_docs``) routed to them."""
    val = validation_split(section, prepared)
    routes = assign_paths(val, experiment.topology.num_paths, train.sharding, experiment.spec.sharding.seed,
                          train.shard_column)
    tokens = DocumentTokens(val)
    docs = {p: tokens.documents(np.flatnonzero(routes == p), np.int32) for p in experiment.paths}
    device = experiment.world.device
    # The scratch model's random init must not move the RNG that training (and its checkpoint) carries on.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        scratch = build_model(llama, device=device)
    return PathValidation(docs, scoring, scratch, section.every)
