"""EM-style re-sharding inside `dipaco train` (``route.em_rounds``; DiPaCo, arXiv 2403.10616, section 2.4.2).

After each listed round the paths' losses re-shard the documents (discriminative re-routing,
:func:`dipaco.route.reroute.reroute`: the E step) and the paths train on their new shards until the
next point (the M step). The run is exactly the manual sequence, in one command::

    dipaco train --until-round p1; dipaco reroute; dipaco train --resume --until-round p2; dipaco reroute; ...

Each training segment is the ordinary round driver (``segment``, :func:`dipaco.train.loop._train`)
continuing from the checkpoint of the point, so the bank equals the manual sequence's bit for bit on
CPU. A point is re-routed only when training continues past it: ``--until-round p`` stops at p's
checkpoint, and the resume re-routes first.

Resume: ``train/<name>/em.json`` lists the points already re-routed, with the routing fingerprint each
produced. A resumed run re-routes the points it has not done yet and never redoes one; a checkpoint
older than a re-routing already done is refused (the run's routing has moved on). A re-routing that
wrote the new routing but stopped before recording it (see :func:`dipaco.route.shards.pending_rerouting`)
is kept, not redone.

Under torchrun, rank 0 re-routes (it loads the checkpoint's full bank and scores every path) while the
other ranks wait for it in a collective; every rank then builds its shards from the new routing as it
resumes. Re-routing must finish within ``dist.timeout_s``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from dipaco.atomic import write_text
from dipaco.checkpoint.store import CheckpointManager, load_state
from dipaco.comm.world import World
from dipaco.config import Config
from dipaco.errors import ConfigError, DataError
from dipaco.metrics import MetricsLogger, echo
from dipaco.route.assign import REPORT
from dipaco.route.reroute import reroute
from dipaco.route.shards import current_fingerprint, pending_rerouting, record_routing
from dipaco.run_dir import RunDir
from dipaco.train.experiment import Experiment, check_resume_config

EM_RECORD = "em.json"  # in the experiment directory: the re-routings done, in order

# (cfg, world, resume, resume_from, until_round) -> the experiment after training up to until_round
Segment = Callable[[Config, World, bool, "str | None", "int | None"], Experiment]


def read_record(exp_dir: Path) -> list[dict]:
    """The re-routings this experiment has done: ``{"round", "fingerprint", "moved_train_docs", ...}``."""
    file = exp_dir / EM_RECORD
    return json.loads(file.read_text())["done"] if file.is_file() else []


def checkpoint_round(ckpt: Path) -> int | None:
    """Rounds a checkpoint directory completed (None when it is not one: the driver then says why)."""
    match = re.fullmatch(r"round_(\d+)", ckpt.name)
    if match:
        return int(match.group(1))
    state = ckpt / "trainer_state.pt"
    return int(load_state(state)["round"]) if state.is_file() else None


def train_em(cfg: Config, world: World, resume: bool, resume_from: str | None, until_round: int | None,
             segment: Segment) -> Experiment:
    """Trains ``cfg`` up to ``until_round`` (default: train.rounds), re-routing after every round of
    route.em_rounds that training passes."""
    points = list(cfg.route.em_rounds)
    stop = cfg.train.rounds if until_round is None else min(until_round, cfg.train.rounds)
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    checkpoints = CheckpointManager(exp_dir / "checkpoints")
    restarted = world.env.restart_count > 0 and not (resume or resume_from)
    ckpt = Path(resume_from) if resume_from else checkpoints.latest() if (resume or restarted) else None
    start, done, error = None, [], None
    try:
        start = checkpoint_round(ckpt) if ckpt is not None else None
        if start is not None:
            if (ckpt / "config.yaml").is_file():
                check_resume_config(ckpt, cfg)  # before the points: a changed route.em_rounds is named as such
            done = [entry["round"] for entry in read_record(exp_dir)]
            _check_resumable(points, done, start, ckpt)
    except Exception as exc:  # every rank read the same files; shared so that none waits for another
        error = exc
    world.agree(error, "checking the EM re-routing points")
    if start is None:
        if resume or resume_from or checkpoints.latest() is not None:
            return segment(cfg, world, resume, resume_from, until_round)  # it refuses, naming the problem
        if world.rank == 0:
            (exp_dir / EM_RECORD).unlink(missing_ok=True)  # a fresh run: nothing re-routed yet

    position, exp = start or 0, None
    seg_resume, seg_from = resume, resume_from
    while True:
        if position in points and position not in done and position < stop:
            reshard(cfg, world, position, ckpt if exp is None else checkpoints.latest(), exp_dir)
            done.append(position)
            seg_resume = True
        upto = min([p for p in points if position < p < stop], default=stop)
        exp = segment(cfg, world, seg_resume, seg_from, upto)
        if upto >= stop:
            return exp
        position, seg_resume, seg_from = upto, True, None


def _check_resumable(points: list[int], done: list[int], start: int, ckpt: Path) -> None:
    later = [p for p in done if p > start]
    if later:
        raise ConfigError(
            f"cannot resume from {ckpt}: the run re-routed after round {later[-1]} (route.em_rounds), later than "
            f"this checkpoint's round {start}, and the run's routing is that re-routing's; resume from the "
            f"newest checkpoint (--resume)")
    skipped = [p for p in points if p < start and p not in done]
    if skipped:
        raise DataError(
            f"{ckpt} is past rounds {skipped} of route.em_rounds, but the experiment never re-routed after them "
            f"({ckpt.parent.parent / EM_RECORD}); start the experiment again")


def reshard(cfg: Config, world: World, point: int, ckpt: Path, exp_dir: Path) -> None:
    """Rank 0 re-routes from ``ckpt`` (the checkpoint of round ``point``) and records it; every rank
    waits for it, so all of them resume on the new routing."""
    error = None
    if world.rank == 0:
        try:
            _reroute(cfg, world, point, ckpt, exp_dir)
        except Exception as exc:
            error = exc
    world.agree(error, f"re-routing after round {point}")


def _reroute(cfg: Config, world: World, point: int, ckpt: Path, exp_dir: Path) -> None:
    run = RunDir(cfg.run.dir)
    pending = pending_rerouting(exp_dir)
    report = json.loads((run.routing / REPORT).read_text()) if (run.routing / REPORT).is_file() else {}
    written = pending is not None and pending == current_fingerprint(run)
    if written and Path(report.get("checkpoint", "")).name == ckpt.name:  # this point's, from this checkpoint
        echo(f"[em] round {point}: keeping the re-routing from {ckpt.name} written before the stop")
        record_routing(cfg, exp_dir)
    else:
        echo(f"[em] round {point}/{cfg.train.rounds}: re-routing every document on the paths' losses "
             f"(route.em_rounds={list(cfg.route.em_rounds)})")
        report = reroute(cfg, checkpoint=str(ckpt), device=world.device, hint=False)
    moved, total = report["moved_train_docs_count"], sum(report["train"]["docs_per_path"])
    entry = {"round": point, "checkpoint": ckpt.name, "fingerprint": current_fingerprint(run),
             "moved_train_docs": report["moved_train_docs"], "moved_train_docs_count": moved,
             "docs_per_path": report["train"]["docs_per_path"]}
    write_text(exp_dir / EM_RECORD, json.dumps({"done": [*read_record(exp_dir), entry]}, indent=2) + "\n")
    metrics = MetricsLogger(exp_dir, tensorboard=False)
    try:
        metrics.log("em", step=point, **entry)
    finally:
        metrics.close()
    echo(f"[em] round {point}: {moved} of {total} train docs moved ({moved / max(total, 1):.1%}), shards now "
         f"{entry['docs_per_path']} docs; training continues on the new shards")
