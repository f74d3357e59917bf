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
from pathlib import Path

import numpy as np
from transformers import LlamaForCausalLM, PreTrainedModel

from dipaco.checkpoint.state import TrainingState
from dipaco.checkpoint.store import CheckpointManager
from dipaco.comm.placement import check_world_size, module_writers, paths_by_rank
from dipaco.comm.world import DistEnv, World, check_dist, check_same_config, detect_env, init_world, rank_device
from dipaco.config import Config, EvalConfig, config_diff, flatten, merge_config, to_yaml
from dipaco.data.corpus import numpy_column
from dipaco.data.packing import DocumentTokens
from dipaco.data.prepare import Prepared, check_data, check_tokenizer, load_prepared, prepare
from dipaco.errors import ConfigError, DataError
from dipaco.eval.evaluate import EvalJob, check_eval, evaluate_experiment, evaluate_pretrained
from dipaco.eval.report import comparison_table
from dipaco.eval.reroute_eval import reroute_evaluate
from dipaco.metrics import echo
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model, check_model
from dipaco.model.pretrained import load_pretrained, path_llama_config
from dipaco.model.topology import Topology, check_topology, topology_from_config
from dipaco.paths.early_stopping import PathEarlyStopping, early_stopping_holdout
from dipaco.paths.inner import InnerLoop, InnerOptions
from dipaco.paths.sampler import ShardSampler
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
from dipaco.train.pretrain import check_pretrain, pretrain
from dipaco.train.reroute import RerouteJob, reroute
from dipaco.train.resharding import EMPlan, check_em, train_em
from dipaco.train.rounds import RoundScheduler
from dipaco.train.task_queue import check_ray
from dipaco.train.tasks import TaskScheduler
from dipaco.train.trainer import Trainer, check_train


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Schema defaults <- YAML file <- dotlist overrides, then every component's check."""
    cfg = merge_config(path, overrides)
    check_config(cfg)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of ``cfg`` with dotlist overrides applied and checked (for scripts and tests)."""
    changed = merge_config(None, overrides, base=cfg)
    check_config(changed)
    return changed


def check_config(cfg: Config) -> None:
    """Every component's check of its own section; the first error names its key."""
    check_outer(cfg.outer, cfg.train.inner_steps)
    check_run(cfg.run)
    check_data(cfg.data)
    check_tokenizer(cfg.tokenizer)
    check_model(cfg.model)
    check_topology(cfg.topology)
    check_pretrain(cfg.pretrain)
    check_train(cfg.train)
    check_dist(cfg.dist)
    check_ray(cfg.ray, cfg.train, cfg.outer, cfg.dist, list(ASYNC_SYNCS))
    check_route(cfg.route, cfg.data.prefix_tokens)
    check_eval(cfg.eval)
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

    def eval_job(self, prepared: Prepared) -> EvalJob:
        cfg = self.cfg
        return EvalJob(eval=cfg.eval, run_dir=Path(cfg.run.dir), name=cfg.train.name, sharding=cfg.train.sharding,
                       shard_column=cfg.train.shard_column, seed=cfg.run.seed, topology=self.topology(),
                       llama=path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len),
                       seq_len=cfg.data.seq_len, prefix_tokens=cfg.data.prefix_tokens,
                       device=resolve_device(cfg.run.device), inner_steps=cfg.train.inner_steps,
                       progress=cfg.run.progress)

    # --- the jobs -----------------------------------------------------------------------------------------
    def prepare(self) -> dict:
        cfg = self.cfg
        return prepare(cfg.run.dir, cfg.data, cfg.tokenizer, to_yaml(cfg), progress=cfg.run.progress)

    def pretrain(self) -> None:
        cfg = self.cfg
        pretrain(cfg.run, cfg.pretrain, cfg.model, self.prepared(routed=False), cfg.data.seq_len, cfg.train.log_every,
                 to_yaml(cfg))

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

        try:
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

    def evaluate_pretrained(self) -> dict:
        cfg = self.cfg
        prepared = self.prepared(routed=False)
        return evaluate_pretrained(cfg.eval, Path(cfg.run.dir), self.pretrained(prepared), prepared, cfg.data.seq_len,
                                   cfg.data.prefix_tokens, cfg.pretrain.steps, resolve_device(cfg.run.device),
                                   progress=cfg.run.progress)

    def reroute_evaluate(self, every: Sequence[int], checkpoint: str | None = None) -> dict:
        cfg = self.cfg
        unrouted = self.prepared(routed=False)
        return reroute_evaluate(self.eval_job(unrouted), lambda: self.prepared(routed=True), every, checkpoint,
                                featurizer=lambda: self.pretrained(unrouted), route_precision=cfg.route.precision,
                                route_batch_size=cfg.route.batch_size)

    def report(self) -> str:
        return comparison_table(self.cfg.run.dir)

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


