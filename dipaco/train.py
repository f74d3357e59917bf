"""`dipaco train`: rounds of per-path inner AdamW steps followed by a per-module outer step.

This module only wires components together:

    shards (dipaco.shards) -> path models composed from the ModuleBank (dipaco.bank)
      -> InnerLoop per path (dipaco.inner_loop) -> OuterOptimizer.step (dipaco.outer)
      -> checkpoint (dipaco.checkpoint) -> metrics (dipaco.metrics)

Paths run one after another in this process; every path keeps its own model and AdamW state
across rounds, and is overwritten in place from the bank at the start of each round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from dipaco.bank import ModuleBank
from dipaco.checkpoint import (
    CheckpointManager,
    load_tensors,
    read_training_state,
    resolve_checkpoint,
    write_training_state,
)
from dipaco.config import Config, config_diff, load_config, save_config, to_yaml
from dipaco.errors import ConfigError
from dipaco.inner_loop import InnerLoop
from dipaco.metrics import MetricsLogger, echo
from dipaco.model import build_model
from dipaco.outer import OuterOptimizer
from dipaco.prepare import Prepared, load_prepared
from dipaco.pretrain import load_pretrained, path_llama_config
from dipaco.run_dir import RunDir
from dipaco.runtime import resolve_device, rng_state, seed_everything, set_rng_state
from dipaco.sampler import ShardSampler
from dipaco.shards import assign_paths, build_shards, path_weights
from dipaco.topology import Topology, topology_from_config


@dataclass
class Experiment:
    cfg: Config
    dir: Path
    topology: Topology
    bank: ModuleBank
    outer: OuterOptimizer
    loops: dict[int, InnerLoop]  # path id -> its inner loop (model, AdamW, schedule, data cursor)
    weights: dict[int, float]
    checkpoints: CheckpointManager


def build_experiment(cfg: Config, prepared: Prepared) -> Experiment:
    device = resolve_device(cfg.run.device)
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    train_ds = prepared.train
    paths = assign_paths(train_ds, topology.num_paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    shards = build_shards(train_ds, paths, topology.num_paths, cfg.data.seq_len, prepared.tokenizer.eos_token_id)

    llama = path_llama_config(cfg, prepared)
    init = load_pretrained(cfg, prepared) if cfg.train.init == "pretrained" else build_model(llama, seed=cfg.run.seed)
    bank = ModuleBank(topology, init.to(device))
    total_steps = cfg.train.rounds * cfg.train.inner_steps
    loops = {}
    for p in range(topology.num_paths):
        model = build_model(llama, device=device)
        sampler = ShardSampler(shards[p], cfg.train.optim.batch_size, seed=cfg.run.seed * 7919 + p)
        loops[p] = InnerLoop(bank.compose(p, model), sampler, cfg.train.optim, total_steps, device)
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    return Experiment(
        cfg=cfg,
        dir=exp_dir,
        topology=topology,
        bank=bank,
        outer=OuterOptimizer(bank, cfg.outer),
        loops=loops,
        weights=path_weights(shards, cfg.outer.weighting),
        checkpoints=CheckpointManager(exp_dir / "checkpoints", keep=cfg.train.keep_checkpoints),
    )


def restore(exp: Experiment, resume_from: str | None) -> int:
    """Loads the newest (or the given) checkpoint; returns the number of completed rounds."""
    ckpt = resolve_checkpoint(exp.checkpoints, resume_from)
    saved_cfg = load_config(ckpt / "config.yaml")
    diff = config_diff(saved_cfg, exp.cfg)
    if diff:
        raise ConfigError(f"cannot resume {ckpt}: the config changed ({'; '.join(diff)})")
    state = read_training_state(ckpt, exp.bank, exp.outer, exp.loops)
    set_rng_state(state["rng"])
    echo(f"[train] resumed from {ckpt} (round {state['round']})")
    return int(state["round"])


def run_round(exp: Experiment, round_index: int, metrics: MetricsLogger) -> dict:
    cfg = exp.cfg
    steps = cfg.train.inner_steps
    losses = {}
    bar = tqdm(total=steps * len(exp.loops), desc=f"round {round_index + 1}/{cfg.train.rounds}",
               disable=not cfg.run.progress, dynamic_ncols=True, leave=False)
    for p, loop in exp.loops.items():
        exp.bank.load_path(p, loop.model)
        bar.set_description(f"round {round_index + 1}/{cfg.train.rounds} path {p}")
        stats = loop.run(steps, progress=bar, log_every=cfg.train.log_every)
        losses[p] = stats.loss
        metrics.log("path", step=loop.step, round=round_index + 1, path=p, loss=stats.loss,
                    tokens_per_s=stats.tokens_per_s, lr=stats.lr, tokens=stats.tokens)
    bar.close()
    norms = exp.outer.step({p: loop.model for p, loop in exp.loops.items()}, exp.weights)
    metrics.log("outer", step=round_index + 1, round=round_index + 1, outer_grad_norm=norms)
    return losses


def train(cfg: Config, resume: bool = False, resume_from: str | None = None, until_round: int | None = None) -> Experiment:
    seed_everything(cfg.run.seed)
    prepared = load_prepared(cfg)
    exp = build_experiment(cfg, prepared)
    echo(f"[train] {cfg.train.name}: {exp.topology.describe()}; {cfg.train.rounds} rounds x {cfg.train.inner_steps} inner steps")
    start = 0
    if resume or resume_from:
        start = restore(exp, resume_from)
    elif exp.checkpoints.latest() is not None:
        raise ConfigError(
            f"{exp.dir} already has checkpoints; pass --resume to continue it, "
            f"or choose another train.name to start a new experiment"
        )
    save_config(cfg, exp.dir / "config.yaml")
    stop = cfg.train.rounds if until_round is None else min(until_round, cfg.train.rounds)
    metrics = MetricsLogger(exp.dir)
    try:
        for r in range(start, stop):
            losses = run_round(exp, r, metrics)
            ckpt = exp.checkpoints.save(
                r + 1, lambda d: write_training_state(d, r + 1, exp.bank, exp.outer, exp.loops, rng_state(), to_yaml(cfg))
            )
            loss_text = " ".join(f"p{p}={v:.3f}" for p, v in losses.items())
            echo(f"[train] round {r + 1}/{cfg.train.rounds} loss {loss_text} -> {ckpt.name}")
    finally:
        metrics.close()
    return exp


@torch.no_grad()
def bank_from_checkpoint(cfg: Config, prepared: Prepared, ckpt: Path) -> tuple[Topology, ModuleBank]:
    """Only the bank of a checkpoint (for evaluation and serving; no optimizer state is read)."""
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    bank = ModuleBank(topology, build_model(path_llama_config(cfg, prepared), seed=0))
    bank.load_state_dict(load_tensors(ckpt / "bank.safetensors"))
    return topology, bank
