"""The composition root: every job of a run, wired from one resolved config.

This module, training's build (:func:`dipaco.build.build_trainer`) and the CLI are the only code that
reads the whole :class:`~dipaco.config.Config`. :class:`Run` holds the jobs: each loads what it needs and
hands it to its component. Each component gets its own section (and the few values of other sections it needs, by name), checks it
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
from dataclasses import asdict, replace
from pathlib import Path

from transformers import LlamaForCausalLM

from dipaco.build import build_trainer
from dipaco.checkpoint.migrate import convert_experiment
from dipaco.checkpoint.resume import check_resume
from dipaco.checkpoint.spec import SPEC, ExperimentSpec, read_spec
from dipaco.checkpoint.store import CONFIG, CheckpointManager, resolve_checkpoint
from dipaco.comm.placement import check_world_size
from dipaco.comm.world import DistEnv, check_dist, check_same_config, detect_env, init_world, rank_device
from dipaco.config import Config, ModelConfig, config_diff, flatten, given_keys, merge_config, to_yaml
from dipaco.data.prepare import Prepared, check_data, check_tokenizer, corpus_spec, prepare
from dipaco.data.tokenizer import load_tokenizer
from dipaco.errors import ConfigError
from dipaco.eval.evaluate import (
    EvalJob,
    PretrainedEval,
    check_eval,
    evaluate_experiment,
    evaluate_pretrained,
)
from dipaco.eval.report import comparison_table
from dipaco.eval.reroute_eval import reroute_evaluate
from dipaco.metrics import WandbRun, check_metrics, tracking
from dipaco.model.llama import check_model
from dipaco.model.pretrained import check_vocabulary, load_pretrained, path_llama_config
from dipaco.model.source import resolve_init_from
from dipaco.model.topology import Topology, check_topology, topology_from_config
from dipaco.precision import resolve_precision
from dipaco.route.assign import RouteJob, check_route, route
from dipaco.route.shards import routed_data
from dipaco.run_dir import RunDir
from dipaco.runtime import check_run, resolve_device, seed_everything
from dipaco.sync import ASYNC_SYNCS, check_outer
from dipaco.train.pretrain import RESUME_KEYS, PretrainJob, check_pretrain, pretrain, stopped_config
from dipaco.train.reroute import RerouteJob, reroute
from dipaco.train.resharding import EMPlan, check_em, train_em
from dipaco.train.tasks import TaskScheduler, check_ray
from dipaco.train.trainer import Trainer, check_train


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
        routed = cfg.train.sharding == "kmeans" if routed is None else routed
        return routed_data(cfg.run.dir, cfg.data, cfg.tokenizer, routed)

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
                                  exp_dir=exp_dir, check_resume=lambda ckpt: check_resume(ckpt, to_yaml(cfg)),
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
