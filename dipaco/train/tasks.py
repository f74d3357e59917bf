"""The task scheduler: asynchronous DiPaCo on Ray, the paper's infrastructure (``train.driver=ray``).

DiPaCo (Douillard et al., arXiv 2403.10616) does not train in lock-step rounds: a queue holds path
tasks, preemptible workers take one, run the path's inner steps and hand back its change, and one
outer executor per module applies the changes of the paths through it as they arrive; a path's next
task starts as soon as its modules took its update, and a preempted task goes back to the queue.

Ray is the engine (no home-made queue or RPC): :class:`PathWorker` actors run tasks (on a GPU when
the node has one), :class:`ModuleExecutor` actors hold each module's
:class:`~dipaco.sync.async_nesterov.AsyncNesterov` (the lock-step outer step under a delayed-Nesterov
schedule) and checkpoint themselves, and Ray restarts either when it dies. The queue
(:class:`~dipaco.train.task_queue.TaskQueue`) is plain Python. Task results and deltas travel through
Ray's object store; the scheduler owns those objects, so they outlive a worker that dies. A task whose
worker dies is re-queued with the path's previous AdamW state: only its inner steps are lost. Each
executor refuses a task id it has already applied, so a re-sent update is applied exactly once.

Everything else is the trainer's (:mod:`dipaco.train.trainer`): at every ``ray.checkpoint_every``
completed tasks the scheduler waits until every sent update is applied, gathers the executors' state
into the bank and its sync component, and yields; the trainer writes the checkpoint in the one format
and logs the tasks. ``ray.schedule=rounds`` runs the same tasks in lock-step rounds and reproduces
per-module DiLoCo (:mod:`dipaco.sync.diloco`). Asynchronous runs are not bit-reproducible (arrivals
depend on timing); what holds is checked: every update is applied exactly once, none is lost when a
worker is killed, and with ``ray.max_staleness`` S no update is staler than S.
"""

from __future__ import annotations

import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dipaco.config import OuterConfig, RayConfig
from dipaco.errors import ConfigError, DistributedError
from dipaco.metrics import MetricsLogger, echo
from dipaco.sync.async_nesterov import PARAMS, default_delay, staleness_summary
from dipaco.sync.nesterov import module_outer_lr
from dipaco.train.experiment import BuiltExperiment
from dipaco.train.task_actors import (
    EXECUTORS_DIR,
    SYNC_PARTS,
    ExecutorCheckpoints,
    ExecutorModules,
    ExecutorState,
    ModuleExecutor,
    PathWorker,
)
from dipaco.train.task_queue import Task, TaskQueue, check_staleness_bound, executor_groups, worker_speeds
from dipaco.train.trainer import Progress

RESTART_BACKOFF_S = 0.5  # wait before asking an actor Ray is restarting again


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError('train.driver: ray needs Ray: pip install "dipaco[ray]"') from None
    return ray


