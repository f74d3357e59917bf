"""`dipaco train`: rounds of per-path inner AdamW steps followed by a per-module outer step.

This module only wires components together:

    torchrun environment, paths of each rank (dipaco.distributed)
      -> shards (dipaco.route.shards) -> path models composed from the ModuleBank (dipaco.model.bank)
      -> InnerLoop per path of this rank (dipaco.train.inner)
      -> the outer sync (dipaco.sync: outer.sync=diloco), called at its sync points
      -> checkpoint (dipaco.checkpoint.store) -> metrics (dipaco.metrics)
    route.em_rounds: segments of rounds with re-routing between them (dipaco.train.resharding)

A single process is the world_size=1 case of the same code: its one rank owns every path and
holds every module, so no module is communicated. Under ``torchrun`` every rank trains its own
paths and holds only the modules they go through (DiPaCo, arXiv 2403.10616, section 2.3). The
paths of a rank advance in segments: each runs up to the sync's next sync point, then the sync
updates the modules and the path models. Every path keeps its own model and AdamW state across
rounds.
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm.auto import tqdm

from dipaco.comm.accounting import ddp_bytes
from dipaco.comm.world import World, check_same_config, detect_env, init_world, rank_device
from dipaco.config import Config, save_config
from dipaco.data.prepare import load_prepared
from dipaco.errors import ConfigError, DistributedError
from dipaco.metrics import MetricsLogger, echo, read_metrics
from dipaco.model.topology import topology_from_config
from dipaco.route.shards import check_routing, record_routing
from dipaco.runtime import seed_everything
from dipaco.sync import SyncReport
from dipaco.train.experiment import Experiment, build_experiment, restore, saved_reports, write_checkpoint
from dipaco.train.inner import InnerStats
from dipaco.train.placement import check_world_size
from dipaco.train.resharding import train_em


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
                            tokens_per_s=total.tokens_per_s, lr=total.lr, tokens=total.tokens,
                            **({"swap_seconds": total.swap_seconds} if cfg.train.offload_inactive else {})))
    heldout_ppl = exp.early_stopping.update(exp.bank, round_index + 1) if exp.early_stopping else {}
    norms = {name: v for report in syncs for name, v in report.norms.items()}
    dropped = sorted({p for report in syncs for p in report.dropped})
    return {"paths": records, "norms": norms, "dropped": dropped, "heldout_ppl": heldout_ppl,
            "comm": _comm_record(exp, syncs, time.perf_counter() - start)}


def _comm_record(exp: Experiment, syncs: list[SyncReport], round_s: float) -> dict:
    steps = exp.cfg.train.inner_steps * len(exp.loops)
    path_numel = sum(exp.bank.numel(part) for part in exp.topology.parts)
    ddp = ddp_bytes(path_numel, steps, exp.world.size)
    ddp_peak = ddp_bytes(path_numel, 1, exp.world.size)  # DDP syncs every step: one gradient all-reduce
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
        "sync_bytes": [s.stats.bytes_sent for s in syncs],  # per call of the sync, in order
        "ddp_bytes": ddp, "ddp_over_sent": ddp / sent if sent else None, "ddp_peak_sync_bytes": ddp_peak,
        "modules": modules,
        "round_seconds": round_s, "outer_seconds": sum(s.seconds for s in syncs),
        "comm_seconds": sum(s.comm_seconds for s in syncs),  # issuing and waiting for exchanges
    }


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


def log_unlogged_round(exp: Experiment, metrics: MetricsLogger, completed: int, ckpt: Path) -> None:
    """A round is logged after its checkpoint is in place, so a worker killed in between leaves the
    checkpoint's round unlogged; the resumed run logs it from the reports the checkpoint kept."""
    logged = exp.dir / "metrics.jsonl"
    rounds = {rec.get("round") for rec in read_metrics(logged, "outer")} if logged.is_file() else set()
    reports = saved_reports(ckpt)
    if completed > 0 and completed not in rounds and reports is not None:
        log_round(exp, metrics, completed - 1, reports, ckpt)


def train(cfg: Config, resume: bool = False, resume_from: str | None = None, until_round: int | None = None) -> Experiment:
    """Trains in this process, or as one rank of a torchrun job (WORLD_SIZE > 1)."""
    env = detect_env()
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    check_world_size(topology.num_paths, env.world_size)  # on every rank, before any collective
    device = rank_device(cfg.run.device, env)
    seed_everything(cfg.run.seed, device, cfg.run.deterministic)
    world = init_world(cfg.dist, env, device)
    try:
        if cfg.route.em_rounds:  # EM-style re-sharding: _train up to each point, re-route, continue
            return train_em(cfg, world, resume, resume_from, until_round, _train)
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
        options = next(iter(exp.loops.values())).options
        speed = f"{options.precision.name} on {world.device}" + (", compiled" if options.compile else "")
        echo(f"[train] {cfg.train.name}: {exp.topology.describe()}; {cfg.train.rounds} rounds x "
             f"{cfg.train.inner_steps} inner steps; {speed}{ranks}")

    start, resumed, error = 0, None, None
    restarted = world.env.restart_count > 0 and not (resume or resume_from)
    try:
        latest = exp.checkpoints.latest()
        if resume or resume_from or (restarted and latest is not None):
            if restarted and world.rank == 0:
                echo(f"[train] restart {world.env.restart_count} of the worker group: continuing from {latest.name}")
            check_routing(cfg, exp.dir)
            start, resumed = restore(exp, resume_from)
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
    if metrics is not None and resumed is not None:
        log_unlogged_round(exp, metrics, start, resumed)
    try:
        for r in range(start, stop):
            reports = world.all_gather_object(run_round(exp, r), f"round {r + 1} report")
            ckpt = exp.checkpoints.save(r + 1, lambda d: write_checkpoint(exp, d, r + 1, reports), world)
            if metrics is not None:  # logged once the round is checkpointed: a restarted round is not logged twice
                log_round(exp, metrics, r, reports, ckpt)
    finally:
        if metrics is not None:
            metrics.close()
    return exp
