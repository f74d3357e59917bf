"""The trainer: start-up, resume, checkpoints, metrics and error handling, written once for both schedulers.

It wires components that :func:`dipaco.build.build_trainer` (the composition root of training) built, and reads no
config value itself:

    shards (dipaco.route.shards) -> path models composed from the ModuleBank (dipaco.model.bank)
      -> an InnerLoop per path of this rank (dipaco.paths.inner)
      -> a scheduler: lock-step rounds with an outer sync (dipaco.train.rounds, dipaco.sync) under
         torchrun, or the asynchronous task queue on Ray (dipaco.train.tasks)
      -> checkpoints of the stateful components (dipaco.checkpoint.state) -> metrics (dipaco.metrics)

A scheduler yields :class:`Progress` when it has completed work to keep: the
trainer writes a checkpoint of every component, then has the scheduler log the work (``metrics.jsonl``
on rank 0). A run stopped between the checkpoint and its log logs it when it resumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dipaco.atomic import remove_tree, write_text
from dipaco.checkpoint.resume import check_resume
from dipaco.checkpoint.spec import SPEC
from dipaco.checkpoint.state import TrainingState
from dipaco.checkpoint.store import CONFIG, CheckpointManager, SavedCheckpoint, resolve_checkpoint, write_snapshot
from dipaco.checkpoint.writer import BackgroundWriter
from dipaco.comm.world import World
from dipaco.config import TrainConfig
from dipaco.errors import ConfigError, DistributedError
from dipaco.metrics import MetricsLogger, echo, read_metrics
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.paths.inner import InnerLoop, check_optim
from dipaco.route.provenance import check_routing, record_routing
from dipaco.runtime import finish_the_step
from dipaco.train.experiment import BuiltExperiment


def check_train(train: TrainConfig) -> None:
    """The ``train`` section's own keys (its optimizer: :func:`dipaco.paths.inner.check_optim`)."""
    for key in ("rounds", "inner_steps", "keep_checkpoints", "checkpoint_every", "log_every"):
        if getattr(train, key) <= 0:
            raise ConfigError(f"train.{key}: must be > 0, got {getattr(train, key)}")
    if not 0.0 <= train.early_stopping_holdout < 1.0:
        raise ConfigError(f"train.early_stopping_holdout: must be in [0, 1), got {train.early_stopping_holdout}")
    name = train.name
    if name in ("", ".", "..") or any(c in name for c in "/\\\0") or len(name.encode()) > 200:
        raise ConfigError(f"train.name: must be a plain directory name of at most 200 bytes (no '/', not '.' or "
                          f"'..'; it names <run.dir>/train/<name>), got {name if len(name) < 60 else name[:57] + '...'!r}")
    if train.diagnostics and train.driver != "torchrun":
        raise ConfigError("train.diagnostics: the paths' agreement is measured at the lock-step rounds of "
                          "train.driver=torchrun; the Ray task queue has no moment when every path's change is at hand")
    check_optim("train.optim", train.optim)


@dataclass
class Progress:
    """Work a scheduler completed that the trainer checkpoints, then logs: checkpoint ``index`` and what
    every rank reported (kept in the checkpoint, so a restart logs what a crash left unlogged)."""

    index: int
    reports: list
    info: dict = field(default_factory=dict)  # logged with the checkpoint event (the task scheduler's counts)


class Scheduler(Protocol):
    """What the trainer needs of a scheduler (:class:`~dipaco.train.rounds.RoundScheduler`,
    :class:`~dipaco.train.tasks.TaskScheduler`)."""

    driver: str
    sync: Any  # the checkpoint's sync component

    def describe(self) -> str: ...

    def run(self, start: int, until_round: int) -> Iterator[Progress]: ...

    def log(self, metrics: MetricsLogger, index: int, reports: list, info: dict, checkpoint_name: str) -> None: ...

    def logged(self, records: list[dict], index: int) -> bool: ...

    def summary(self, metrics: MetricsLogger) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


STEP_CHECKPOINT = "step_checkpoint"  # <experiment>/step_checkpoint/: a signal's checkpoint of the round in progress
ELASTIC_JOB = "elastic_job"  # <experiment>/elastic_job: the torchrun job (--rdzv-id) whose workers train it


@dataclass(frozen=True)
class CheckpointPolicy:
    """When checkpoints are written, and how (``train.checkpoint_every``, ``train.checkpoint_background``)."""

    every: int = 1  # every N of the scheduler's checkpoint points; the last one always
    background: bool = True  # a background writer (dipaco.checkpoint.writer); False: the round waits for the write


