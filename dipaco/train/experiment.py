"""The experiment as one rank sees it: shards, its paths' inner loops, the bank, the outer sync;
built fresh, or restored from a checkpoint, and written into one.

Every path keeps its own model, AdamW state, LR schedule and data cursor across rounds (never
averaged or communicated); the bank holds the modules this rank's paths go through; the outer sync
(:mod:`dipaco.sync`, ``outer.sync``) keeps those modules in step with the other paths and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dipaco.checkpoint.store import (
    CheckpointManager,
    load_state,
    read_training_state,
    resolve_checkpoint,
    write_training_state,
)
from dipaco.comm.world import World, detect_env, rank_device
from dipaco.config import Config, config_diff, load_config, to_yaml
from dipaco.data.prepare import Prepared
from dipaco.errors import ConfigError, DataError
from dipaco.metrics import echo
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.topology import Topology, topology_from_config
from dipaco.precision import resolve_precision
from dipaco.route.shards import assign_paths, build_shards, overlap_token_shares, overlapping_paths, path_weights
from dipaco.run_dir import RunDir
from dipaco.runtime import rng_state, set_rng_state
from dipaco.sync import ASYNC_SYNCS, OuterSync, SavedState, SyncContext, build_sync
from dipaco.train.early_stopping import PathEarlyStopping, early_stopping_holdout
from dipaco.train.inner import InnerLoop, InnerOptions
from dipaco.train.placement import module_writers, paths_by_rank
from dipaco.train.pretrain import load_pretrained, path_llama_config
from dipaco.train.sampler import ShardSampler

# 2: path models are saved after the sync wrote the updated modules into them (1: before).
CHECKPOINT_FORMAT = 2


@dataclass
class Experiment:
    cfg: Config
    dir: Path
    topology: Topology
    bank: ModuleBank  # the modules this rank's paths go through (all of them in a single process)
    sync: OuterSync | None  # keeps the modules in sync across paths and ranks (outer.sync); None under
    # train.driver=ray, whose module executors apply the updates (dipaco.train.ray_driver)
    loops: dict[int, InnerLoop]  # this rank's path id -> its inner loop (model, AdamW, schedule, data cursor)
    weights: dict[int, float]  # every path's outer weight w_p
    checkpoints: CheckpointManager
    world: World  # this rank and the job's collectives (one rank in a single process)
    by_rank: list[tuple[int, ...]]  # the paths of every rank
    early_stopping: PathEarlyStopping | None = None  # this rank's paths' best parameters, if enabled


def build_experiment(cfg: Config, prepared: Prepared, world: World | None = None) -> Experiment:
    """The experiment as this rank sees it: every shard (to balance ranks), its own paths' loops."""
    world = world or World(device=rank_device(cfg.run.device, detect_env({})))
    device = world.device
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    train_ds = prepared.train
    paths = assign_paths(train_ds, topology.num_paths, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    heldout = np.zeros(len(paths), dtype=bool)
    if cfg.train.early_stopping_holdout > 0:
        heldout = early_stopping_holdout(train_ds["id"], cfg.train.early_stopping_holdout, cfg.run.seed)
    kept = np.flatnonzero(~heldout)
    trains = training_paths(cfg, train_ds, paths, topology.num_paths)[kept]
    shards = build_shards(train_ds.select(kept), trains, topology.num_paths, cfg.data.seq_len,
                          prepared.tokenizer.eos_token_id)
    by_rank = paths_by_rank([s.numel() for s in shards], world.size)
    mine = by_rank[world.rank]

    llama = path_llama_config(cfg, prepared)
    init = load_pretrained(cfg, prepared) if cfg.train.init == "pretrained" else build_model(llama, seed=cfg.run.seed)
    held = {m for p in mine for m in topology.path_modules(p)}
    bank = ModuleBank(topology, init.to(device), modules=held)
    total_steps = cfg.train.rounds * cfg.train.inner_steps
    options = InnerOptions.from_config(cfg.train, cfg.model, device, "train")
    loops = {}
    for p in mine:
        model = build_model(llama, device=device)
        sampler = ShardSampler(shards[p], cfg.train.optim.batch_size, seed=cfg.run.seed * 7919 + p)
        loops[p] = InnerLoop(bank.compose(p, model), sampler, cfg.train.optim, total_steps, device, options)
    shares = overlap_token_shares(trains, topology.num_paths, np.asarray(train_ds["num_tokens"])[kept])
    weights = path_weights(shards, cfg.outer.weighting, shares)
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    early_stopping = None
    if heldout.any():
        early_stopping = build_early_stopping(cfg, prepared, exp_dir, paths, heldout, mine,
                                              build_model(llama, device=device))
    return Experiment(
        cfg=cfg,
        dir=exp_dir,
        topology=topology,
        bank=bank,
        sync=None if cfg.outer.sync in ASYNC_SYNCS else build_sync(SyncContext(cfg, topology, bank, weights, by_rank, world)),
        loops=loops,
        weights=weights,
        checkpoints=CheckpointManager(exp_dir / "checkpoints", keep=cfg.train.keep_checkpoints),
        world=world,
        by_rank=by_rank,
        early_stopping=early_stopping,
    )


def training_paths(cfg: Config, train_ds, paths: np.ndarray, num_paths: int) -> np.ndarray:
    """(N, k) paths each training document trains: k = route.topk for routed shards (overlapping
    when > 1), one path otherwise."""
    k = cfg.route.topk
    if k == 1:
        return paths[:, None]
    if cfg.train.sharding != "kmeans":
        raise ConfigError(f"route.topk={k}: overlapping shards need train.sharding=kmeans, got {cfg.train.sharding}")
    if k > num_paths:
        raise ConfigError(f"route.topk={k} is more than the topology's {num_paths} paths")
    return overlapping_paths(train_ds, paths, k)


def build_early_stopping(cfg: Config, prepared: Prepared, exp_dir: Path, paths: np.ndarray, heldout: np.ndarray,
                         own_paths: tuple[int, ...], scratch_model) -> PathEarlyStopping:
    """Early stopping for this rank's paths, each judged on the held-out docs routed to it."""
    input_ids = prepared.train["input_ids"]
    docs = {p: [input_ids[int(i)] for i in np.flatnonzero(heldout & (paths == p))] for p in own_paths}
    starved = [p for p, d in docs.items() if not d]
    if starved:
        raise DataError(f"train.early_stopping_holdout={cfg.train.early_stopping_holdout} leaves paths {starved} "
                        f"without held-out documents; raise it")
    device = next(scratch_model.parameters()).device
    return PathEarlyStopping(exp_dir / "early_stopping", docs, cfg.data.seq_len, cfg.data.prefix_tokens,
                             cfg.eval.batch_size, prepared.tokenizer.pad_token_id, scratch_model,
                             resolve_precision(cfg.eval.precision, device, "eval.precision"))


def restore(exp: Experiment, resume_from: str | None) -> tuple[int, Path]:
    """Loads the newest (or the given) checkpoint; returns the number of completed rounds and the checkpoint.

    Each rank verifies and reads the module states and its own paths only.
    """
    own = tuple(f"paths/path_{p:03d}/" for p in exp.loops)
    ckpt = resolve_checkpoint(exp.checkpoints, resume_from, select=lambda rel: not rel.startswith("paths/") or rel.startswith(own))
    check_resume_config(ckpt, exp.cfg)
    state = read_training_state(ckpt, exp.bank, exp.loops, rank=exp.world.rank)
    if state.get("format", 1) < CHECKPOINT_FORMAT:
        # Format 1 saved each path before the outer step; DiLoCo restarts every path from the bank.
        for p, loop in exp.loops.items():
            exp.bank.load_path(p, loop.model)
    saved_placement = load_state(ckpt / "trainer_state.pt").get("paths_by_rank")
    same = saved_placement == [list(ps) for ps in exp.by_rank]
    if exp.sync is not None:  # the Ray driver restores its executors' state itself
        exp.sync.load_state(SavedState(ckpt, exp.world.rank, exp.bank.device, same_placement=same))
    set_rng_state(state["rng"])
    if exp.world.rank == 0:
        echo(f"[train] resumed from {ckpt} (round {state['round']})")
    return int(state["round"]), ckpt


def check_resume_config(ckpt: Path, cfg: Config) -> None:
    """Refuses to resume ``ckpt`` with a config that changes what the run computes (config_diff's keys)."""
    diff = config_diff(load_config(ckpt / "config.yaml"), cfg)
    if diff:
        raise ConfigError(f"cannot resume {ckpt}: the config changed ({'; '.join(diff)})")


def write_checkpoint(exp: Experiment, root: Path, round_index: int, reports: list[dict]) -> list[Path]:
    """This rank's part: its paths, its share of the sync's state, and the bank rows of the modules
    it is the lowest holder of, so every module is written exactly once. Rank 0 also keeps the
    round's metrics ``reports``, which a restart logs if it came before they were (:func:`saved_reports`)."""
    writers = module_writers(exp.topology, exp.by_rank)
    modules = {exp.bank.module_name(m) for m in exp.bank.held if writers[m] == exp.world.rank}
    return write_training_state(
        root, round_index, exp.bank, exp.loops, rng_state(), to_yaml(exp.cfg),
        rank=exp.world.rank, modules=modules, sync_state=exp.sync.state_dict(),
        extra={"format": CHECKPOINT_FORMAT, "world_size": exp.world.size, "paths_by_rank": [list(ps) for ps in exp.by_rank],
               **({"reports": reports} if exp.world.rank == 0 else {})},
    )


def saved_reports(ckpt: Path) -> list[dict] | None:
    """The metrics reports of the round a checkpoint completed (None for checkpoints before they were kept)."""
    return load_state(ckpt / "trainer_state.pt").get("reports")
