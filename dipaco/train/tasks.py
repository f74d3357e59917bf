"""The task scheduler (``train.driver=ray``): asynchronous DiPaCo on Ray, the paper's infrastructure.

DiPaCo (Douillard et al., arXiv 2403.10616) trains without lock-step rounds: preemptible workers take
path tasks from a queue (:class:`~dipaco.sync.async_schedule.TaskQueue`), run the path's inner steps
and hand back its change, and an outer executor per module group applies the changes of the paths
through each module as they arrive (:class:`~dipaco.sync.async_nesterov.AsyncNesterov`). Ray is the
engine: the actors of :mod:`dipaco.train.task_actors`, task results and deltas in its object store.
Everything else is the trainer's: every ``ray.checkpoint_every`` completed tasks the scheduler yields
the executors' state gathered into the bank, and the trainer writes the checkpoint and logs the tasks.

Guarantees:

* every update is applied exactly once per module: Ray sends a call again when its executor died
  (``max_task_retries=-1``); the executor restarts from its own checkpoint and refuses a task id it
  has already applied;
* a task whose worker died goes back to the queue with the path's previous AdamW state (only its inner
  steps are lost), for the next free worker, at most ``ray.task_retries`` times; Ray restarts the
  worker, which joins the pool again once it answers;
* with ``ray.max_staleness`` S no update is staler than S; ``ray.schedule=rounds`` reproduces
  per-module DiLoCo (:mod:`dipaco.sync.diloco`) up to the order of fp32 sums;
* SIGINT or SIGTERM stops each running task after its step in progress; the trainer checkpoints it as it
  is (AdamW state, parameters, the modules it started from) and ``--resume`` continues it from there, so
  a signal loses no step, and a run whose arrivals are deterministic (``ray.schedule=rounds``, one
  worker) resumes bit-exactly (a worker killed outright still loses its task's steps).

Asynchronous runs are not bit-reproducible: the order of arrivals depends on timing.
"""

from __future__ import annotations

import math
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from dipaco.config import DistConfig, OuterConfig, RayConfig, TrainConfig
from dipaco.errors import ConfigError, DistributedError
from dipaco.metrics import MetricsLogger, echo
from dipaco.runtime import interrupted
from dipaco.sync.async_nesterov import PARAMS, default_delay, staleness_summary
from dipaco.sync.async_schedule import Task, TaskQueue, check_staleness_bound
from dipaco.sync.nesterov import module_outer_lr
from dipaco.train.experiment import BuiltExperiment
from dipaco.train.path_states import ObjectStore, PathStates
from dipaco.train.task_actors import (
    EXECUTORS_DIR,
    SYNC_PARTS,
    TASK_BASE,
    ExecutorSpec,
    ExecutorState,
    ModuleExecutor,
    PathWorker,
)
from dipaco.train.trainer import Progress

SIGNAL_POLL_S = 0.2  # how often the driver, waiting on Ray, looks for a signal
WORKER_WAIT_S = 30.0  # how often the driver says it is still waiting for its first worker


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError('train.driver: ray needs Ray: pip install "dipaco[ray]"') from None
    return ray


def init_ray(ray: Any, **options: Any) -> None:
    """``ray.init``, which makes SIGTERM call sys.exit: the handler before it (runtime.sigint_stops_training's,
    which lets the trainer checkpoint first) is put back."""
    ours = signal.getsignal(signal.SIGTERM)
    ray.init(**options)
    if ours is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, ours)


@dataclass
class InFlight:
    """A run's state on Ray, made by :meth:`TaskScheduler.run`: its queue, its actors, what is in flight."""

    queue: TaskQueue
    started_ray: bool  # this run called ray.init, so close() shuts Ray down
    last_checkpoint: int  # tasks completed as of the last checkpoint
    states: PathStates  # where each path's AdamW state is
    workers: list = field(default_factory=list)  # PathWorker actors
    actors: list = field(default_factory=list)  # ModuleExecutor actors, one per module group
    executors: dict[int, Any] = field(default_factory=dict)  # module -> its group's actor
    nodes: dict[int, str] = field(default_factory=dict)  # worker -> the address of its node, once it answered
    partial: dict[int, Any] = field(default_factory=dict)  # path a signal stopped mid-task -> its parameters (a ref)
    free: deque[int] = field(default_factory=deque)  # workers without a task
    tasks: dict[Any, Callable[[Any], None]] = field(default_factory=dict)  # a task's first return ref (or a probe) -> handler
    acks: dict[Any, Callable[[Any], None]] = field(default_factory=dict)  # a sent update's push ref -> its handler
    records: list[tuple[str, int | None, dict]] = field(default_factory=list)  # to log once checkpointed
    staleness: list[int] = field(default_factory=list)
    requeues: int = 0
    start: float = 0.0  # perf_counter once the actors answer
    checkpoint_due: bool = False


