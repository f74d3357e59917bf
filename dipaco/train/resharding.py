"""EM-style re-sharding inside `dipaco train` (``route.em_rounds``; DiPaCo, arXiv 2403.10616, section 2.4.2).

After each listed round the paths' losses re-shard the documents (discriminative re-routing,
:func:`dipaco.train.reroute.reroute`: the E step) and the paths train on their new shards until the
next point (the M step). The run is exactly the manual sequence, in one command::

    dipaco train --until-round p1; dipaco reroute; dipaco train --resume --until-round p2; dipaco reroute; ...

Each training segment is the ordinary trainer (``segment``: :meth:`dipaco.train.trainer.Trainer.train`)
continuing from the checkpoint of the point, so the bank equals the manual sequence's bit for bit on
CPU. A point is re-routed only when training continues past it: ``--until-round p`` stops at p's
checkpoint, and the resume re-routes first.

Resume: ``train/<name>/em.json`` lists the points already re-routed, with the routing fingerprint each
produced. A resumed run re-routes the points it has not done yet and never redoes one; a checkpoint
older than a re-routing already done is refused (the run's routing has moved on). A re-routing that
wrote the new routing but stopped before recording it (see :func:`dipaco.route.provenance.pending_rerouting`)
is kept, not redone.

Under torchrun, rank 0 re-routes (it loads the checkpoint's full bank and scores every path) while the
other ranks wait for it in a collective; every rank then builds its shards from the new routing as it
resumes. Re-routing must finish within ``dist.timeout_s``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dipaco import json_text
from dipaco.atomic import write_text
from dipaco.checkpoint.store import TRAINER_STATE, CheckpointManager, SavedCheckpoint
from dipaco.comm.world import World
from dipaco.config import RouteConfig, TrainConfig
from dipaco.errors import ConfigError, DataError
from dipaco.metrics import MetricsLogger, echo
from dipaco.route.assign import REPORT
from dipaco.route.provenance import current_fingerprint, pending_rerouting, record_routing
from dipaco.route.provenance import read_record as read_json
from dipaco.run_dir import RunDir
from dipaco.train.trainer import Trainer

EM_RECORD = "em.json"  # in the experiment directory: the re-routings done, in order

# (resume, resume_from, until_round) -> the trainer after training up to until_round
Segment = Callable[[bool, "str | None", "int | None"], Trainer]


@dataclass(frozen=True)
class EMPlan:
    """Where the run re-routes itself, and how."""

    points: list[int]  # route.em_rounds
    rounds: int  # train.rounds
    run_dir: Path
    exp_dir: Path
    check_resume: Callable[[Path], None]  # refuses a checkpoint whose config differs (a changed route.em_rounds)
    reroute: Callable[[Path], dict]  # discriminative re-routing from a checkpoint; returns its report


def check_em(route: RouteConfig, train: TrainConfig, num_paths: int) -> None:
    """route.em_rounds: re-routing points inside the run, of routed shards, between lock-step rounds."""
    points = list(route.em_rounds)
    if not points:
        return
    key, rounds = "route.em_rounds", train.rounds
    outside = [r for r in points if not 0 < r < rounds]
    if outside:
        raise ConfigError(f"{key}: rounds after which to re-route must be in [1, train.rounds={rounds}) (the paths "
                          f"must train on the new shards afterwards), got {outside}")
    if points != sorted(set(points)):
        raise ConfigError(f"{key}: must be strictly increasing (each round once), got {points}")
    if train.sharding != "kmeans":
        raise ConfigError(f"{key}: re-routing re-shards routed data; needs train.sharding=kmeans (and `dipaco route` "
                          f"first), got train.sharding={train.sharding}")
    if train.driver != "torchrun":
        raise ConfigError(f"{key}: needs train.driver=torchrun (re-routing happens between lock-step rounds), "
                          f"got train.driver={train.driver}")
    if train.early_stopping_holdout > 0:
        raise ConfigError(f"{key}: cannot be combined with train.early_stopping_holdout (each path's held-out "
                          f"documents, which early stopping compares across rounds, change at every re-routing)")
    if num_paths == 1:
        raise ConfigError(f"{key}: the topology has one path, so there is nothing to re-route documents between")


def read_record(exp_dir: Path) -> list[dict]:
    """The re-routings this experiment has done: ``{"round", "fingerprint", "moved_train_docs", ...}``."""
    file = exp_dir / EM_RECORD
    record = read_json(file) or {"done": []}
    if not isinstance(record.get("done"), list):
        raise DataError(f"{file}: no list of re-routings in it")
    return record["done"]


def checkpoint_round(ckpt: Path) -> int | None:
    """Rounds a checkpoint directory completed (None when it is not one: the driver then says why)."""
    match = re.fullmatch(r"round_(\d+)", ckpt.name)
    if match:
        return int(match.group(1))
    return int(SavedCheckpoint(ckpt).state()["round"]) if (ckpt / TRAINER_STATE).is_file() else None


def train_em(plan: EMPlan, world: World, resume: bool, resume_from: str | None, until_round: int | None,
             segment: Segment) -> Trainer:
    """Trains up to ``until_round`` (default: train.rounds), re-routing after every round of
    route.em_rounds that training passes."""
    points, exp_dir = list(plan.points), plan.exp_dir
    stop = plan.rounds if until_round is None else min(until_round, plan.rounds)
    checkpoints = CheckpointManager(exp_dir / "checkpoints")
    restarted = world.restarted and not (resume or resume_from)
    ckpt = Path(resume_from) if resume_from else checkpoints.latest() if (resume or restarted) else None
    start, done, error = None, [], None
    try:
        start = checkpoint_round(ckpt) if ckpt is not None else None
        if start is not None and ckpt is not None:
            if (ckpt / "config.yaml").is_file():
                plan.check_resume(ckpt)  # before the points: a changed route.em_rounds is named as such
            done = [entry["round"] for entry in read_record(exp_dir)]
            _check_resumable(points, done, start, ckpt)
    except Exception as exc:  # every rank read the same files; shared so that none waits for another
        error = exc
    world.agree(error, "checking the EM re-routing points")
    if start is None:
        if resume or resume_from or checkpoints.latest() is not None:
            return segment(resume, resume_from, until_round)  # it refuses, naming the problem
        if world.rank == 0:
            (exp_dir / EM_RECORD).unlink(missing_ok=True)  # a fresh run: nothing re-routed yet

    position, exp = start or 0, None
    seg_resume, seg_from = resume, resume_from
    while True:
        if position in points and position not in done and position < stop:
            point_ckpt = ckpt if exp is None else checkpoints.latest()
            assert point_ckpt is not None  # a point is passed only once its round is checkpointed
            reshard(plan, world, position, point_ckpt)
            done.append(position)
            seg_resume = True
        upto = min([p for p in points if position < p < stop], default=stop)
        exp = segment(seg_resume, seg_from, upto)
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


def reshard(plan: EMPlan, world: World, point: int, ckpt: Path) -> None:
    """Rank 0 re-routes from ``ckpt`` (the checkpoint of round ``point``) and records it; every rank
    waits for it, so all of them resume on the new routing."""
    error = None
    world.untimed()  # re-routing takes longer than a round, and no round timed it
    if world.rank == 0:
        try:
            _reroute(plan, point, ckpt)
        except Exception as exc:
            error = exc
    world.agree(error, f"re-routing after round {point}")


def _reroute(plan: EMPlan, point: int, ckpt: Path) -> None:
    run, exp_dir = RunDir(plan.run_dir), plan.exp_dir
    pending = pending_rerouting(exp_dir)
    report = read_json(run.routing / REPORT) or {}
    written = pending is not None and pending == current_fingerprint(run)
    if written and Path(report.get("checkpoint", "")).name == ckpt.name:  # this point's, from this checkpoint
        echo(f"[em] round {point}: keeping the re-routing from {ckpt.name} written before the stop")
        record_routing(plan.run_dir, exp_dir, True)
    else:
        echo(f"[em] round {point}/{plan.rounds}: re-routing every document on the paths' losses "
             f"(route.em_rounds={list(plan.points)})")
        report = plan.reroute(ckpt)
    moved, total = report["moved_train_docs_count"], sum(report["train"]["docs_per_path"])
    entry = {"round": point, "checkpoint": ckpt.name, "fingerprint": current_fingerprint(run),
             "moved_train_docs": report["moved_train_docs"], "moved_train_docs_count": moved,
             "docs_per_path": report["train"]["docs_per_path"]}
    write_text(exp_dir / EM_RECORD, json_text.dumps({"done": [*read_record(exp_dir), entry]}, indent=2) + "\n")
    metrics = MetricsLogger(exp_dir, tensorboard=False)
    try:
        metrics.log("em", step=point, **entry)
    finally:
        metrics.close()
    echo(f"[em] round {point}: {moved} of {total} train docs moved ({moved / max(total, 1):.1%}), shards now "
         f"{entry['docs_per_path']} docs; training continues on the new shards")
