"""`dipaco train`: rounds of per-path inner AdamW steps followed by a per-module outer step.

This module only wires components together:

    torchrun environment, paths of each rank (dipaco.distributed)
      -> shards (dipaco.shards) -> path models composed from the ModuleBank (dipaco.bank)
      -> InnerLoop per path of this rank (dipaco.inner_loop)
      -> the outer sync (dipaco.sync: outer.sync=diloco), called at its sync points
      -> checkpoint (dipaco.checkpoint) -> metrics (dipaco.metrics)

A single process is the world_size=1 case of the same code: its one rank owns every path and
holds every module, so no module is communicated. Under ``torchrun`` every rank trains its own
paths and holds only the modules they go through (DiPaCo, arXiv 2403.10616, section 2.3). The
paths of a rank advance in segments: each runs up to the sync's next sync point, then the sync
updates the modules and the path models. Every path keeps its own model and AdamW state across
rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dipaco.bank import ModuleBank
from dipaco.checkpoint import (
    CheckpointManager,
    load_bank_state,
    load_state,
    read_training_state,
    resolve_checkpoint,
    write_training_state,
)
from dipaco.comm.accounting import ddp_bytes
from dipaco.comm.world import World, check_same_config, detect_env, init_world, rank_device
from dipaco.config import Config, config_diff, load_config, save_config, to_yaml
from dipaco.early_stopping import PathEarlyStopping, early_stopping_holdout
from dipaco.errors import ConfigError, DataError, DistributedError
from dipaco.inner_loop import InnerLoop, InnerStats
from dipaco.metrics import MetricsLogger, echo
from dipaco.model import build_model
from dipaco.placement import check_world_size, module_writers, paths_by_rank
from dipaco.prepare import Prepared, load_prepared
from dipaco.pretrain import load_pretrained, path_llama_config
from dipaco.run_dir import RunDir
from dipaco.runtime import rng_state, seed_everything, set_rng_state
from dipaco.sampler import ShardSampler
from dipaco.shards import assign_paths, build_shards, check_routing, path_weights, record_routing
from dipaco.sync import OuterSync, SavedState, SyncContext, SyncReport, build_sync
from dipaco.topology import Topology, topology_from_config


# 2: path models are saved after the sync wrote the updated modules into them (1: before).
CHECKPOINT_FORMAT = 2


@dataclass
class Experiment:
    cfg: Config
    dir: Path
    topology: Topology
    bank: ModuleBank  # the modules this rank's paths go through (all of them in a single process)
    sync: OuterSync  # keeps the modules in sync across paths and ranks (outer.sync)
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
    shards = build_shards(train_ds.select(kept), paths[kept], topology.num_paths, cfg.data.seq_len,
                          prepared.tokenizer.eos_token_id)
    by_rank = paths_by_rank([s.numel() for s in shards], world.size)
    mine = by_rank[world.rank]

    llama = path_llama_config(cfg, prepared)
    init = load_pretrained(cfg, prepared) if cfg.train.init == "pretrained" else build_model(llama, seed=cfg.run.seed)
    held = {m for p in mine for m in topology.path_modules(p)}
    bank = ModuleBank(topology, init.to(device), modules=held)
    total_steps = cfg.train.rounds * cfg.train.inner_steps
    loops = {}
    for p in mine:
        model = build_model(llama, device=device)
        sampler = ShardSampler(shards[p], cfg.train.optim.batch_size, seed=cfg.run.seed * 7919 + p)
        loops[p] = InnerLoop(bank.compose(p, model), sampler, cfg.train.optim, total_steps, device)
    weights = path_weights(shards, cfg.outer.weighting)
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
        sync=build_sync(SyncContext(cfg, topology, bank, weights, by_rank, world)),
        loops=loops,
        weights=weights,
        checkpoints=CheckpointManager(exp_dir / "checkpoints", keep=cfg.train.keep_checkpoints),
        world=world,
        by_rank=by_rank,
        early_stopping=early_stopping,
    )


def build_early_stopping(cfg: Config, prepared: Prepared, exp_dir: Path, paths: np.ndarray, heldout: np.ndarray,
                         own_paths: tuple[int, ...], scratch_model) -> PathEarlyStopping:
    """Early stopping for this rank's paths, each judged on the held-out docs routed to it."""
    input_ids = prepared.train["input_ids"]
    docs = {p: [input_ids[int(i)] for i in np.flatnonzero(heldout & (paths == p))] for p in own_paths}
    starved = [p for p, d in docs.items() if not d]
    if starved:
        raise DataError(f"train.early_stopping_holdout={cfg.train.early_stopping_holdout} leaves paths {starved} "
                        f"without held-out documents; raise it")
    return PathEarlyStopping(exp_dir / "early_stopping", docs, cfg.data.seq_len, cfg.data.prefix_tokens,
                             cfg.eval.batch_size, prepared.tokenizer.pad_token_id, scratch_model)


