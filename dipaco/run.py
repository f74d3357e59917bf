"""The composition root: every job of a run, wired from one resolved config.

This module and the CLI are the only code that reads the whole :class:`~dipaco.config.Config`. Each
component gets its own section (and the few values of other sections it needs, by name), checks it
when it is built, and knows nothing of the rest:

    corpus -> data (prepare) -> pretrain -> route (features -> k-means -> shards)
      -> train: paths (inner AdamW) -> outer sync (per-module DiLoCo) over comm -> checkpoint
      -> eval / serve (one routed path per input)

:func:`load_config` is the config loader of every entry point: the schema (:mod:`dipaco.config`:
types, unknown keys, choices), then every component's own check (:func:`check_config`), so a bad
value fails before any job starts, with one error naming its key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from dipaco.checkpoint.spec import SPEC, ExperimentSpec, ShardingRef, TokenizerRef, read_spec, spec_file
from dipaco.checkpoint.state import TrainingState
from dipaco.checkpoint.store import CONFIG, CheckpointManager, resolve_checkpoint
from dipaco.comm.placement import check_world_size, module_writers, paths_by_rank
from dipaco.comm.world import DistEnv, World, check_dist, check_same_config, detect_env, init_world, rank_device
from dipaco.config import Config, ModelConfig, config_diff, flatten, given_keys, merge_config, to_yaml
from dipaco.data.corpus import numpy_column
from dipaco.data.packing import DocumentTokens, PackedShard
from dipaco.data.prepare import Prepared, check_data, check_tokenizer, corpus_spec, load_prepared, prepare
from dipaco.data.tokenizer import load_tokenizer
from dipaco.errors import ConfigError, DataError
from dipaco.eval.evaluate import (
    EvalJob,
    PretrainedEval,
    check_eval,
    evaluate_experiment,
    evaluate_pretrained,
    validation_split,
)
from dipaco.eval.report import comparison_table
from dipaco.eval.reroute_eval import reroute_evaluate
from dipaco.metrics import WandbRun, check_metrics, echo, tracking
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model, check_model
from dipaco.model.pretrained import check_vocabulary, load_pretrained, path_llama_config
from dipaco.model.scoring import Scoring
from dipaco.model.source import resolve_init_from
from dipaco.model.topology import Topology, check_topology, topology_from_config
from dipaco.paths.early_stopping import PathEarlyStopping, early_stopping_holdout
from dipaco.paths.factory import LoopSettings, PathLoops
from dipaco.paths.validation import PathValidation
from dipaco.precision import resolve_precision
from dipaco.route.assign import RouteJob, check_route, route
from dipaco.route.shards import (
    assign_paths,
    build_shards,
    document_ids,
    overlap_token_shares,
    path_weights,
    training_paths,
    with_routing,
)
from dipaco.run_dir import RunDir
from dipaco.runtime import check_run, resolve_device, seed_everything
from dipaco.sync import ASYNC_SYNCS, SyncContext, build_sync, check_outer
from dipaco.train.experiment import BuiltExperiment
from dipaco.train.pretrain import RESUME_KEYS, PretrainJob, check_pretrain, pretrain, stopped_config
from dipaco.train.reroute import RerouteJob, reroute
from dipaco.train.resharding import EMPlan, check_em, train_em
from dipaco.train.rounds import RoundOptions, RoundScheduler
from dipaco.train.tasks import TaskScheduler, check_ray
from dipaco.train.trainer import CheckpointPolicy, Trainer, check_train


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema defaults <- YAML file <- dotlist overrides, then every component's check."""
    cfg = merge_config(path, overrides)
    cfg.model, cfg.tokenizer = resolve_init_from(cfg.model, cfg.tokenizer, given_keys(path, overrides, "model"))
    check_config(cfg)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with dotlist overrides applied and checked (for scripts and tests)."""
    changed = merge_config(None, overrides, base=cfg)
    changed.model, changed.tokenizer = resolve_init_from(changed.model, changed.tokenizer,
                                                         given_keys(None, overrides, "model"))
    check_config(changed)
    return changed


def check_config(cfg: Config) -> None:
    """Every component's check of its own section; the first error names its key."""
    check_outer(cfg.outer, cfg.train.inner_steps)
    check_run(cfg.run)
    check_data(cfg.data)
    check_tokenizer(cfg.tokenizer)
    check_model(cfg.model, cfg.data.seq_len)
    check_topology(cfg.topology)
    check_pretrain(cfg.pretrain)
    check_train(cfg.train)
    check_dist(cfg.dist)
    check_ray(cfg.ray, cfg.train, cfg.outer, cfg.dist, list(ASYNC_SYNCS), cfg.eval.every)
    check_route(cfg.route, cfg.data.prefix_tokens)
    check_eval(cfg.eval)
    check_metrics(cfg.metrics)
    if cfg.route.em_rounds:
        check_em(cfg.route, cfg.train, topology_from_config(cfg.topology, cfg.model.num_layers).num_paths)