class TaskScheduler:
    """Path tasks on Ray workers, one outer executor per module group (see the module docstring)."""

    driver = "ray"
    flight: InFlight  # set by run()

    def __init__(self, experiment: BuiltExperiment, ray: RayConfig, outer: OuterConfig, dynamic_steps: bool = False,
                 on_start: Callable[[TaskScheduler], None] | None = None) -> None:
        """``dynamic_steps``: train.dynamic_local_steps; ``on_start``: called once the actors answer (tests)."""
        check_staleness_bound(ray.max_staleness, experiment.topology)
        self.experiment, self.ray_cfg, self.outer, self.dynamic_steps = experiment, ray, outer, dynamic_steps
        self.topology, self.bank, self.loops, self.on_start = experiment.topology, experiment.bank, experiment.loops, on_start
        self.names = {m.id: m.name for m in self.topology.modules}
        self.sync = ExecutorState(list(self.names.values()))
        self.speeds = worker_speeds(ray, self.topology.num_paths)
        self.groups = executor_groups(len(self.topology.modules), ray.executors)
        self.queue_state: dict | None = None
        self.counters: dict[str, dict] | None = None  # each module's executor counters, as of the last checkpoint
        self.paused: dict[int, dict] = {}  # path -> its task a signal stopped: where it is, the modules it started from
        self.ray: Any = None

    def describe(self) -> str:
        return (f"on Ray: {len(self.speeds)} workers (speeds {self.speeds}), {len(self.groups)} executors for "
                f"{len(self.names)} modules ({self.ray_cfg.schedule}, outer.sync={self.outer.sync})")

    def run(self, start: int, until_round: int) -> Iterator[Progress]:
        """``until_round`` rounds' worth of inner steps in tasks, from the queue state restored; yields every
        ``ray.checkpoint_every`` completed tasks and at the end."""
        steps, cfg = self.experiment.inner_steps, self.ray_cfg
        queue = TaskQueue(self.topology, steps, until_round * steps * self.topology.num_paths, cfg.schedule,
                          cfg.max_staleness, self.dynamic_steps, self.queue_state)
        for p, t in self.paused.items():
            queue.resume(Task(p, t["index"], t["steps"], start=dict(t["start"]), attempt=t["attempt"], done=t["done"]))
        self.ray = ray = _ray()
        started_ray = not ray.is_initialized()
        if started_ray:
            init_ray(ray, address=cfg.address, include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": cfg.num_cpus} if cfg.address is None else {}))
        store = ObjectStore(ray.put, ray.get, (ray.exceptions.ObjectLostError,), self._state_lost)
        states = PathStates({p: ray.put(loop.state_dict()) for p, loop in self.loops.items()}, cfg.state_sync_every,
                            store)
        self.flight = InFlight(queue, started_ray, last_checkpoint=queue.completed, states=states)
        self._start_actors()
        echo(f"[train] {queue.budget - queue.steps_done - sum(t['done'] for t in self.paused.values())} inner steps to go")
        if self.on_start is not None:
            self.on_start(self)
        yield from self._events()

    def _start_actors(self) -> None:
        """Ray restarts a dead actor, on any node, with the arguments it was created with: a spec, and what
        builds the rest from files every node sees, never an object a lost node could take with it. It sends
        an executor's calls again (the executor restores its own checkpoint), not a worker's: the queue gives
        its task to any worker. A worker joins the pool once it answers: the ones the cluster cannot place
        yet (``ray.worker_cpus``) join when a node does."""
        ray, topo, flight = self.ray, self.topology, self.flight
        # max_concurrency=2: a stop() call reaches a worker while it runs a task
        worker_cls = ray.remote(PathWorker).options(**self._worker_share(), max_restarts=-1, max_task_retries=0,
                                                    max_concurrency=2)
        llama = next(iter(self.loops.values())).model.config
        flight.workers += [worker_cls.remote(speed, self.experiment.load_path_loops, llama, topo) for speed in self.speeds]
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # beside the driver, the node a run cannot lose: a worker elsewhere sends its node's link only its own
        # path's modules and deltas (a 0-CPU actor could otherwise land on any node, and carry everyone's). Not
        # soft: that gave way to another node while the driver's was busy starting a worker.
        beside_driver = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        executor_cls = ray.remote(ModuleExecutor).options(num_cpus=0, max_restarts=-1, max_task_retries=-1,
                                                          scheduling_strategy=beside_driver)
        root = self.experiment.dir / EXECUTORS_DIR / f"run_{int(time.time() * 1000)}"
        for g, group in enumerate(self.groups):
            through = {m: topo.paths_through(m) for m in group}
            spec = ExecutorSpec(
                names={m: self.names[m] for m in group},
                path_weights={m: {p: self.experiment.weights[p] for p in through[m]} for m in group},
                lr={m: module_outer_lr(self.outer, topo, m) for m in group}, momentum=self.outer.momentum,
                delay={m: default_delay(len(through[m]), self.outer.nesterov_delay) for m in group},
                root=str(root / f"executor_{g:03d}"), every=self.ray_cfg.executor_checkpoint_every,
                config_yaml=self.experiment.config_yaml, rescale=self.outer.rescale)
            ModuleExecutor.write_start(spec, {m: self.bank.params[m].detach().clone() for m in group}, self._saved(group))
            flight.actors.append(executor_cls.remote(spec))
        flight.executors = {m: flight.actors[g] for g, group in enumerate(self.groups) for m in group}
        for g, node in enumerate(ray.get([actor.node.remote() for actor in flight.actors])):
            flight.records.append(("executor", None, {"executor": g, "node": node}))
        for old in root.parent.glob("run_*"):  # an earlier run's executors: its checkpoint is the truth now
            if old != root:
                shutil.rmtree(old, ignore_errors=True)
        flight.partial = {p: ray.put(dict(self.loops[p].model.named_parameters())) for p in self.paused}
        for w, worker in enumerate(flight.workers):
            flight.tasks[worker.node.remote()] = partial(self._on_probe, w)
        # The clock starts once every worker answered (ray.schedule=rounds is DiLoCo only where a round's
        # tasks all start before one is applied), or with ray.worker_cpus once one did: the others may be
        # waiting for a node that joins later.
        while flight.tasks and (self.ray_cfg.worker_cpus is None or not flight.free):
            waited = len(flight.tasks)
            self._next(flight.tasks, WORKER_WAIT_S)
            if len(flight.tasks) == waited:
                echo(f"[train] {len(flight.tasks)} of {len(flight.workers)} path workers have not started after "
                     f"{WORKER_WAIT_S:.0f}s: the cluster has no room for {self._worker_share()} each")
        flight.start = time.perf_counter()

    def _worker_share(self) -> dict[str, float]:
        """The resources of one worker: ``ray.worker_cpus`` each, or the cluster's at start shared by them all."""
        resources = self.ray.cluster_resources()
        if self.ray_cfg.worker_cpus is not None:
            return {"num_cpus": self.ray_cfg.worker_cpus}
        share = {"num_cpus": min(1.0, resources.get("CPU", 1.0) / len(self.speeds))}
        if resources.get("GPU", 0) > 0:  # the workers train on the node's GPUs, as lock-step ranks do
            share["num_gpus"] = min(1.0, resources["GPU"] / len(self.speeds))
        return share

    def _saved(self, group: list[int]) -> tuple[dict, dict] | None:
        """A group's executor state from the restored run checkpoint (tensors by part, counters), or None."""
        if self.counters is None:
            return None
        names = [self.names[m] for m in group]
        tensors = {PARAMS: {self.names[m]: self.bank.params[m].detach().clone() for m in group},
                   **{part: {n: self.sync.parts[part][n] for n in names} for part in SYNC_PARTS}}
        return tensors, {"pending": {m: self.counters[self.names[m]]["pending"] for m in group},
                         "log": [u for n in names for u in self.counters[n]["log"]]}

    def _events(self) -> Iterator[Progress]:
        while not self.flight.queue.done():
            if (signal := interrupted()) is not None:
                yield from self._stop(signal)
            self._dispatch()
            if not self.flight.tasks and not self.flight.acks:
                raise DistributedError(f"no task can start and none is running ({self.flight.queue.remaining} inner steps "
                                       f"left); ray.max_staleness may be too small")
            self._next({**self.flight.tasks, **self.flight.acks}, SIGNAL_POLL_S)
            if self.flight.checkpoint_due:
                yield self.checkpoint()
        if self.flight.last_checkpoint != self.flight.queue.completed:
            yield self.checkpoint()

    def _next(self, waiting: dict[Any, Callable[[Any], None]], timeout: float | None = None) -> None:
        """Handles the next of the ``waiting`` calls to return (none when ``timeout`` seconds pass first)."""
        for ref in self.ray.wait(list(waiting), num_returns=1, timeout=timeout)[0]:
            (self.flight.tasks.pop(ref, None) or self.flight.acks.pop(ref))(ref)

    def _stop(self, signal: type[KeyboardInterrupt]) -> Iterator[Progress]:
        """A signal (under runtime.finish_the_step): each running task stops after its step in progress and is
        kept as it is; once every sent update is applied, the state is yielded, then the signal raised."""
        for task in self.flight.queue.running.values():
            self.flight.workers[task.worker].stop.remote()
        while self.flight.queue.running:
            self._next(self.flight.tasks)
        self._sync_all()
        yield self.checkpoint()
        raise signal()

    def _sync_all(self) -> None:
        while self.flight.acks:
            self._next(self.flight.acks)
        self.flight.states.sync_all()

    def _dispatch(self) -> None:
        """Each free worker first takes a path whose newest AdamW state it made (it stays on its node),
        then any path that may start."""
        flight = self.flight
        for worker in list(flight.free):
            made = self.flight.states.made_by(worker)
            if made and (task := flight.queue.dispatch(worker, made)) is not None:
                flight.free.remove(worker)
                self._send(task)
        while flight.free and (task := flight.queue.dispatch(flight.free[0])) is not None:
            flight.free.popleft()
            self._send(task)

    def _send(self, task: Task) -> None:
        paused = self.paused.get(task.path) if task.done else None
        modules = paused["base"] if paused else [self.flight.executors[m].pull.remote(m)
                                                 for m in self.topology.path_modules(task.path)]
        refs = self.flight.workers[task.worker].run.options(num_returns=3 + len(self.topology.parts)).remote(
            task.path, task.steps - task.done, self.flight.states.newest[task.path], *modules,
            params=self.flight.partial[task.path] if paused else None)
        self.flight.tasks[refs[0]] = partial(self._on_task, task, refs, modules)

    def _on_task(self, task: Task, refs: list, modules: list, ref: Any) -> None:
        try:
            meta = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            if self._lost_object(exc):  # the path's state, an argument, was on a node that is gone
                self.flight.states.fall_back(task.path)
                return self._requeue(task, exc)
            if isinstance(exc, self.ray.exceptions.RayTaskError):
                raise  # the task itself failed (a bug or bad data): not something a retry heals
            return self._requeue(task, exc)
        self.flight.free.append(task.worker)
        if meta["steps"] < task.steps - task.done:
            return self._pause(task, meta["steps"], refs, modules)
        self.paused.pop(task.path, None)
        self.flight.queue.sent(task, meta["tokens_per_s"])
        waiting, result = set(task.start), {**meta, "inner": refs[1], "staleness": {}}
        for m, delta in zip(self.topology.path_modules(task.path), refs[3:]):
            push = self.flight.executors[m].push.remote(task.id, task.path, m, task.start[m], delta)
            self.flight.acks[push] = partial(self._on_push, task, m, waiting, result)

    def _lost_object(self, exc: Exception) -> bool:
        lost = self.ray.exceptions.ObjectLostError
        return isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost)

    def _pause(self, task: Task, steps: int, refs: list, modules: list) -> None:
        """A signal stopped the task after ``steps`` more of its steps. Nothing of it is applied: its AdamW state,
        parameters and the modules it started from are kept, and the checkpoint continues it after a resume."""
        base = self.paused[task.path]["base"] if task.path in self.paused else self.ray.get(modules)
        task.done += steps
        self.paused[task.path] = {"index": task.index, "steps": task.steps, "done": task.done, "start": dict(task.start),
                                  "attempt": task.attempt, "base": base}
        self.flight.partial[task.path] = refs[2]
        self.flight.states.stopped(task.path, refs[1])
        self.flight.queue.paused(task)
        echo(f"[train] {task.id} stopped after {task.done} of its {task.steps} steps; --resume continues it there")

    def _state_lost(self, path: int, age: int) -> None:
        """The path's newest AdamW state may have gone with a node: it continues from the driver's copy
        (``state_age``: its tasks since, whose AdamW steps are lost; the parameters are not)."""
        self.flight.records.append(("state_lost", None, {"path": path, "state_age": age}))
        if age:
            echo(f"[train] path {path} continues from the AdamW state of {age} of its tasks ago (ray.state_sync_every)")

    def _requeue(self, task: Task, exc: Exception) -> None:
        """The task's worker died (killed, preempted, out of memory, its node gone): the task goes back to the
        queue; the worker, which Ray restarts where there is room, is free again once it answers a probe.
        The AdamW states that worker made fall back to the driver's: its node may have taken them along."""
        never_ran = isinstance(exc, self.ray.exceptions.ActorUnavailableError)  # sent while it was restarting
        if not never_ran:
            self.flight.states.lost_worker(task.worker)
        probe = self.flight.workers[task.worker].node.options(max_task_retries=-1).remote()
        self.flight.tasks[probe] = partial(self._on_probe, task.worker)
        if not never_ran and task.attempt >= self.ray_cfg.task_retries:
            raise DistributedError(f"task {task.id} lost its worker {task.attempt + 1} times "
                                   f"(ray.task_retries={self.ray_cfg.task_retries}): {type(exc).__name__}") from None
        self.flight.queue.failed(task, count=not never_ran)
        self.flight.requeues += 1
        echo(f"[train] worker {task.worker} died during {task.id}: re-queued")
        self.flight.records.append(("requeue", None, {"task": task.id, "path": task.path, "worker": task.worker,
                                               "attempt": task.attempt, "reason": "worker"}))

    def _on_probe(self, worker: int, ref: Any) -> None:
        """A worker answered (started, or restarted by Ray): it joins the pool."""
        try:
            node = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            raise DistributedError(f"worker {worker} died and Ray could not restart it: {exc}") from None
        if self.flight.nodes.get(worker) != node:
            if self.flight.start and node not in self.flight.nodes.values():
                echo(f"[train] node {node} joined: worker {worker} takes tasks there")
            self.flight.records.append(("worker", None, {"worker": worker, "node": node}))
        self.flight.nodes[worker] = node
        self.flight.free.append(worker)

    def _on_push(self, task: Task, module: int, waiting: set[int], result: dict, ref: Any) -> None:
        try:
            update = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            if not self._lost_object(exc):
                raise
            update = None
            if not result.get("lost"):  # the deltas were on a node that is gone: the task runs again
                result["lost"] = True
                self.flight.queue.lost(task)
                echo(f"[train] {task.id}'s changes were lost with their node: re-queued")
                self.flight.records.append(("requeue", None, {"task": task.id, "path": task.path, "worker": task.worker,
                                                       "attempt": task.attempt, "reason": "deltas"}))
        if result.get("lost"):
            return
        if update is not None:  # None: the executor had applied it before it restarted
            self.flight.staleness.append(update["staleness"])
            result["staleness"][self.names[module]] = update["staleness"]
        waiting.discard(module)
        if waiting:
            return
        self.flight.states.applied(task.path, result["inner"], task.worker)
        self.flight.queue.applied(task)
        if self.flight.queue.done():  # the last checkpoint holds every path's newest AdamW state
            self._sync_all()
        self.flight.records.append(("task", self.flight.queue.completed, {
            "task": task.id, "path": task.path, "worker": task.worker, "steps": task.steps, "attempt": task.attempt,
            **{k: result[k] for k in ("loss", "tokens", "seconds", "compute_seconds", "tokens_per_s", "lr", "staleness",
                                      "node")},
            "steps_done": self.flight.queue.steps_done, "elapsed": time.perf_counter() - self.flight.start}))
        every = self.ray_cfg.checkpoint_every or self.topology.num_paths
        self.flight.checkpoint_due = self.flight.checkpoint_due or self.flight.queue.completed % every == 0

    def checkpoint(self) -> Progress:
        """The completed tasks' state in the bank, the paths and the sync component: every sent update is
        applied first, so they agree (tasks still computing are run again on resume)."""
        while self.flight.acks:
            self._next(self.flight.acks)
        states = self.ray.get([actor.state.remote() for actor in self.flight.actors])
        inner, state_age = self.flight.states.gathered(), self.flight.states.oldest()
        self.counters = {}
        with torch.no_grad():
            for group, (tensors, counter) in zip(self.groups, states):
                for m in group:
                    name = self.names[m]
                    self.bank.params[m].copy_(tensors[PARAMS][name])
                    for part in SYNC_PARTS:
                        self.sync.parts[part][name] = tensors[part][name]
                    self.counters[name] = {"pending": counter["pending"][m],
                                           "log": [u for u in counter["log"] if u["module"] == m]}
            self.sync.parts.pop(TASK_BASE, None)
            if self.paused:
                self.sync.parts[TASK_BASE] = {f"{p}/{self.names[m]}": base for p, task in self.paused.items()
                                              for m, base in zip(self.topology.path_modules(p), task["base"])}
            for p, loop in self.loops.items():
                loop.load_state_dict(inner[p])
                if p in self.paused:  # mid-task: its own parameters, not the bank's
                    loop.model.load_state_dict(self.ray.get(self.flight.partial[p]), strict=False)
                else:
                    self.bank.load_path(p, loop.model)
        self.flight.checkpoint_due, self.flight.last_checkpoint = False, self.flight.queue.completed
        records, self.flight.records = self.flight.records, []
        info = {"tasks": self.flight.queue.completed, "inner_steps": self.flight.queue.steps_done,
                "elapsed": time.perf_counter() - self.flight.start, "state_age": state_age}
        return Progress(self.flight.queue.completed, records, info)

    def logged(self, records: list[dict], index: int) -> bool:
        return any(r["event"] == "checkpoint" and r.get("step") == index for r in records)

    def log(self, metrics: MetricsLogger, index: int, reports: list, info: dict, checkpoint_name: str) -> None:
        """The completed tasks (and re-queues) since the last checkpoint, then the checkpoint: one append."""
        with metrics.together():
            for event, step, values in reports:
                metrics.log(event, step=step, **values)
            metrics.log("checkpoint", step=index, checkpoint=checkpoint_name, **info)

    def summary(self, metrics: MetricsLogger) -> None:
        wall, summary = time.perf_counter() - self.flight.start, staleness_summary(self.flight.staleness)
        metrics.log("async", step=self.flight.queue.completed, wall_seconds=wall, tasks=self.flight.queue.completed,
                    inner_steps=self.flight.queue.steps_done, requeues=self.flight.requeues, staleness=summary,
                    worker_speeds=self.speeds)
        echo(f"[train] {self.flight.queue.completed} tasks, {self.flight.queue.steps_done} inner steps in {wall:.1f}s; "
             f"staleness mean {summary['mean']:.2f} max {summary['max']}; {self.flight.requeues} re-queued")

    def state_dict(self) -> dict:  # the stopped tasks' base modules are the sync component's TASK_BASE part
        paused = {p: {k: v for k, v in task.items() if k != "base"} for p, task in self.paused.items()}
        return {"queue": self.flight.queue.state(), "executors": self.counters, "paused": paused}

    def load_state_dict(self, state: dict) -> None:
        self.queue_state, self.counters = state["queue"], state["executors"]
        bases = self.sync.parts.get(TASK_BASE, {})  # the sync component is restored first
        self.paused = {int(p): {**task, "base": [bases[f"{p}/{self.names[m]}"] for m in self.topology.path_modules(int(p))]}
                       for p, task in state.get("paused", {}).items()}

    def close(self) -> None:
        flight = self.__dict__.pop("flight", None)  # None: run() never started, or closed already
        for actor in (*flight.workers, *flight.actors) if flight else ():
            self.ray.kill(actor, no_restart=True)
        if flight is not None and flight.started_ray:
            self.ray.shutdown()