def restore(exp: Experiment, resume_from: str | None) -> int:
    """Loads the newest (or the given) checkpoint; returns the number of completed rounds.

    Each rank verifies and reads the module states and its own paths only.
    """
    own = tuple(f"paths/path_{p:03d}/" for p in exp.loops)
    ckpt = resolve_checkpoint(exp.checkpoints, resume_from, select=lambda rel: not rel.startswith("paths/") or rel.startswith(own))
    saved_cfg = load_config(ckpt / "config.yaml")
    diff = config_diff(saved_cfg, exp.cfg)
    if diff:
        raise ConfigError(f"cannot resume {ckpt}: the config changed ({'; '.join(diff)})")
    state = read_training_state(ckpt, exp.bank, exp.loops, rank=exp.world.rank)
    if state.get("format", 1) < CHECKPOINT_FORMAT:
        # Format 1 saved each path before the outer step; DiLoCo restarts every path from the bank.
        for p, loop in exp.loops.items():
            exp.bank.load_path(p, loop.model)
    saved_placement = load_state(ckpt / "trainer_state.pt").get("paths_by_rank")
    same = saved_placement == [list(ps) for ps in exp.by_rank]
    exp.sync.load_state(SavedState(ckpt, exp.world.rank, exp.bank.device, same_placement=same))
    set_rng_state(state["rng"])
    if exp.world.rank == 0:
        echo(f"[train] resumed from {ckpt} (round {state['round']})")
    return int(state["round"])


def run_round(exp: Experiment, round_index: int) -> dict:
    """This rank's paths, advanced in segments up to each sync point of the round; returns what rank 0 logs."""
    cfg, world = exp.cfg, exp.world
    start = time.perf_counter()
    bar = tqdm(total=cfg.train.inner_steps * len(exp.loops), desc=f"round {round_index + 1}/{cfg.train.rounds}",
               disable=not cfg.run.progress or world.rank != 0, dynamic_ncols=True, leave=False)
    segments: dict[int, list[InnerStats]] = {p: [] for p in exp.loops}
    syncs: list[SyncReport] = []
    done = 0
    for point in exp.sync.sync_points():
        for p, loop in exp.loops.items():
            bar.set_description(f"round {round_index + 1}/{cfg.train.rounds} path {p}")
            segments[p].append(loop.run(point - done, progress=bar, log_every=cfg.train.log_every))
        done = point
        syncs.append(exp.sync.at(round_index, point, {p: loop.model for p, loop in exp.loops.items()}))
    bar.close()
    records = []
    for p, stats in segments.items():
        total = InnerStats.combine(stats)
        records.append(dict(step=exp.loops[p].step, round=round_index + 1, path=p, loss=total.loss,
                            tokens_per_s=total.tokens_per_s, lr=total.lr, tokens=total.tokens))
    heldout_ppl = exp.early_stopping.update(exp.bank, round_index + 1) if exp.early_stopping else {}
    norms = {name: v for report in syncs for name, v in report.norms.items()}
    dropped = sorted({p for report in syncs for p in report.dropped})
    return {"paths": records, "norms": norms, "dropped": dropped, "heldout_ppl": heldout_ppl,
            "comm": _comm_record(exp, syncs, time.perf_counter() - start)}