class Run:
    """The jobs of one run directory under one resolved config (``dipaco <job>`` calls one of them)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    # --- what several jobs share ----------------------------------------------------------------------
    def prepared(self, routed: bool | None = None) -> Prepared:
        """The prepared data; ``routed`` (default: train.sharding=kmeans) with the ``path`` column of `dipaco route`."""
        cfg = self.cfg
        prepared = load_prepared(cfg.run.dir, cfg.data, cfg.tokenizer)
        routed = cfg.train.sharding == "kmeans" if routed is None else routed
        return with_routing(prepared, cfg.run.dir) if routed else prepared

    def topology(self) -> Topology:
        return topology_from_config(self.cfg.topology, self.cfg.model.num_layers)

    def pretrained(self, prepared: Prepared) -> LlamaForCausalLM:
        cfg = self.cfg
        llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
        return load_pretrained(RunDir(cfg.run.dir).pretrain, llama)

    def eval_job(self, prepared: Prepared | None = None) -> EvalJob:
        """Evaluation of the experiment as it was trained: its spec, not this config, gives the model's shape,
        topology, lengths and routing rule."""
        cfg = self.cfg
        spec = self.trained_spec()
        return EvalJob(eval=cfg.eval, run_dir=Path(cfg.run.dir), name=cfg.train.name, sharding=spec.sharding.rule,
                       shard_column=spec.sharding.column, seed=spec.sharding.seed, topology=spec.build_topology(),
                       llama=spec.llama_config(), seq_len=spec.seq_len, prefix_tokens=spec.prefix_tokens,
                       device=resolve_device(cfg.run.device), inner_steps=cfg.train.inner_steps,
                       progress=cfg.run.progress)

    def trained_spec(self) -> ExperimentSpec:
        """The spec of the trained experiment ``train.name`` (converted once for a run trained before specs)."""
        exp_dir = RunDir(self.cfg.run.dir).experiment(self.cfg.train.name)
        if not (exp_dir / CONFIG).is_file():  # not trained: the checkpoint reader's own error says so
            resolve_checkpoint(CheckpointManager(exp_dir / "checkpoints"))
        convert_experiment(self.cfg.run.dir, exp_dir.name)
        spec = read_spec(exp_dir)
        cfg = self.cfg
        declared = {"train.sharding": (cfg.train.sharding, spec.sharding.rule),
                    "data.seq_len": (cfg.data.seq_len, spec.seq_len),
                    "data.prefix_tokens": (cfg.data.prefix_tokens, spec.prefix_tokens),
                    # a key the spec predates had its default then
                    **{f"model.{k}": (v, spec.model.get(k, getattr(ModelConfig, k))) for k, v in asdict(cfg.model).items()},
                    "topology": (self.topology().describe(), spec.build_topology().describe())}
        differ = [f"{key}={mine} against {key}={theirs}" for key, (mine, theirs) in declared.items() if mine != theirs]
        if differ:
            raise ConfigError(f"this config does not describe experiment {spec.name} as it was trained "
                              f"({exp_dir / SPEC}): {'; '.join(differ)}; use the config it was trained with")
        return spec

    # --- the jobs -----------------------------------------------------------------------------------------
    def prepare(self) -> dict:
        cfg = self.cfg
        if cfg.model.init_from is not None:  # before anything is written: the checkpoint's tokenizer fits its embedding
            check_vocabulary(len(load_tokenizer(cfg.model.init_from)), cfg.model)  # resolved: tokenizer.path is it
        return prepare(cfg.run.dir, cfg.data, cfg.tokenizer, to_yaml(cfg), progress=cfg.run.progress)

    def pretrain(self, resume: bool = False) -> None:
        """``resume``: continue a pretraining a signal stopped (its step checkpoint in pretrain.work), whose
        config must match this one in every key that changes what pretraining computes."""
        cfg = self.cfg
        saved = stopped_config(cfg.run.dir)
        if resume and saved is not None:
            diff = [d for d in config_diff(merge_config(saved), cfg) if d.startswith(RESUME_KEYS)]
            if diff:
                raise ConfigError(f"cannot resume the pretraining in {saved.parent}: the config changed ({'; '.join(diff)})")
        job = PretrainJob(cfg.run, cfg.pretrain, cfg.model, cfg.data.seq_len, cfg.train.log_every, to_yaml(cfg), resume)
        with tracking(self.wandb_run("pretrain", RunDir(cfg.run.dir).root / "pretrain.wandb_id", resume)):
            pretrain(job, self.prepared(routed=False))

    def wandb_run(self, job: str, id_file: Path, resume: bool) -> WandbRun:
        """The W&B run of a job (``metrics.wandb``): named ``<job>/<experiment>`` unless metrics.wandb_run_name
        says otherwise, with this resolved config as its config; ``id_file`` keeps its id for ``resume``."""
        cfg = self.cfg
        name = job if job == "pretrain" else f"{job}/{cfg.train.name}"
        return WandbRun(cfg.metrics, name, asdict(cfg), Path(cfg.run.dir), id_file, resume)

    def route(self) -> dict:
        cfg = self.cfg
        prepared = self.prepared(routed=False)
        job = RouteJob(route=cfg.route, run_dir=Path(cfg.run.dir), prefix_tokens=cfg.data.prefix_tokens,
                       seed=cfg.run.seed, device=resolve_device(cfg.run.device), deterministic=cfg.run.deterministic,
                       progress=cfg.run.progress, pretrained=lambda: self.pretrained(prepared))
        return route(job, prepared, self.topology())

    def reroute(self, checkpoint: str | None = None, device: str | None = None, hint: bool = True) -> dict:
        cfg = self.cfg
        prepared = self.prepared(routed=False)  # the tokenizer, for the paths' shape; the routed splits below
        device_ = resolve_device(device or cfg.run.device)
        job = RerouteJob(route=cfg.route, run_dir=Path(cfg.run.dir), name=cfg.train.name,
                         routed=cfg.train.sharding == "kmeans", topology=self.topology(),
                         llama=path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len), seed=cfg.run.seed,
                         device=device_, precision=resolve_precision(cfg.eval.precision, device_, "eval.precision"),
                         seq_len=cfg.data.seq_len, prefix_tokens=cfg.data.prefix_tokens, batch_size=cfg.eval.batch_size,
                         deterministic=cfg.run.deterministic)
        return reroute(job, lambda: self.prepared(routed=True), checkpoint=checkpoint, hint=hint)

    def train(self, resume: bool = False, resume_from: str | None = None, until_round: int | None = None,
              on_start: Callable[[TaskScheduler], None] | None = None) -> Trainer:
        """Trains in this process, or as one rank of a torchrun job (WORLD_SIZE > 1); ``train.driver=ray``
        runs the task scheduler from this process (``on_start``: called with it before its first task)."""
        cfg = self.cfg
        env = detect_env() if cfg.train.driver == "torchrun" else DistEnv()
        check_world_size(self.topology().num_paths, env.world_size)  # on every rank, before any collective
        device = rank_device(cfg.run.device, env)
        seed_everything(cfg.run.seed, device, cfg.run.deterministic)
        world = init_world(cfg.dist, env, device)

        def segment(resume: bool, resume_from: str | None, until_round: int | None) -> Trainer:
            check_same_config(world, flatten(cfg), {"resume": resume, "resume_from": resume_from,
                                                    "until_round": until_round})
            trainer, error = None, None
            try:
                trainer = build_trainer(cfg, world, on_start)
            except Exception as exc:  # shared with every rank, so none waits for a rank that gave up
                error = exc
            world.agree(error, "setting up the experiment")
            assert trainer is not None
            return trainer.train(resume, resume_from, until_round)

        wandb_run = self.wandb_run("train", RunDir(cfg.run.dir).experiment(cfg.train.name) / "wandb_id",
                                   resume or resume_from is not None)
        try:
            with tracking(wandb_run):  # rank 0 (the Ray driver) logs the metrics, so it alone starts the W&B run
                if cfg.route.em_rounds:  # EM-style re-sharding: segments up to each point, re-route, continue
                    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
                    plan = EMPlan(points=list(cfg.route.em_rounds), rounds=cfg.train.rounds, run_dir=Path(cfg.run.dir),
                                  exp_dir=exp_dir, check_resume=self.check_resume,
                                  reroute=lambda ckpt: self.reroute(str(ckpt), device=str(world.device), hint=False))
                    return train_em(plan, world, resume, resume_from, until_round, segment)
                return segment(resume, resume_from, until_round)
        finally:
            world.close()

    def evaluate(self, checkpoint: str | None = None) -> dict:
        prepared = self.prepared()
        return evaluate_experiment(self.eval_job(prepared), prepared, checkpoint)

    def evaluate_corpus(self, source: str, checkpoint: str | None = None) -> dict:
        """`dipaco eval --corpus`: the experiment on the documents of ``source``, read with this config's data keys.
        The prepared data is not read (only the experiment's tokenizer), so ``data.text_field`` and the other
        reading keys may name the other corpus's columns."""
        from dipaco.eval.corpus_eval import CorpusJob, evaluate_corpus

        cfg = self.cfg
        spec = self.trained_spec()
        tokenizer = load_tokenizer(RunDir(cfg.run.dir).root / spec.tokenizer.dir)
        spec.check_tokenizer(tokenizer)
        llama = path_llama_config(cfg.model, tokenizer, cfg.data.seq_len)
        corpus = CorpusJob(corpus_spec(replace(cfg.data, corpus=source)), tokenizer,
                           featurizer=lambda: load_pretrained(RunDir(cfg.run.dir).pretrain, llama),
                           route_precision=cfg.route.precision, route_batch_size=cfg.route.batch_size)
        return evaluate_corpus(self.eval_job(), corpus, checkpoint)

    def evaluate_pretrained(self) -> dict:
        cfg = self.cfg
        prepared = self.prepared(routed=False)
        job = PretrainedEval(cfg.eval, Path(cfg.run.dir), cfg.data.seq_len, cfg.data.prefix_tokens, cfg.pretrain.steps,
                             resolve_device(cfg.run.device), progress=cfg.run.progress)
        return evaluate_pretrained(job, self.pretrained(prepared), prepared)

    def reroute_evaluate(self, every: Sequence[int], checkpoint: str | None = None) -> dict:
        cfg = self.cfg
        unrouted = self.prepared(routed=False)
        return reroute_evaluate(self.eval_job(unrouted), lambda: self.prepared(routed=True), every, checkpoint,
                                featurizer=lambda: self.pretrained(unrouted), route_precision=cfg.route.precision,
                                route_batch_size=cfg.route.batch_size)

    def report(self) -> str:
        return comparison_table(self.cfg.run.dir)

    # --- the experiment of `dipaco train` ------------------------------------------------------------------
    def sharding(self, prepared: Prepared, topology: Topology) -> Sharding:
        """The paths' shards of the training documents, and their outer weights."""
        cfg = self.cfg
        train, train_ds = cfg.train, prepared.train
        doc_paths = assign_paths(train_ds, topology.num_paths, train.sharding, cfg.run.seed, train.shard_column)
        heldout = np.zeros(len(doc_paths), dtype=bool)
        if train.early_stopping_holdout > 0:
            heldout = early_stopping_holdout(document_ids(train_ds), train.early_stopping_holdout, cfg.run.seed)
        trains = training_paths(train_ds, doc_paths, topology.num_paths, cfg.route.topk, train.sharding)
        # Without a holdout every document trains: no selection, and no copies of 8 bytes a document.
        kept = np.flatnonzero(~heldout) if heldout.any() else None
        if kept is not None:
            trains = trains[kept]
        shards = build_shards(train_ds if kept is None else train_ds.select(kept), trains, topology.num_paths,
                              cfg.data.seq_len, prepared.tokenizer.eos_token_id)
        shares = None
        if trains.shape[1] > 1:  # overlapping shards; else every share is 1
            tokens = numpy_column(train_ds, "num_tokens")
            shares = overlap_token_shares(trains, topology.num_paths, tokens if kept is None else tokens[kept])
        return Sharding(doc_paths, heldout, shards, path_weights(shards, cfg.outer.weighting, shares))

    def experiment_spec(self, tokenizer: Any, topology: Topology, doc_paths: np.ndarray,
                        tokens: np.ndarray) -> ExperimentSpec:
        """What the experiment of ``cfg`` is, for everything after training (:mod:`dipaco.checkpoint.spec`);
        ``doc_paths``/``tokens``: every training document's first path and its tokens (the shards' sizes)."""
        cfg, n = self.cfg, topology.num_paths
        run_dir = RunDir(cfg.run.dir)
        sharding = ShardingRef(rule=cfg.train.sharding, column=cfg.train.shard_column, seed=cfg.run.seed,
                               routing=run_dir.routing.name if cfg.train.sharding == "kmeans" else None,
                               docs=np.bincount(doc_paths, minlength=n).tolist(),
                               tokens=np.bincount(doc_paths, weights=tokens, minlength=n).astype(np.int64).tolist())
        return ExperimentSpec(name=cfg.train.name, model=asdict(cfg.model), topology=topology.to_dict(),
                              tokenizer=TokenizerRef(dir=run_dir.tokenizer.name, vocab_size=len(tokenizer),
                                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
                              seq_len=cfg.data.seq_len, prefix_tokens=cfg.data.prefix_tokens, sharding=sharding,
                              precision={"train": cfg.train.precision, "eval": cfg.eval.precision})

    def build_experiment(self, world: World) -> tuple[BuiltExperiment, Prepared, Sharding]:
        """The record of one rank's experiment (:class:`dipaco.train.experiment.BuiltExperiment`), with the data
        and sharding it came from (early stopping reads its held-out documents)."""
        cfg = self.cfg
        train, device = cfg.train, world.device
        topology = topology_from_config(cfg.topology, cfg.model.num_layers)
        prepared = self.prepared()
        sharding = self.sharding(prepared, topology)
        by_rank = paths_by_rank([s.numel() for s in sharding.shards], world.size)
        mine = by_rank[world.rank]
        llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
        init = (load_pretrained(RunDir(cfg.run.dir).pretrain, llama,
                                hint="run `dipaco pretrain` first, or set train.init=random")
                if train.init == "pretrained" else build_model(llama, seed=cfg.run.seed))
        bank = ModuleBank(topology, init.to(device), modules={m for p in mine for m in topology.path_modules(p)})
        settings = LoopSettings.from_config(train, cfg.model, train.rounds * train.inner_steps, "train")
        path_loops = PathLoops(dict(enumerate(sharding.shards)), settings, cfg.run.seed)
        loops = {p: path_loops.build(p, bank.compose(p, build_model(llama, device=device)), device) for p in mine}
        spec = self.experiment_spec(prepared.tokenizer, topology, sharding.doc_paths, numpy_column(prepared.train, "num_tokens"))
        experiment = BuiltExperiment(spec=spec, config_yaml=to_yaml(cfg), run_dir=Path(cfg.run.dir),
                                     dir=RunDir(cfg.run.dir).experiment(train.name), rounds=train.rounds,
                                     inner_steps=train.inner_steps, topology=topology, world=world, by_rank=by_rank,
                                     weights=sharding.weights, bank=bank, path_loops=path_loops, loops=loops)
        return experiment, prepared, sharding

    def early_stopping(self, experiment: BuiltExperiment, held: HeldOut,
                       scratch_model: PreTrainedModel) -> PathEarlyStopping:
        """Early stopping for this rank's paths, each judged on the held-out docs routed to it."""
        cfg = self.cfg
        # Only the held-out documents of this rank's paths are read, as int32 arrays (a Python list took
        # about 9x the memory).
        tokens = DocumentTokens(held.prepared.train)
        docs = {p: tokens.documents(np.flatnonzero(held.mask & (held.doc_paths == p)), np.int32) for p in experiment.paths}
        starved = [p for p, d in docs.items() if not d]
        if starved:
            raise DataError(f"train.early_stopping_holdout={held.fraction} leaves paths {starved} without held-out "
                            f"documents; raise it")
        device = next(scratch_model.parameters()).device
        return PathEarlyStopping(experiment.dir / "early_stopping", docs, Scoring(
            cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, held.prepared.tokenizer.pad_token_id,
            resolve_precision(cfg.eval.precision, device, "eval.precision")), scratch_model)

    def validation(self, experiment: BuiltExperiment, prepared: Prepared) -> PathValidation:
        """``eval.every``: this rank's paths scored on the validation slice (``eval.max_docs``) routed to them."""
        cfg = self.cfg
        val = validation_split(cfg.eval, prepared)
        routes = assign_paths(val, experiment.topology.num_paths, cfg.train.sharding, cfg.run.seed,
                              cfg.train.shard_column)
        tokens = DocumentTokens(val)
        docs = {p: tokens.documents(np.flatnonzero(routes == p), np.int32) for p in experiment.paths}
        device = experiment.world.device
        llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
        scoring = Scoring(cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id,
                          resolve_precision(cfg.eval.precision, device, "eval.precision"))
        # The scratch model's random init must not move the RNG that training (and its checkpoint) carries on.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            scratch = build_model(llama, device=device)
        return PathValidation(docs, scoring, scratch, cfg.eval.every)

    def check_resume(self, checkpoint: Path) -> None:
        """Refuses to resume from a checkpoint whose saved config differs from this run's in a key that
        changes what the run computes (:func:`dipaco.config.config_diff`)."""
        saved = merge_config(checkpoint / "config.yaml")
        diff = config_diff(saved, self.cfg)
        longer = self.cfg.train.rounds > saved.train.rounds
        if longer:  # more rounds continue the run; only the inner LR schedule sees the new length
            diff = [d for d in diff if not d.startswith("train.rounds:")]
        if diff:
            hint = ("; a run is shortened with --until-round, not train.rounds"
                    if self.cfg.train.rounds < saved.train.rounds else "")
            raise ConfigError(f"cannot resume {checkpoint}: the config changed ({'; '.join(diff)}){hint}")
        if longer:
            echo(f"[train] extending the run from {saved.train.rounds} to {self.cfg.train.rounds} rounds: each path's "
                 f"warmup-cosine learning rate now spans {self.cfg.train.rounds * self.cfg.train.inner_steps} steps, so "
                 f"it rises from where the shorter schedule left it to that step's value on the longer one")


@dataclass(frozen=True)
class Sharding:
    """The training documents' split into the paths' shards, as one run derives it."""

    doc_paths: np.ndarray  # every training document's first path
    heldout: np.ndarray  # documents kept out of training for early stopping
    shards: list[PackedShard]  # path -> its packed sequences
    weights: dict[int, float]  # path -> its outer weight


def build_trainer(cfg: Config, world: World, on_start: Callable[[TaskScheduler], None] | None = None) -> Trainer:
    """The composition root of `dipaco train`, as one rank sees the experiment: the built record, the
    scheduler with its sync, and the checkpoints. Each component gets its own section."""
    check_train(cfg.train)
    run = Run(cfg)
    experiment, prepared, sharding = run.build_experiment(world)
    scheduler: RoundScheduler | TaskScheduler
    if cfg.train.driver == "ray":
        scheduler = TaskScheduler(experiment, cfg.ray, cfg.outer, cfg.train.dynamic_local_steps,
                                  on_start)
    else:
        sync = build_sync(SyncContext(cfg.outer, cfg.dist, experiment.inner_steps, experiment.rounds, cfg.run.seed,
                                      experiment.topology, experiment.bank, experiment.weights, experiment.by_rank,
                                      world))
        early_stopping = None
        if sharding.heldout.any():
            llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
            held = HeldOut(prepared, sharding.doc_paths, sharding.heldout, cfg.train.early_stopping_holdout)
            early_stopping = run.early_stopping(experiment, held, build_model(llama, device=world.device))
        options = RoundOptions(cfg.train.log_every, cfg.run.progress, cfg.dist.comm_dtype,
                               report_dropped=cfg.outer.drop_prob > 0, diagnostics=cfg.train.diagnostics)
        validation = run.validation(experiment, prepared) if cfg.eval.every > 0 else None
        scheduler = RoundScheduler(experiment, sync, options, early_stopping, validation)
    writers = module_writers(experiment.topology, experiment.by_rank)
    bank = experiment.bank
    state = TrainingState(bank, frozenset(bank.module_name(m) for m in bank.held if writers[m] == world.rank),
                          experiment.loops, scheduler.sync, scheduler, world.rank, experiment.by_rank)
    checkpoints = CheckpointManager(experiment.dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    policy = CheckpointPolicy(every=cfg.train.checkpoint_every, background=cfg.train.checkpoint_background)
    return Trainer(experiment, scheduler, state, checkpoints, check_resume=run.check_resume, policy=policy)


@dataclass(frozen=True)
class HeldOut:
    """The training documents early stopping holds out, and the paths they are routed to."""

    prepared: Prepared
    doc_paths: np.ndarray  # every training document's first path
    mask: np.ndarray
    fraction: float  # train.early_stopping_holdout


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
    stored = exp_dir / "config.yaml"
    if not stored.is_file():
        raise ConfigError(f"{exp_dir}: no {stored.name}; it is not a trained experiment (run `dipaco train` first)")
    cfg = merge_config(stored)
    cfg = merge_config(None, [f"run.dir={run.root}"], base=cfg)  # the stored run.dir may be another machine's
    root = Run(cfg)
    prepared = root.prepared()
    topology = root.topology()
    doc_paths = assign_paths(prepared.train, topology.num_paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    spec = root.experiment_spec(prepared.tokenizer, topology, doc_paths, numpy_column(prepared.train, "num_tokens"))
    path = spec.write(exp_dir)
    echo(f"[spec] {exp_dir.name}: wrote {path} from its {stored.name} (trained before experiment specs)")
    return path


def _only_experiment(run: RunDir) -> Path:
    found = [e for e in run.experiments() if (e / "config.yaml").is_file()]
    if len(found) != 1:
        names = ", ".join(e.name for e in found) or "none"
        raise ConfigError(f"{run.root}: choose the experiment to convert with --experiment (the run has: {names})")
    return found[0]