@dataclass
class Trainer:
    """One experiment as one rank trains it: the built record, its scheduler and checkpoints."""

    experiment: BuiltExperiment
    scheduler: Scheduler
    state: TrainingState
    checkpoints: CheckpointManager
    policy: CheckpointPolicy = field(default_factory=lambda: CheckpointPolicy())
    _in_flight: list[Progress] = field(default_factory=list, init=False, repr=False)  # what the write in flight covers

    @property
    def sync(self) -> Any:
        return self.scheduler.sync

    @property
    def bank(self) -> ModuleBank:
        return self.experiment.bank

    @property
    def loops(self) -> dict[int, InnerLoop]:
        return self.experiment.loops

    @property
    def dir(self) -> Path:
        return self.experiment.dir

    @property
    def world(self) -> World:
        return self.experiment.world

    @property
    def rounds(self) -> int:
        return self.experiment.rounds

    @property
    def topology(self) -> Topology:
        return self.experiment.topology

    @property
    def weights(self) -> dict[int, float]:
        return self.experiment.weights

    def train(self, resume: bool = False, resume_from: str | None = None, until_round: int | None = None) -> Trainer:
        """Trains up to ``until_round`` (default: every round), from scratch or from a checkpoint."""
        world = self.world
        if world.rank == 0:
            options = next(iter(self.loops.values())).options
            speed = f"{options.precision.name} on {world.device}" + (", compiled" if options.compile else "")
            ranks = "" if world.size == 1 else "; " + ", ".join(f"rank {r}: paths {list(ps)}"
                                                               for r, ps in enumerate(self.experiment.by_rank))
            echo(f"[train] {self.dir.name}: {self.experiment.topology.describe()}; {self.scheduler.describe()}; "
                 f"{speed}{ranks}")
        start, resumed = self._start(resume, resume_from)
        if world.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_text(self.dir / CONFIG, self.experiment.config_yaml)  # replaced whole: a full disk keeps the old one
            if world.env.run_id:
                write_text(self.dir / ELASTIC_JOB, world.env.run_id)
            self.experiment.spec.write(self.dir)
            record_routing(self.experiment.run_dir, self.dir, self.experiment.routed)
        rounds = self.experiment.rounds
        stop = rounds if until_round is None else min(until_round, rounds)
        metrics = MetricsLogger(self.dir) if world.rank == 0 else None
        writer = None
        if self.policy.background and (world.size == 1 or world.writer_group is not None):
            writer = BackgroundWriter(self.checkpoints, world.writers())
        due: list[Progress] = []  # completed work not yet in a checkpoint
        try:
            if metrics is not None and resumed is not None:
                self._log_unlogged(metrics, resumed)
            with finish_the_step():  # a first signal stops both schedulers between two inner steps
                try:
                    for count, progress in enumerate(self.scheduler.run(start, stop), start=1):
                        due.append(progress)
                        if count % self.policy.every == 0:
                            self._checkpoint(due, writer, metrics)
                            due = []
                except KeyboardInterrupt:
                    self._landed(writer, metrics)  # the round in flight is older than the step
                    self._stopped(due, metrics)
                    raise
            if due:  # the last point: nothing has changed since the scheduler yielded it
                self._checkpoint(due, writer, metrics)
            self._landed(writer, metrics)
            if metrics is not None:
                self.scheduler.summary(metrics)
        finally:
            try:
                self._landed(writer, metrics)  # stopped by a signal or an error: the write in flight still lands
            finally:
                self.scheduler.close()
                if metrics is not None:
                    metrics.close()
        return self

    def _checkpoint(self, due: list[Progress], writer: BackgroundWriter | None, metrics: MetricsLogger | None) -> None:
        """Checkpoints the state of ``due[-1]``, which covers the work of every ``due``; logs that work once
        the checkpoint is in place (the background writer: when it lands, at the next checkpoint or the end)."""
        last = due[-1]
        texts = {CONFIG: self.experiment.config_yaml, SPEC: self.experiment.spec.to_json()}
        earlier = [(p.index, p.reports, p.info) for p in due[:-1]]
        snapshot = self.state.snapshot(last.index, last.reports, last.info, texts, earlier)
        rank = self.world.rank
        if writer is None:
            ckpt = self.checkpoints.save(last.index, lambda d: write_snapshot(d, rank, snapshot, last.index), self.world)
            self._log(metrics, due, ckpt)
            return
        self._landed(writer, metrics)
        writer.submit(last.index, snapshot, lambda copy: lambda d: write_snapshot(d, rank, copy, last.index))
        self._in_flight = list(due)

    def _landed(self, writer: BackgroundWriter | None, metrics: MetricsLogger | None) -> None:
        """Waits for the write in flight, then logs the work it covers."""
        if writer is None or not writer.in_flight:
            return
        landed = writer.wait()
        assert landed is not None
        due, self._in_flight = self._in_flight, []
        self._log(metrics, due, landed[1])

    def _log(self, metrics: MetricsLogger | None, due: list[Progress], ckpt: Path) -> None:
        if metrics is not None:  # logged once the work is checkpointed: a restarted round is not logged twice
            for progress in due:
                self.scheduler.log(metrics, progress.index, progress.reports, progress.info, ckpt.name)
        if self.world.rank == 0:
            remove_tree(self.step_checkpoints.root)  # a newer round is in place: the step it stopped at is past

    @property
    def step_checkpoints(self) -> CheckpointManager:
        """Where a signal's step checkpoint goes: the round in progress, stopped between two inner steps."""
        return CheckpointManager(self.dir / STEP_CHECKPOINT, keep=1)

    def _stopped(self, due: list[Progress], metrics: MetricsLogger | None) -> None:
        """A signal stopped the round in progress between two steps (the lock-step scheduler): the whole state
        goes into a step checkpoint, with the completed rounds no round checkpoint holds yet. The task
        scheduler yields its state, every stopped task applied, before it raises: a checkpoint like any other."""
        if not hasattr(self.scheduler, "stopped_at"):
            if due:
                self._checkpoint(due, None, metrics)
            latest = self.checkpoints.latest()
            if latest is not None:
                echo(f"[train] stopped: the checkpoint is {latest}; continue with --resume")
            return
        stopped = self.scheduler.stopped_at
        if stopped is None:
            return
        index, rank = int(stopped["round"]), self.world.rank  # the rounds completed
        texts = {CONFIG: self.experiment.config_yaml, SPEC: self.experiment.spec.to_json()}
        snapshot = self.state.snapshot(index, None, {}, texts, [(p.index, p.reports, p.info) for p in due])
        ckpt = self.step_checkpoints.save(index, lambda d: write_snapshot(d, rank, snapshot, index), self.world)
        steps = ", ".join(f"path {p} step {loop.step}" for p, loop in self.loops.items())
        where = f"rank {rank}: " if self.world.size > 1 else ""
        echo(f"[train] {where}stopped in round {index + 1} ({steps}): the step checkpoint is {ckpt}; "
             f"continue with --resume")

    def _start(self, resume: bool, resume_from: str | None) -> tuple[int, Path | None]:
        """The index to start from and the checkpoint it comes from (None: a fresh start); every rank agrees."""
        world = self.world
        start, resumed, error = 0, None, None
        restarted = (world.restarted or self._same_elastic_job()) and not (resume or resume_from)
        try:
            latest = self.checkpoints.latest() or self.step_checkpoints.latest()
            if resume or resume_from or (restarted and latest is not None):
                if restarted and world.rank == 0 and latest is not None:
                    what = f"restart {world.restarts}" if world.restarts else "a new attempt (for a node that joined)"
                    echo(f"[train] {what} of the worker group: continuing from {latest.name}")
                check_routing(self.experiment.run_dir, self.dir, self.experiment.routed)
                start, resumed = self.restore(resume_from)
            elif latest is not None:
                raise ConfigError(f"{self.dir} already has checkpoints; pass --resume to continue it, "
                                  f"or choose another train.name to start a new experiment")
        except Exception as exc:  # shared with every rank, so none waits for a rank that gave up
            error = exc
        world.agree(error, "resuming")
        starts = world.all_gather_object(start, "first round")
        if len(set(starts)) > 1:
            raise DistributedError(
                f"ranks would start from different rounds ({starts}); run.dir must be on storage every rank sees")
        return start, resumed

    def _same_elastic_job(self) -> bool:
        """Whether this experiment was started by this torchrun job: a new attempt of its worker group. torchrun
        counts only failures in TORCHELASTIC_RESTART_COUNT; a group it restarts because a node joined (a lost site
        back before the failure was noticed, say) is at count 0 on every rank, and is no new run either."""
        job = self.world.env.run_id
        marker = self.dir / ELASTIC_JOB
        return bool(job) and marker.is_file() and marker.read_text(encoding="utf-8", errors="replace") == job

    def restore(self, resume_from: str | None) -> tuple[int, Path]:
        """Loads the newest (or the given) checkpoint; returns its index and the checkpoint.

        Each rank verifies and reads the module states and its own paths only."""
        own = tuple(f"paths/path_{p:03d}/" for p in self.loops)
        manager, step, latest = self.checkpoints, self.step_checkpoints.latest(), self.checkpoints.latest()
        if resume_from is None and step is not None and (latest is None or step.name >= latest.name):
            manager = self.step_checkpoints  # stopped in the round after the newest round checkpoint
        ckpt = resolve_checkpoint(manager, resume_from,
                                  select=lambda rel: not rel.startswith("paths/") or rel.startswith(own))
        check_resume(ckpt, self.experiment.config_yaml)
        state = self.state.restore(SavedCheckpoint(ckpt, self.world.rank, self.bank.device))
        if self.world.rank == 0:
            echo(f"[train] resumed from {ckpt} (round {state['round']})")
        return int(state["round"]), ckpt

    def _log_unlogged(self, metrics: MetricsLogger, ckpt: Path) -> None:
        """A checkpoint's work is logged after it is in place, so a worker killed in between leaves it
        unlogged; the resumed run logs it from the reports the checkpoint kept (of every point it covers)."""
        state = SavedCheckpoint(ckpt).state()
        logged = self.dir / "metrics.jsonl"
        records = read_metrics(logged) if logged.is_file() else []
        covered = [*state.get("earlier", []), (int(state["round"]), state.get("reports"), state.get("checkpoint_info", {}))]
        for index, reports, info in covered:
            if index > 0 and not self.scheduler.logged(records, index) and reports is not None:
                self.scheduler.log(metrics, index, reports, info, ckpt.name)