def _comm_record(exp: Experiment, syncs: list[SyncReport], round_s: float) -> dict:
    steps = exp.cfg.train.inner_steps * len(exp.loops)
    path_numel = sum(exp.bank.numel(part) for part in exp.topology.parts)
    ddp = ddp_bytes(path_numel, steps, exp.world.size)
    sent = sum(s.stats.bytes_sent for s in syncs)
    modules: dict[str, dict] = {}
    for report in syncs:
        for name, entry in report.stats.modules.items():
            if name in modules:
                modules[name] = {**entry, "bytes_sent": modules[name]["bytes_sent"] + entry["bytes_sent"],
                                 "bytes_received": modules[name]["bytes_received"] + entry["bytes_received"]}
            else:
                modules[name] = entry
    return {
        "rank": exp.world.rank, "world_size": exp.world.size, "comm_dtype": exp.cfg.dist.comm_dtype,
        "paths": list(exp.loops), "inner_steps": steps,
        "bytes_sent": sent, "bytes_received": sum(s.stats.bytes_received for s in syncs),
        "check_bytes": sum(s.stats.check_bytes for s in syncs),
        "peak_sync_bytes": max((s.stats.bytes_sent for s in syncs), default=0.0),
        "ddp_bytes": ddp, "ddp_over_sent": ddp / sent if sent else None,
        "modules": modules,
        "round_seconds": round_s, "outer_seconds": sum(s.seconds for s in syncs),
        "comm_seconds": sum(s.comm_seconds for s in syncs),
    }


def write_checkpoint(exp: Experiment, root: Path, round_index: int) -> list[Path]:
    """This rank's part: its paths, its share of the sync's state, and the bank rows of the modules
    it is the lowest holder of, so every module is written exactly once."""
    writers = module_writers(exp.topology, exp.by_rank)
    modules = {exp.bank.module_name(m) for m in exp.bank.held if writers[m] == exp.world.rank}
    return write_training_state(
        root, round_index, exp.bank, exp.loops, rng_state(), to_yaml(exp.cfg),
        rank=exp.world.rank, modules=modules, sync_state=exp.sync.state_dict(),
        extra={"format": CHECKPOINT_FORMAT, "world_size": exp.world.size, "paths_by_rank": [list(ps) for ps in exp.by_rank]},
    )


def log_round(exp: Experiment, metrics: MetricsLogger, round_index: int, reports: list[dict], ckpt: Path) -> None:
    """Rank 0 logs every rank's report of a completed (checkpointed) round."""
    cfg, r = exp.cfg, round_index + 1
    records = sorted((rec for rep in reports for rec in rep["paths"]), key=lambda rec: rec["path"])
    for rec in records:
        rec = dict(rec)
        metrics.log("path", step=rec.pop("step"), **rec)
    merged = {name: v for rep in reports for name, v in rep["norms"].items()}
    norms = {m.name: merged[m.name] for m in exp.topology.modules if m.name in merged}
    extra = {"dropped": reports[0]["dropped"]} if cfg.outer.drop_prob > 0 else {}
    metrics.log("outer", step=r, round=r, outer_grad_norm=norms, **extra)
    for rep in reports:
        metrics.log("comm", step=r, round=r, **rep["comm"])
    if cfg.train.early_stopping_holdout > 0:
        heldout = {p: v for rep in reports for p, v in rep["heldout_ppl"].items()}
        metrics.log("early_stopping", step=r, round=r, heldout_ppl=dict(sorted(heldout.items())))
    loss_text = " ".join(f"p{rec['path']}={rec['loss']:.3f}" for rec in records)
    comm_text = ""
    if exp.world.size > 1:
        sent = max(rep["comm"]["bytes_sent"] for rep in reports)
        comm_text = f" | comm {sent / 1e6:.2f} MB/rank ({cfg.dist.comm_dtype})"
    echo(f"[train] round {r}/{cfg.train.rounds} loss {loss_text}{comm_text} -> {ckpt.name}")