def build_trainer(cfg: Config, world: World, on_start: Callable[[TaskScheduler], None] | None = None) -> Trainer:
    """The composition root of `dipaco train`, as one rank sees the experiment: every shard (to balance the
    ranks), its own paths' inner loops, the bank of the modules they go through, the scheduler with its
    sync, and the checkpoints. Each component gets its own section."""
    train, device = cfg.train, world.device
    check_train(train)
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    prepared = Run(cfg).prepared()
    train_ds = prepared.train
    paths = assign_paths(train_ds, topology.num_paths, train.sharding, cfg.run.seed, train.shard_column)
    heldout = np.zeros(len(paths), dtype=bool)
    if train.early_stopping_holdout > 0:
        heldout = early_stopping_holdout(document_ids(train_ds), train.early_stopping_holdout, cfg.run.seed)
    trains = training_paths(train_ds, paths, topology.num_paths, cfg.route.topk, train.sharding)
    # Without a holdout every document trains: no selection, and no copies of 8 bytes a document.
    kept = np.flatnonzero(~heldout) if heldout.any() else None
    if kept is not None:
        trains = trains[kept]
    shards = build_shards(train_ds if kept is None else train_ds.select(kept), trains, topology.num_paths,
                          cfg.data.seq_len, prepared.tokenizer.eos_token_id)
    by_rank = paths_by_rank([s.numel() for s in shards], world.size)
    mine = by_rank[world.rank]

    llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
    init = (load_pretrained(RunDir(cfg.run.dir).pretrain, llama,
                            hint="run `dipaco pretrain` first, or set train.init=random")
            if train.init == "pretrained" else build_model(llama, seed=cfg.run.seed))
    bank = ModuleBank(topology, init.to(device), modules={m for p in mine for m in topology.path_modules(p)})
    options = InnerOptions.from_config(train, cfg.model, device, "train")
    loops = {}
    for p in mine:
        model = build_model(llama, device=device)
        sampler = ShardSampler(shards[p], train.optim.batch_size, seed=cfg.run.seed * 7919 + p)
        loops[p] = InnerLoop(bank.compose(p, model), sampler, train.optim, train.rounds * train.inner_steps, device,
                             options)
    shares = None
    if trains.shape[1] > 1:  # overlapping shards; else every share is 1
        tokens = numpy_column(train_ds, "num_tokens")
        shares = overlap_token_shares(trains, topology.num_paths, tokens if kept is None else tokens[kept])
    weights = path_weights(shards, cfg.outer.weighting, shares)
    exp_dir = RunDir(cfg.run.dir).experiment(train.name)
    early_stopping = None
    if heldout.any():
        early_stopping = _early_stopping(cfg.eval, exp_dir, prepared, paths, heldout, mine, build_model(llama, device=device),
                                         cfg.data.seq_len, cfg.data.prefix_tokens, train.early_stopping_holdout)
    scheduler: RoundScheduler | TaskScheduler
    if train.driver == "ray":
        scheduler = TaskScheduler(cfg.ray, cfg.outer, train, cfg.model, cfg.run.seed, topology, bank, loops, weights,
                                  exp_dir, to_yaml(cfg), cfg.dist.timeout_s, on_start)
    else:
        sync = build_sync(SyncContext(cfg.outer, cfg.dist, train.inner_steps, train.rounds, cfg.run.seed, topology, bank,
                                      weights, by_rank, world))
        scheduler = RoundScheduler(sync, loops, bank, topology, world, train.rounds, train.inner_steps,
                                   train.log_every, cfg.run.progress, early_stopping, cfg.dist.comm_dtype,
                                   report_dropped=cfg.outer.drop_prob > 0, diagnostics=train.diagnostics)
    writers = module_writers(topology, by_rank)
    state = TrainingState(bank, frozenset(bank.module_name(m) for m in bank.held if writers[m] == world.rank), loops,
                          scheduler.sync, scheduler, world.rank, by_rank)
    return Trainer(config_yaml=to_yaml(cfg), check_resume=Run(cfg).check_resume, run_dir=Path(cfg.run.dir), dir=exp_dir,
                   rounds=train.rounds, routed=train.sharding == "kmeans", topology=topology, bank=bank, loops=loops,
                   weights=weights, by_rank=by_rank, world=world, scheduler=scheduler, state=state,
                   checkpoints=CheckpointManager(exp_dir / "checkpoints", keep=train.keep_checkpoints))


def _early_stopping(section: EvalConfig, exp_dir: Path, prepared: Prepared, paths: np.ndarray, heldout: np.ndarray,
                    own_paths: tuple[int, ...], scratch_model: PreTrainedModel, seq_len: int, prefix_tokens: int,
                    fraction: float) -> PathEarlyStopping:
    """Early stopping for this rank's paths, each judged on the held-out docs routed to it."""
    # Only the held-out documents of this rank's paths are read, as int32 arrays (a Python list took
    # about 9x the memory).
    tokens = DocumentTokens(prepared.train)
    docs = {p: tokens.documents(np.flatnonzero(heldout & (paths == p)), np.int32) for p in own_paths}
    starved = [p for p, d in docs.items() if not d]
    if starved:
        raise DataError(f"train.early_stopping_holdout={fraction} leaves paths {starved} without held-out "
                        f"documents; raise it")
    device = next(scratch_model.parameters()).device
    return PathEarlyStopping(exp_dir / "early_stopping", docs, seq_len, prefix_tokens, section.batch_size,
                             prepared.tokenizer.pad_token_id, scratch_model,
                             resolve_precision(section.precision, device, "eval.precision"))