class TaskScheduler:
    """Path tasks on Ray workers, one outer executor per module (see the module docstring)."""

    driver = "ray"

    def __init__(self, experiment: BuiltExperiment, ray: RayConfig, outer: OuterConfig, timeout_s: float,
                 dynamic_steps: bool = False, on_start: Callable[[TaskScheduler], None] | None = None) -> None:
        """``dynamic_steps``: train.dynamic_local_steps; ``timeout_s``: dist.timeout_s, for an actor Ray restarts."""
        topology = experiment.topology
        check_staleness_bound(ray.max_staleness, topology)
        self.experiment, self.ray_cfg, self.outer, self.timeout_s, self.on_start = experiment, ray, outer, timeout_s, on_start
        self.topology, self.bank, self.loops, self.weights = topology, experiment.bank, experiment.loops, experiment.weights
        self.dynamic_steps = dynamic_steps
        self.names = {m.id: m.name for m in topology.modules}
        self.sync = ExecutorState(list(self.names.values()))
        self.speeds = worker_speeds(ray, topology.num_paths)
        self.groups = executor_groups(len(topology.modules), ray.executors)
        self.queue_state: dict | None = None
        self.counters: dict[str, dict] | None = None  # each module's executor counters, as of the last checkpoint
        self.ray: Any = None
        self.workers: list = []
        self.actors: list = []

    def describe(self) -> str:
        return (f"on Ray: {len(self.speeds)} workers (speeds {self.speeds}), {len(self.groups)} executors for "
                f"{len(self.names)} modules ({self.ray_cfg.schedule}, outer.sync={self.outer.sync})")

    # --- start --------------------------------------------------------------------------------------
    def run(self, start: int, until_round: int) -> Iterator[Progress]:
        """The tasks of ``until_round`` rounds' worth of inner steps, from the queue state restored; yields
        every ``ray.checkpoint_every`` completed tasks and at the end."""
        inner_steps = self.experiment.inner_steps
        per_round = inner_steps * self.topology.num_paths
        self.queue = TaskQueue(self.topology, inner_steps, until_round * per_round, self.ray_cfg.schedule,
                               self.ray_cfg.max_staleness, self.dynamic_steps, self.queue_state)
        self.ray = ray = _ray()
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=self.ray_cfg.address, include_dashboard=False, log_to_driver=False,
                     **({"num_cpus": self.ray_cfg.num_cpus} if self.ray_cfg.address is None else {}))
        self._start_actors()
        echo(f"[train] {self.queue.budget - self.queue.steps_done} inner steps to go")
        if self.on_start is not None:
            self.on_start(self)
        yield from self._events()

    def _start_actors(self) -> None:
        ray, topo = self.ray, self.topology
        resources = ray.cluster_resources()
        share = {"num_cpus": min(1.0, resources.get("CPU", 1.0) / len(self.speeds))}
        if resources.get("GPU", 0) > 0:  # the workers train on the node's GPUs, as lock-step ranks do
            share["num_gpus"] = min(1.0, resources["GPU"] / len(self.speeds))
        worker_cls = ray.remote(PathWorker).options(**share, max_restarts=-1, max_task_retries=0)
        self.loops_ref = ray.put(self.experiment.path_loops)  # every shard, once in the object store
        llama = next(iter(self.loops.values())).model.config
        self.workers = [worker_cls.remote(w, s, self.loops_ref, llama, topo) for w, s in enumerate(self.speeds)]
        executor_cls = ray.remote(ModuleExecutor).options(num_cpus=0, max_restarts=-1, max_task_retries=0)
        root = self.experiment.dir / EXECUTORS_DIR / f"run_{int(time.time() * 1000)}"
        self.held_refs: list = []  # the objects Ray may hand a restarted actor again
        for g, group in enumerate(self.groups):
            through = {m: topo.paths_through(m) for m in group}
            modules = ExecutorModules(
                names={m: self.names[m] for m in group},
                path_weights={m: {p: self.weights[p] for p in through[m]} for m in group},
                lr={m: module_outer_lr(self.outer, topo, m) for m in group}, momentum=self.outer.momentum,
                delay={m: default_delay(len(through[m]), self.outer.nesterov_delay) for m in group},
                rescale=self.outer.rescale)
            checkpoints = ExecutorCheckpoints(str(root / f"executor_{g:03d}"), self.ray_cfg.executor_checkpoint_every,
                                              self.experiment.config_yaml)
            init = self._hold({m: self.bank.params[m].detach().clone() for m in group})
            saved = None if self.counters is None else self._hold(self._saved(group))
            self.actors.append(executor_cls.remote(modules, checkpoints, init, saved))
        self.executors = {m: self.actors[g] for g, group in enumerate(self.groups) for m in group}
        ray.get([actor.pid.remote() for actor in (*self.workers, *self.actors)])  # started: the clock starts now
        for old in root.parent.glob("run_*"):  # an earlier run's executors: its checkpoint is the truth now
            if old != root:
                shutil.rmtree(old, ignore_errors=True)
        self.inner: dict[int, Any] = {p: ray.put(loop.state_dict()) for p, loop in self.loops.items()}
        self.running: dict[Any, tuple[Task, list]] = {}  # first return ref -> task, all its return refs
        self.pushes: dict[Any, tuple[Task, int, Any]] = {}  # push ref -> task, module, delta ref
        self.probes: dict[Any, int] = {}  # pid() call -> a restarted worker not yet back in the pool
        self.waiting: dict[str, set[int]] = {}  # task id -> modules whose executor has not acknowledged
        self.results: dict[str, dict] = {}
        self.free: deque[int] = deque(range(len(self.workers)))
        self.tries: dict[Any, int] = {}
        self.records: list[tuple[str, int | None, dict]] = []  # to log once checkpointed
        self.staleness: list[int] = []
        self.requeues, self.start, self.checkpoint_due = 0, time.perf_counter(), False
        self.last_checkpoint = self.queue.completed

    def _hold(self, value: Any) -> Any:
        """``value`` in the object store, its reference kept so a restarted actor can read it again."""
        self.held_refs.append(self.ray.put(value))
        return self.held_refs[-1]

    def _saved(self, group: list[int]) -> tuple[dict, dict]:
        """A group's executor state from the restored run checkpoint (tensors by part, counters)."""
        assert self.counters is not None
        tensors = {PARAMS: {self.names[m]: self.bank.params[m].detach().clone() for m in group}}
        for part, named in self.sync.parts.items():
            tensors[part] = {self.names[m]: named[self.names[m]] for m in group}
        counters: dict[str, Any] = {"pending": {}, "log": []}
        for m in group:
            counters["pending"][m] = self.counters[self.names[m]]["pending"]
            counters["log"].extend(self.counters[self.names[m]]["log"])
        return tensors, counters

    def _patience(self, key: Any, what: str, exc: Exception) -> None:
        """One more try of ``key`` at an actor Ray is restarting; fails once the tries add up to dist.timeout_s."""
        self.tries[key] = tries = self.tries.get(key, 0) + 1
        if tries * RESTART_BACKOFF_S > self.timeout_s:
            raise DistributedError(f"{what} did not come back within dist.timeout_s={self.timeout_s}s: {exc}") from None
        time.sleep(RESTART_BACKOFF_S)

    # --- events -------------------------------------------------------------------------------------
    def _events(self) -> Iterator[Progress]:
        while not self.queue.done():
            self._dispatch()
            pending = [*self.running, *self.pushes, *self.probes]
            if not pending:
                raise DistributedError(f"no task can start and none is running ({self.queue.remaining} inner steps "
                                       f"left); ray.max_staleness may be too small")
            for ref in self.ray.wait(pending, num_returns=1)[0]:
                handler = self._on_task if ref in self.running else self._on_push if ref in self.pushes else self._on_probe
                handler(ref)
            if self.checkpoint_due:
                yield self.checkpoint()
        if self.last_checkpoint != self.queue.completed:
            yield self.checkpoint()

    def _dispatch(self) -> None:
        for _ in range(len(self.free)):
            task = self.queue.dispatch(self.free[0])
            if task is None:
                return
            worker = self.free.popleft()
            modules = [self.executors[m].pull.remote(m) for m in self.topology.path_modules(task.path)]
            refs = self.workers[worker].run.options(num_returns=2 + len(self.topology.parts)).remote(
                task.path, task.steps, self.inner[task.path], *modules)
            self.running[refs[0]] = (task, refs)

    def _on_task(self, ref: Any) -> None:
        ray = self.ray
        task, refs = self.running.pop(ref)
        try:
            meta = ray.get(ref)
        except ray.exceptions.RayError as exc:
            if isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(exc.cause, ray.exceptions.RayError):
                raise  # the task itself failed (a bug or bad data): not something a retry heals
            self._requeue(task, exc)
            return
        self.free.append(task.worker)
        self.results[task.id] = {**meta, "inner": refs[1]}
        self.queue.sent(task, meta["tokens_per_s"])
        self.waiting[task.id] = set(task.start)
        for m, delta in zip(self.topology.path_modules(task.path), refs[2:]):
            self._push(task, m, delta)

    def _requeue(self, task: Task, exc: Exception) -> None:
        """The task's worker died (killed, preempted, out of memory), or a module executor it pulled from
        was restarting: the task goes back to the queue with the path's previous AdamW state."""
        worker_died = not isinstance(exc, self.ray.exceptions.RayTaskError)
        never_ran = isinstance(exc, self.ray.exceptions.ActorUnavailableError)  # sent while it was restarting
        if worker_died:  # Ray restarts it; it takes tasks again once it answers
            self.probes[self.workers[task.worker].pid.remote()] = task.worker
            if not never_ran and task.attempt >= self.ray_cfg.task_retries:
                raise DistributedError(f"task {task.id} lost its worker {task.attempt + 1} times "
                                       f"(ray.task_retries={self.ray_cfg.task_retries}): {type(exc).__name__}") from None
        else:
            self.free.append(task.worker)
        self.queue.failed(task, count=worker_died and not never_ran)
        self.requeues += 1
        why = f"worker {task.worker} died" if worker_died else "a module executor was restarting"
        echo(f"[train] {why} during {task.id}: re-queued")
        self.records.append(("requeue", None, {"task": task.id, "path": task.path, "worker": task.worker,
                                               "attempt": task.attempt, "reason": "worker" if worker_died else "executor"}))
        if not worker_died:
            self._patience((task.id, -1), f"the modules of task {task.id}", exc)

    def _on_probe(self, ref: Any) -> None:
        worker = self.probes.pop(ref)
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayError:
            time.sleep(RESTART_BACKOFF_S)
            self.probes[self.workers[worker].pid.remote()] = worker
            return
        self.free.append(worker)

    def _push(self, task: Task, module: int, delta: Any) -> None:
        ref = self.executors[module].push.remote(task.id, task.path, module, task.start[module], delta)
        self.pushes[ref] = (task, module, delta)

    def _on_push(self, ref: Any) -> None:
        ray = self.ray
        task, module, delta = self.pushes.pop(ref)
        try:
            update = ray.get(ref)
        except ray.exceptions.RayTaskError:
            raise
        except ray.exceptions.RayError as exc:  # the executor died: it restarts from its checkpoint; send again
            echo(f"[train] executor of {self.names[module]} unavailable for {task.id}: sending the update again")
            self._patience((task.id, module), f"the executor of {self.names[module]}", exc)
            self._push(task, module, delta)
            return
        if update is not None:
            self.staleness.append(update["staleness"])
            self.results[task.id].setdefault("staleness", {})[self.names[module]] = update["staleness"]
        self.waiting[task.id].discard(module)
        if not self.waiting[task.id]:
            del self.waiting[task.id]
            self._complete(task)

    def _complete(self, task: Task) -> None:
        result = self.results.pop(task.id)
        self.inner[task.path] = result.pop("inner")
        self.queue.applied(task)
        self.records.append(("task", self.queue.completed, {
            "task": task.id, "path": task.path, "worker": task.worker, "steps": task.steps, "attempt": task.attempt,
            **{k: result[k] for k in ("loss", "tokens", "seconds", "compute_seconds", "tokens_per_s", "lr")},
            "staleness": result.get("staleness", {}), "steps_done": self.queue.steps_done,
            "elapsed": time.perf_counter() - self.start}))
        every = self.ray_cfg.checkpoint_every or self.topology.num_paths
        self.checkpoint_due = self.checkpoint_due or self.queue.completed % every == 0

    # --- checkpoints ------------------------------------------------------------------------------
    def checkpoint(self) -> Progress:
        """The completed tasks' state in the bank, the paths and the sync component: every sent update is
        applied first, so they agree (tasks still computing are re-run on resume)."""
        while self.pushes:
            self._on_push(self.ray.wait(list(self.pushes), num_returns=1)[0][0])
        states = self._executor_states()
        inner = dict(zip(self.inner, self.ray.get(list(self.inner.values()))))
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
        for p, loop in self.loops.items():
            loop.load_state_dict(inner[p])
            self.bank.load_path(p, loop.model)
        self.checkpoint_due, self.last_checkpoint = False, self.queue.completed
        records, self.records = self.records, []
        info = {"tasks": self.queue.completed, "inner_steps": self.queue.steps_done,
                "elapsed": time.perf_counter() - self.start}
        return Progress(self.queue.completed, records, info)

    def _executor_states(self) -> list[tuple[dict, dict]]:
        """Every executor's tensors and counters. One that Ray is restarting restores its own checkpoint,
        which holds every update it acknowledged (ray.executor_checkpoint_every=1), so it is asked again."""
        states: dict[int, tuple[dict, dict]] = {}
        while len(states) < len(self.actors):
            for g in [g for g in range(len(self.actors)) if g not in states]:
                try:
                    states[g] = self.ray.get(self.actors[g].state.remote())
                except self.ray.exceptions.RayTaskError:
                    raise
                except self.ray.exceptions.RayError as exc:
                    echo(f"[train] executor {g} unavailable for the run checkpoint: asking again")
                    self._patience(("state", g), f"executor {g}", exc)
        return [states[g] for g in range(len(self.actors))]

    def logged(self, records: list[dict], index: int) -> bool:
        return any(r["event"] == "checkpoint" and r.get("step") == index for r in records)

    def log(self, metrics: MetricsLogger, index: int, reports: list, info: dict, checkpoint_name: str) -> None:
        """The completed tasks (and re-queues) since the last checkpoint, then the checkpoint: one append."""
        with metrics.together():
            for event, step, values in reports:
                metrics.log(event, step=step, **values)
            metrics.log("checkpoint", step=index, checkpoint=checkpoint_name, **info)

    def summary(self, metrics: MetricsLogger) -> None:
        wall, summary = time.perf_counter() - self.start, staleness_summary(self.staleness)
        metrics.log("async", step=self.queue.completed, wall_seconds=wall, tasks=self.queue.completed,
                    inner_steps=self.queue.steps_done, requeues=self.requeues, staleness=summary,
                    worker_speeds=self.speeds)
        echo(f"[train] {self.queue.completed} tasks, {self.queue.steps_done} inner steps in {wall:.1f}s; "
             f"staleness mean {summary['mean']:.2f} max {summary['max']}; {self.requeues} re-queued")

    def state_dict(self) -> dict:
        return {"queue": self.queue.state(), "executors": self.counters}

    def load_state_dict(self, state: dict) -> None:
        self.queue_state, self.counters = state["queue"], state["executors"]

    def close(self) -> None:
        for actor in (*self.workers, *self.actors):
            self.ray.kill(actor, no_restart=True)
        self.workers, self.actors = [], []
        if self.ray is not None and self.started_ray:
            self.ray.shutdown()