def train(cfg: Config, resume: bool = False, resume_from: str | None = None, until_round: int | None = None) -> Experiment:
    """Trains in this process, or as one rank of a torchrun job (WORLD_SIZE > 1)."""
    env = detect_env()
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    check_world_size(topology.num_paths, env.world_size)  # on every rank, before any collective
    seed_everything(cfg.run.seed)
    world = init_world(cfg.dist, env, rank_device(cfg.run.device, env))
    try:
        return _train(cfg, world, resume, resume_from, until_round)
    finally:
        world.close()


def _train(cfg: Config, world: World, resume: bool, resume_from: str | None, until_round: int | None) -> Experiment:
    check_same_config(world, cfg, {"resume": resume, "resume_from": resume_from, "until_round": until_round})
    exp, error = None, None
    try:
        exp = build_experiment(cfg, load_prepared(cfg), world)
    except Exception as exc:  # shared with every rank, so none waits for a rank that gave up
        error = exc
    world.agree(error, "setting up the experiment")
    if world.rank == 0:
        ranks = "" if world.size == 1 else "; " + ", ".join(f"rank {r}: paths {list(ps)}" for r, ps in enumerate(exp.by_rank))
        echo(f"[train] {cfg.train.name}: {exp.topology.describe()}; {cfg.train.rounds} rounds x "
             f"{cfg.train.inner_steps} inner steps{ranks}")

    start, error = 0, None
    restarted = world.env.restart_count > 0 and not (resume or resume_from)
    try:
        latest = exp.checkpoints.latest()
        if resume or resume_from or (restarted and latest is not None):
            if restarted and world.rank == 0:
                echo(f"[train] restart {world.env.restart_count} of the worker group: continuing from {latest.name}")
            check_routing(cfg, exp.dir)
            start = restore(exp, resume_from)
        elif latest is not None:
            raise ConfigError(
                f"{exp.dir} already has checkpoints; pass --resume to continue it, "
                f"or choose another train.name to start a new experiment"
            )
    except Exception as exc:
        error = exc
    world.agree(error, "resuming")
    starts = world.all_gather_object(start, "first round")
    if len(set(starts)) > 1:
        raise DistributedError(
            f"ranks would start from different rounds ({starts}); run.dir must be on storage every rank sees"
        )
    if world.rank == 0:
        save_config(cfg, exp.dir / "config.yaml")
        record_routing(cfg, exp.dir)
    stop = cfg.train.rounds if until_round is None else min(until_round, cfg.train.rounds)
    metrics = MetricsLogger(exp.dir) if world.rank == 0 else None
    try:
        for r in range(start, stop):
            reports = world.all_gather_object(run_round(exp, r), f"round {r + 1} report")
            ckpt = exp.checkpoints.save(r + 1, lambda d: write_checkpoint(exp, d, r + 1), world)
            if metrics is not None:  # logged once the round is checkpointed: a restarted round is not logged twice
                log_round(exp, metrics, r, reports, ckpt)
    finally:
        if metrics is not None:
            metrics.close()
    return exp


def experiment_checkpoint(cfg: Config, prepared: Prepared, checkpoint: str | None = None
                          ) -> tuple[Path, Path, Topology, ModuleBank]:
    """The experiment's directory, its newest (or given) checkpoint and that checkpoint's bank, for
    the jobs that read a trained experiment back; refuses one whose run's routing was replaced."""
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    check_routing(cfg, exp_dir)
    ckpt = resolve_checkpoint(CheckpointManager(exp_dir / "checkpoints"), checkpoint)
    return (exp_dir, ckpt, *bank_from_checkpoint(cfg, prepared, ckpt))


@torch.no_grad()
def bank_from_checkpoint(cfg: Config, prepared: Prepared, ckpt: Path) -> tuple[Topology, ModuleBank]:
    """Only the bank of a checkpoint (for evaluation and serving; no optimizer state is read)."""
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    bank = ModuleBank(topology, build_model(path_llama_config(cfg, prepared), seed=0))
    bank.load_state_dict(load_bank_state(ckpt))
    return topology, bank