def worker_speeds(ray: RayConfig, num_paths: int) -> list[float]:
    return list(ray.simulate_speeds) if ray.simulate_speeds else [1.0] * (ray.num_workers or num_paths)


def executor_groups(num_modules: int, executors: int | None) -> list[list[int]]:
    """Modules dealt round-robin to ``executors`` actors (None: one actor per module)."""
    count = num_modules if executors is None else min(executors, num_modules)
    return [list(range(g, num_modules, count)) for g in range(count)]


def check_ray(ray: RayConfig, train: TrainConfig, outer: OuterConfig, dist: DistConfig, async_syncs: Sequence[str],
              eval_every: int = 0) -> None:
    """``train.driver``, ``outer.sync`` and the ``ray`` keys fit together (``async_syncs``: the algorithms
    without rounds); the staleness bound is checked against the topology by the scheduler."""
    is_async = outer.sync in async_syncs
    if train.driver == "ray" and not is_async:
        raise ConfigError(f"train.driver: ray runs outer.sync={', '.join(async_syncs)} "
                          f"(ray.schedule=rounds for lock-step rounds), got outer.sync={outer.sync!r}")
    if is_async and train.driver != "ray":
        raise ConfigError(f"outer.sync: {outer.sync} has no rounds to run under torchrun; set train.driver=ray")
    for key, least in (("num_cpus", 1), ("num_workers", 1), ("executors", 1), ("checkpoint_every", 1),
                       ("executor_checkpoint_every", 1), ("max_staleness", 0), ("task_retries", 0),
                       ("state_sync_every", 1)):
        value, nullable = getattr(ray, key), getattr(RayConfig(), key) is None
        if value is not None and value < least:
            raise ConfigError(f"ray.{key}: must be {'> 0' if least else '>= 0'}{' or null' if nullable else ''}, "
                              f"got {value}")
    if ray.worker_cpus is not None and not (math.isfinite(ray.worker_cpus) and ray.worker_cpus > 0):
        raise ConfigError(f"ray.worker_cpus: must be > 0 or null, got {ray.worker_cpus}")
    speeds = ray.simulate_speeds
    if speeds is not None:
        if not speeds:
            raise ConfigError("ray.simulate_speeds: must list one speed per worker, or be null")
        for i, v in enumerate(speeds):
            if not (math.isfinite(v) and 0 < v <= 1):
                raise ConfigError(f"ray.simulate_speeds[{i}]: must be in (0, 1] (1 = full speed), got {v}")
        if ray.num_workers is not None and ray.num_workers != len(speeds):
            raise ConfigError(f"ray.simulate_speeds: {len(speeds)} speeds for ray.num_workers={ray.num_workers} workers")
    if train.dynamic_local_steps and train.driver != "ray":
        raise ConfigError("train.dynamic_local_steps: needs train.driver=ray (lock-step rounds give every path "
                          "train.inner_steps)")
    if train.driver == "ray":
        used = {"train.early_stopping_holdout": (train.early_stopping_holdout, 0.0), "outer.drop_prob": (outer.drop_prob, 0.0),
                "dist.comm_dtype": (dist.comm_dtype, "fp32"), "outer.nesterov": (outer.nesterov, True),
                "eval.every": (eval_every, 0)}
        for key, (value, default) in used.items():
            if value != default:
                raise ConfigError(f"{key}: {value!r} is not supported by train.driver=ray "
                                  f"(async_nesterov sends fp32 deltas to Nesterov executors); use its default")
