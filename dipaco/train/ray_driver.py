"""`dipaco train train.driver=ray`: asynchronous DiPaCo on Ray, the paper's infrastructure.

DiPaCo (Douillard et al., arXiv 2403.10616) does not train in lock-step rounds: a queue holds path
tasks, preemptible workers take one, run the path's inner steps and hand back its change, and one
outer executor per module applies the changes of the paths through it as they arrive; a path's next
task starts as soon as its modules took its update, and a preempted task goes back to the queue.

Ray is the engine (no home-made queue or RPC):

* **workers** (:class:`PathWorker`, Ray actors, restarted by Ray when they die) run a task: they
  compose the path from the module tensors they are given, run :class:`~dipaco.train.inner.InnerLoop`
  for the task's steps (``ray.simulate_speeds`` makes a worker sleep in proportion, to emulate slow
  hardware on one machine) and return the path's AdamW state and one delta per module;
* **executors** (:class:`ModuleExecutor`, Ray actors, one per module) hold the module's fp32
  parameters and its :class:`~dipaco.sync.async_nesterov.AsyncNesterov` state, apply every arriving
  delta, log it with its staleness, and checkpoint themselves (every ``ray.executor_checkpoint_every``
  updates; a restarted executor resumes from its newest checkpoint);
* **this driver** owns the queue (:class:`TaskQueue`, plain Python), sends each finished task's
  deltas to the executors and writes run checkpoints in the synchronous layout, so ``dipaco eval``,
  ``generate``, ``serve`` and ``export`` read an asynchronous run like any other.

Task results and deltas travel through Ray's object store; the driver owns those objects (they are
return values of its calls), so they outlive a worker that dies. A task whose worker dies is
re-queued with the path's previous AdamW state: only that task's inner steps are lost, and it never
reached an executor. Each executor refuses a task id it has already applied, so a re-sent update
(after an executor restart) is applied exactly once.

``ray.schedule=rounds`` runs the same tasks in lock-step rounds (task k of every path starts once
every path finished task k-1): with ``outer.nesterov_delay`` at its default the executors then
reproduce per-module DiLoCo (:mod:`dipaco.sync.diloco`), the baseline of ``scripts/bench_async.py``.

Asynchronous runs are not bit-reproducible: the order of arrivals depends on timing. What holds is
checked instead: every update is applied exactly once, none is lost when a worker is killed, and
with ``ray.max_staleness`` S no update is staler than S.

Run checkpoints are ``checkpoints/round_NNNNNN`` with NNNNNN = completed tasks (every
``ray.checkpoint_every``, default the number of paths, and at the end); ``--resume`` continues from
the newest, re-running the tasks that were in flight.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dipaco.checkpoint.store import (
    CheckpointManager,
    load_state,
    load_tensors,
    resolve_checkpoint,
    save_state,
    save_tensors,
    write_training_state,
)
from dipaco.config import Config, save_config, to_yaml
from dipaco.data.prepare import load_prepared
from dipaco.errors import ConfigError, DistributedError
from dipaco.metrics import MetricsLogger, echo
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.topology import Topology
from dipaco.route.shards import check_routing, record_routing
from dipaco.runtime import rng_state, seed_everything
from dipaco.sync.async_nesterov import AsyncNesterov, default_delay, dynamic_local_steps, staleness_summary
from dipaco.sync.deltas import rescale_factor
from dipaco.sync.nesterov import module_outer_lr
from dipaco.train.experiment import CHECKPOINT_FORMAT, Experiment, build_experiment, restore
from dipaco.train.inner import InnerLoop, InnerOptions
from dipaco.train.sampler import ShardSampler

RESTART_BACKOFF_S = 0.5  # wait before re-sending to an actor Ray is restarting
EXECUTORS_DIR = "executors"  # <experiment>/executors/<module name>/round_NNNNNN: each executor's own checkpoints


# --- the queue: which path runs next, on which worker, for how many steps (no Ray here) -------------
@dataclass
class Task:
    path: int
    index: int  # the path's task number (0, 1, ...); with the path, the task's unique id
    steps: int
    worker: int = -1
    start: dict[int, int] = field(default_factory=dict)  # module -> version the task started from
    attempt: int = 0  # re-queues after its worker died
    started: float = 0.0  # time.monotonic() at dispatch

    @property
    def id(self) -> str:
        return f"p{self.path:03d}-t{self.index:04d}"


class TaskQueue:
    """Path tasks for free workers, under a budget of total inner steps.

    ``schedule``: ``async`` hands out the next ready path (ready = its previous task's update reached
    every module); ``rounds`` hands out task k only when every path completed k tasks. With
    ``max_staleness`` S a task is held back while it could make an in-flight task of a shared module
    staler than S: the invariant ``clock_m - start_t + (in-flight tasks on m other than t) <= S`` for
    every in-flight task t on module m holds after every dispatch, so no update is staler than S.
    ``clock_m`` counts the updates sent to m (the executor's version once they are applied).
    """

    def __init__(self, topology: Topology, inner_steps: int, budget: int, schedule: str = "async",
                 max_staleness: int | None = None, dynamic_steps: bool = False, state: dict | None = None) -> None:
        self.topology, self.inner_steps, self.budget = topology, inner_steps, budget
        self.schedule, self.max_staleness, self.dynamic_steps = schedule, max_staleness, dynamic_steps
        state = state or {}
        paths = range(topology.num_paths)
        self.next_index = {p: int(state.get("next_index", {}).get(p, 0)) for p in paths}
        self.steps_done = int(state.get("steps_done", 0))
        self.completed = int(state.get("completed", 0))
        self.clock = {m.id: int(state.get("clock", {}).get(m.id, 0)) for m in topology.modules}
        self.speed: dict[int, float] = {int(w): float(v) for w, v in state.get("speed", {}).items()}
        self.ready: deque[int] = deque(paths)
        self.retry: deque[Task] = deque()
        self.running: dict[str, Task] = {}  # dispatched, update not yet sent
        self.sending: dict[str, Task] = {}  # update sent, not yet applied everywhere
        self.reserved = 0  # steps of running and sending tasks
        self.returned: dict[int, int] = {}  # worker -> tasks it returned in this run

    def state(self) -> dict:
        return {"next_index": dict(self.next_index), "steps_done": self.steps_done, "completed": self.completed,
                "clock": dict(self.clock), "speed": dict(self.speed)}

    @property
    def remaining(self) -> int:
        return self.budget - self.steps_done - self.reserved

    def done(self) -> bool:
        return self.remaining <= 0 and not self.running and not self.sending and not self.retry

    def planned_steps(self, worker: int) -> int:
        if not self.dynamic_steps or worker not in self.speed:
            return self.inner_steps
        return dynamic_local_steps(self.speed[worker], max(self.speed.values()), self.inner_steps)

    def _in_flight(self, module: int) -> list[Task]:
        return [t for t in self.running.values() if module in t.start]

    def admissible(self, path: int) -> bool:
        """Whether a new task of ``path`` keeps every update within the staleness bound."""
        if self.max_staleness is None:
            return True
        for m in self.topology.path_modules(path):
            flying = self._in_flight(m)
            oldest = min((t.start[m] for t in flying), default=self.clock[m])
            if self.clock[m] - oldest + len(flying) > self.max_staleness:
                return False
        return True

    def _round_open(self, path: int) -> bool:
        """rounds: task k of a path starts once every path completed k tasks."""
        return self.schedule != "rounds" or min(self.next_index.values()) >= self.next_index[path]

    def dispatch(self, worker: int) -> Task | None:
        """The next task for ``worker`` (retries first), or None when none may start now."""
        for task in list(self.retry):
            if self.admissible(task.path):
                self.retry.remove(task)
                return self._start(task, worker)
        if self.remaining <= 0:
            return None
        for path in list(self.ready):
            if self._round_open(path) and self.admissible(path):
                self.ready.remove(path)
                task = Task(path, self.next_index[path], min(self.planned_steps(worker), self.remaining))
                self.reserved += task.steps
                return self._start(task, worker)
        return None

    def _start(self, task: Task, worker: int) -> Task:
        task.worker, task.started = worker, time.monotonic()
        task.start = {m: self.clock[m] for m in self.topology.path_modules(task.path)}
        self.running[task.id] = task
        return task

    def failed(self, task: Task, count: bool = True) -> None:
        """The task did not return (its worker died): it goes back to the front of the queue; ``count``:
        whether this counts as one of its attempts."""
        del self.running[task.id]
        task.attempt += int(count)
        self.retry.appendleft(task)

    def sent(self, task: Task, tokens_per_s: float) -> None:
        """The task returned and its deltas were sent to its modules' executors."""
        del self.running[task.id]
        self.sending[task.id] = task
        for m in task.start:
            self.clock[m] += 1
        self.returned[task.worker] = self.returned.get(task.worker, 0) + 1
        if tokens_per_s > 0:
            self.speed[task.worker] = tokens_per_s

    def applied(self, task: Task) -> None:
        """Every module took the task's update: the path may run again."""
        del self.sending[task.id]
        self.reserved -= task.steps
        self.steps_done += task.steps
        self.completed += 1
        self.next_index[task.path] = task.index + 1
        self.ready.append(task.path)


# --- the Ray actors (plain classes: wrapped by ray.remote when the driver starts) ------------------
class PathWorker:
    """Runs path tasks: compose the path, ``steps`` AdamW steps, hand back its AdamW state and deltas."""

    def __init__(self, worker: int, speed: float, cfg: Config, llama_config, topology: Topology,
                 shards: dict[int, torch.Tensor], total_steps: int) -> None:
        torch.set_num_threads(1)  # several workers share the machine's cores
        seed_everything(cfg.run.seed)
        self.worker, self.speed, self.cfg, self.topology = worker, speed, cfg, topology
        self.shards, self.total_steps = shards, total_steps
        self.llama_config = llama_config
        self.models: dict[int, Any] = {}
        template = build_model(llama_config, seed=0)
        self.bank = ModuleBank(topology, template)

    def pid(self) -> int:
        return os.getpid()

    def run(self, path: int, steps: int, inner_state: dict | None, *modules: torch.Tensor) -> tuple:
        """Returns (stats, AdamW/schedule/data state, one delta theta_m - theta_{p,m} per part)."""
        model = self.models.get(path) or build_model(self.llama_config)
        self.models[path] = model
        module_ids = self.topology.path_modules(path)
        with torch.no_grad():
            for m, value in zip(module_ids, modules):
                self.bank.params[m].copy_(value)
        self.bank.load_path(path, model)
        sampler = ShardSampler(self.shards[path], self.cfg.train.optim.batch_size, seed=self.cfg.run.seed * 7919 + path)
        options = InnerOptions.from_config(self.cfg.train, self.cfg.model, torch.device("cpu"), "train")
        loop = InnerLoop(model, sampler, self.cfg.train.optim, self.total_steps, "cpu", options)
        if inner_state is not None:
            loop.load_state_dict(inner_state)
        start = time.perf_counter()
        stats = loop.run(steps, log_every=max(steps, 1))
        if self.speed < 1.0:  # a slower machine: the same work takes 1/speed as long
            time.sleep(stats.seconds * (1.0 / self.speed - 1.0))
        seconds = time.perf_counter() - start
        deltas = [self.bank.params[m] - self.bank.path_vector(model, part) for part, m in zip(self.topology.parts, module_ids)]
        meta = {"loss": stats.loss, "tokens": stats.tokens, "seconds": seconds, "compute_seconds": stats.seconds,
                "tokens_per_s": stats.tokens / seconds if seconds > 0 else 0.0, "lr": stats.lr, "step": loop.step,
                "worker": self.worker}
        return (meta, loop.state_dict(), *deltas)


class ModuleExecutor:
    """The outer executor of a group of modules: their fp32 parameters, delayed-Nesterov state and
    update log (:class:`~dipaco.sync.async_nesterov.AsyncNesterov`).

    It checkpoints itself into ``root`` (atomic, with a manifest, like a run checkpoint) every
    ``every`` updates; constructed again by Ray after a crash, it restores its newest checkpoint.
    ``saved`` (tensors by file stem, counters) starts it from a run checkpoint instead of ``init``.
    """

    def __init__(self, names: dict[int, str], init: dict[int, torch.Tensor], path_weights: dict[int, dict[int, float]],
                 lr: dict[int, float], momentum: float, delay: dict[int, int], root: str, every: int, config_yaml: str,
                 saved: tuple[dict, dict] | None = None) -> None:
        torch.set_num_threads(1)
        self.names, self.every, self.config_yaml = dict(names), every, config_yaml
        self.sync = AsyncNesterov(init, path_weights, lr, momentum, delay)
        self.checkpoints = CheckpointManager(root, keep=2)
        self.restored_from = None
        if self.checkpoints.latest() is not None:
            ckpt = resolve_checkpoint(self.checkpoints)
            stems = ("bank", "outer", "async_outer")
            self.sync.load({s: load_tensors(ckpt / f"{s}.safetensors") for s in stems},
                           load_state(ckpt / "trainer_state.pt")["counters"], self.names)
            self.restored_from = ckpt.name
        else:
            if saved is not None:
                self.sync.load(saved[0], saved[1], self.names)
            self._checkpoint()

    def pid(self) -> int:
        return os.getpid()

    def status(self) -> dict:
        return {"updates": len(self.sync.log), "restored_from": self.restored_from}

    def pull(self, module: int) -> torch.Tensor:
        return self.sync.params[module].clone()

    def push(self, task: str, path: int, module: int, start_version: int, delta: torch.Tensor) -> dict | None:
        """Applies one task's delta to ``module`` (None: that task was already applied to it)."""
        if self.restored_from is not None:
            # Updates applied after the last checkpoint died with the previous actor and are being sent
            # again; a task that pulled them may arrive first, naming a version this actor has not
            # reached yet. Its delta is relative to what it pulled, so it applies as is, at staleness 0.
            start_version = min(start_version, self.sync.version(module))
        update = self.sync.apply(task, path, module, start_version, delta)
        if update is not None and len(self.sync.log) % self.every == 0:
            self._checkpoint()
        return None if update is None else update.__dict__

    def state(self) -> tuple[dict, dict]:
        return self.sync.tensors(self.names), self.sync.counters()

    def log(self) -> list[dict]:
        return self.sync.counters()["log"]

    def _checkpoint(self) -> None:
        def write(root: Path) -> None:
            for stem, tensors in self.sync.tensors(self.names).items():
                save_tensors(tensors, root / f"{stem}.safetensors")
            save_state({"round": len(self.sync.log), "counters": self.sync.counters(), "modules": self.names},
                       root / "trainer_state.pt")
            (root / "config.yaml").write_text(self.config_yaml)

        self.checkpoints.save(len(self.sync.log), write)


def executor_groups(num_modules: int, executors: int | None) -> list[list[int]]:
    """Modules dealt round-robin to ``executors`` actors (None: one actor per module)."""
    count = num_modules if executors is None else min(executors, num_modules)
    return [list(range(g, num_modules, count)) for g in range(count)]


def executor_outer_lr(cfg: Config, topology: Topology, module_id: int) -> float:
    """The module's outer lr on its executor: the lock-step rule (:func:`module_outer_lr`) times
    ``outer.rescale``'s factor for the paths through the module. The synchronous step puts that factor
    on the outer gradient; SGD-Nesterov is linear in its gradient, so on the lr it moves the module the
    same way, and every one of those paths contributes (``outer.drop_prob`` is refused here)."""
    through = len(topology.paths_through(module_id))
    return module_outer_lr(cfg.outer, topology, module_id) * rescale_factor(through, cfg.outer.rescale)


# --- the driver --------------------------------------------------------------------------------
def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError('train.driver: ray needs Ray: pip install "dipaco[ray]"') from None
    return ray


def start_ray(cfg: Config) -> bool:
    """Joins ``ray.address`` or starts an embedded Ray; returns whether this call started it."""
    ray = _ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if cfg.ray.address is None:
        kwargs["num_cpus"] = cfg.ray.num_cpus
    ray.init(address=cfg.ray.address, **kwargs)
    return True


def worker_speeds(cfg: Config, num_paths: int) -> list[float]:
    count = cfg.ray.num_workers or (len(cfg.ray.simulate_speeds) if cfg.ray.simulate_speeds else num_paths)
    return list(cfg.ray.simulate_speeds) if cfg.ray.simulate_speeds else [1.0] * count


def check_staleness_bound(cfg: Config, topology: Topology) -> None:
    """A task always competes with the other paths through its modules: S must allow that."""
    if cfg.ray.max_staleness is None:
        return
    widest = max(len(topology.paths_through(m.id)) for m in topology.modules)
    if cfg.ray.max_staleness < widest - 1:
        raise ConfigError(f"ray.max_staleness: {cfg.ray.max_staleness} is below {widest - 1}, the other paths "
                          f"through the most shared module; raise it or leave it null")


class RayRun:
    """One ``dipaco train`` on Ray: actors, the queue, the event loop and the run checkpoints."""

    def __init__(self, cfg: Config, exp: Experiment, queue: TaskQueue, saved_modules: dict[int, tuple] | None) -> None:
        self.ray = ray = _ray()
        self.cfg, self.exp, self.queue = cfg, exp, queue
        topo = exp.topology
        self.names = {m.id: m.name for m in topo.modules}
        self.parts = len(topo.parts)
        speeds = worker_speeds(cfg, topo.num_paths)
        cpus = ray.cluster_resources().get("CPU", 1.0)
        per_worker = min(1.0, cpus / len(speeds))
        shards = {p: loop.sampler.sequences for p, loop in exp.loops.items()}
        llama = exp.loops[0].model.config
        total_steps = cfg.train.rounds * cfg.train.inner_steps
        worker_cls = ray.remote(PathWorker).options(num_cpus=per_worker, max_restarts=-1, max_task_retries=0)
        self.shards_ref = ray.put(shards)  # held for as long as Ray may restart a worker with it
        self.workers = [worker_cls.remote(w, s, cfg, llama, topo, self.shards_ref, total_steps)
                        for w, s in enumerate(speeds)]
        self.speeds = speeds
        executor_cls = ray.remote(ModuleExecutor).options(num_cpus=0, max_restarts=-1, max_task_retries=0)
        root = exp.dir / EXECUTORS_DIR / f"run_{int(time.time() * 1000)}"
        config_yaml = to_yaml(cfg)
        self.groups = executor_groups(len(topo.modules), cfg.ray.executors)
        self.actors, self.init_refs = [], []  # init_refs: held for as long as Ray may restart an executor
        for g, group in enumerate(self.groups):
            through = {m: topo.paths_through(m) for m in group}
            self.init_refs.append(ray.put({m: exp.bank.params[m].detach().clone() for m in group}))
            self.actors.append(executor_cls.remote(
                {m: self.names[m] for m in group}, self.init_refs[-1],
                {m: {p: exp.weights[p] for p in through[m]} for m in group},
                {m: executor_outer_lr(cfg, topo, m) for m in group}, cfg.outer.momentum,
                {m: default_delay(len(through[m]), cfg.outer.nesterov_delay) for m in group},
                str(root / f"executor_{g:03d}"), cfg.ray.executor_checkpoint_every, config_yaml,
                None if saved_modules is None else self._hold(merge_saved([saved_modules[m] for m in group]))))
        self.executors = {m: self.actors[g] for g, group in enumerate(self.groups) for m in group}
        self.executor_root = root
        ray.get([actor.pid.remote() for actor in (*self.workers, *self.actors)])  # started: the clock starts now
        for old in root.parent.glob("run_*"):  # an earlier run's executors: its checkpoint is the truth now
            if old != root:
                shutil.rmtree(old, ignore_errors=True)
        self.inner: dict[int, Any] = {p: ray.put(loop.state_dict()) for p, loop in exp.loops.items()}
        self.running: dict[Any, tuple[Task, list]] = {}  # first return ref -> task, all its return refs
        self.pushes: dict[Any, tuple[Task, int, Any]] = {}  # push ref -> task, module, delta ref
        self.waiting: dict[str, set[int]] = {}  # task id -> modules whose executor has not acknowledged
        self.results: dict[str, dict] = {}
        self.free: deque[int] = deque(range(len(self.workers)))
        self.requeues = 0
        self.resends: dict[tuple[str, int], int] = {}
        self.probes: dict[Any, int] = {}  # pid() call -> a restarted worker not yet back in the pool
        self.staleness: list[int] = []
        self.checkpoint_due = False
        self.last_checkpoint = queue.completed

    def _hold(self, value):
        """``value`` in the object store, its reference kept so a restarted actor can read it again."""
        self.init_refs.append(self.ray.put(value))
        return self.init_refs[-1]

    # dispatch ---------------------------------------------------------------------------------
    def dispatch(self) -> None:
        for _ in range(len(self.free)):
            worker = self.free[0]
            task = self.queue.dispatch(worker)
            if task is None:
                return
            self.free.popleft()
            modules = [self.executors[m].pull.remote(m) for m in self.exp.topology.path_modules(task.path)]
            refs = self.workers[worker].run.options(num_returns=2 + self.parts).remote(
                task.path, task.steps, self.inner[task.path], *modules)
            self.running[refs[0]] = (task, refs)

    # events ----------------------------------------------------------------------------------
    def on_task(self, ref) -> None:
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
        for m, delta in zip(self.exp.topology.path_modules(task.path), refs[2:]):
            self._push(task, m, delta)

    def _requeue(self, task: Task, exc: Exception) -> None:
        """The task's worker died (killed, preempted, out of memory), or a module executor it pulled from
        was restarting: the task goes back to the queue with the path's previous AdamW state."""
        worker_died = not isinstance(exc, self.ray.exceptions.RayTaskError)
        if worker_died:  # Ray restarts it; it takes tasks again once it answers
            self._probe(task.worker)
        else:
            self.free.append(task.worker)
        never_ran = isinstance(exc, self.ray.exceptions.ActorUnavailableError)  # sent while it was restarting
        if worker_died and not never_ran and task.attempt >= self.cfg.ray.task_retries:
            raise DistributedError(f"task {task.id} lost its worker {task.attempt + 1} times "
                                   f"(ray.task_retries={self.cfg.ray.task_retries}): {type(exc).__name__}") from None
        if not worker_died:
            self.resends[(task.id, -1)] = stalls = self.resends.get((task.id, -1), 0) + 1
            if stalls * RESTART_BACKOFF_S > self.cfg.dist.timeout_s:
                raise DistributedError(f"task {task.id} could not read its modules for dist.timeout_s="
                                       f"{self.cfg.dist.timeout_s}s: {exc}") from None
        self.queue.failed(task, count=worker_died and not never_ran)
        self.requeues += 1
        why = f"worker {task.worker} died" if worker_died else "a module executor was restarting"
        echo(f"[train] {why} during {task.id}: re-queued")
        self.metrics.log("requeue", task=task.id, path=task.path, worker=task.worker, attempt=task.attempt,
                         reason="worker" if worker_died else "executor")
        if not worker_died:
            time.sleep(RESTART_BACKOFF_S)

    def _probe(self, worker: int) -> None:
        self.probes[self.workers[worker].pid.remote()] = worker

    def on_probe(self, ref) -> None:
        worker = self.probes.pop(ref)
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayError:
            time.sleep(RESTART_BACKOFF_S)
            self._probe(worker)
            return
        self.free.append(worker)

    def _push(self, task: Task, module: int, delta) -> None:
        ref = self.executors[module].push.remote(task.id, task.path, module, task.start[module], delta)
        self.pushes[ref] = (task, module, delta)

    def on_push(self, ref) -> None:
        ray = self.ray
        task, module, delta = self.pushes.pop(ref)
        try:
            update = ray.get(ref)
        except ray.exceptions.RayTaskError:
            raise
        except ray.exceptions.RayError as exc:  # the executor died: it restarts from its checkpoint; send again
            self.resends[(task.id, module)] = tries = self.resends.get((task.id, module), 0) + 1
            if tries * RESTART_BACKOFF_S > self.cfg.dist.timeout_s:
                raise DistributedError(f"the executor of {self.names[module]} did not come back within "
                                       f"dist.timeout_s={self.cfg.dist.timeout_s}s: {exc}") from None
            echo(f"[train] executor of {self.names[module]} unavailable for {task.id}: sending the update again")
            time.sleep(RESTART_BACKOFF_S)
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
        self.metrics.log("task", step=self.queue.completed, task=task.id, path=task.path, worker=task.worker,
                         steps=task.steps, attempt=task.attempt, loss=result["loss"], tokens=result["tokens"],
                         seconds=result["seconds"], compute_seconds=result["compute_seconds"],
                         tokens_per_s=result["tokens_per_s"], lr=result["lr"],
                         staleness=result.get("staleness", {}), steps_done=self.queue.steps_done,
                         elapsed=time.perf_counter() - self.start)
        every = self.cfg.ray.checkpoint_every or self.exp.topology.num_paths
        if self.queue.completed % every == 0:
            self.checkpoint_due = True  # written by the event loop, once this event is handled

    def run(self, metrics: MetricsLogger) -> None:
        ray, self.metrics, self.start = self.ray, metrics, time.perf_counter()
        while not self.queue.done():
            self.dispatch()
            pending = [*self.running, *self.pushes, *self.probes]
            if not pending:
                raise DistributedError(f"no task can start and none is running ({self.queue.remaining} inner steps "
                                       f"left); ray.max_staleness may be too small")
            ready, _ = ray.wait(pending, num_returns=1)
            for ref in ready:
                if ref in self.running:
                    self.on_task(ref)
                elif ref in self.pushes:
                    self.on_push(ref)
                else:
                    self.on_probe(ref)
            if self.checkpoint_due:
                self.checkpoint()
        wall = time.perf_counter() - self.start
        if self.last_checkpoint != self.queue.completed:
            self.checkpoint()
        summary = staleness_summary(self.staleness)
        metrics.log("async", step=self.queue.completed, wall_seconds=wall, tasks=self.queue.completed,
                    inner_steps=self.queue.steps_done, requeues=self.requeues, staleness=summary,
                    worker_speeds=self.speeds)
        echo(f"[train] {self.queue.completed} tasks, {self.queue.steps_done} inner steps in {wall:.1f}s; "
             f"staleness mean {summary['mean']:.2f} max {summary['max']}; {self.requeues} re-queued")

    # checkpoints -------------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """A run checkpoint of the completed tasks: every sent update is applied first, so the bank, the
        outer state and the paths' AdamW states agree (tasks still computing are re-run on resume)."""
        ray, exp = self.ray, self.exp
        while self.pushes:
            ready, _ = ray.wait(list(self.pushes), num_returns=1)
            self.on_push(ready[0])
        states = self._executor_states()
        inner = dict(zip(self.inner, ray.get(list(self.inner.values()))))
        sync_state: dict[str, dict[str, torch.Tensor]] = {"outer": {}, "async_outer": {}}
        counters = {}
        with torch.no_grad():
            for group, (tensors, counter) in zip(self.groups, states):
                for m in group:
                    name = self.names[m]
                    exp.bank.params[m].copy_(tensors["bank"][name])
                    sync_state["outer"][name] = tensors["outer"][name]
                    sync_state["async_outer"][name] = tensors["async_outer"][name]
                    counters[name] = {"pending": counter["pending"][m],
                                      "log": [u for u in counter["log"] if u["module"] == m]}
        for p, loop in exp.loops.items():
            loop.load_state_dict(inner[p])
            exp.bank.load_path(p, loop.model)
        index = self.queue.completed
        extra = {"format": CHECKPOINT_FORMAT, "world_size": 1, "paths_by_rank": [list(ps) for ps in exp.by_rank],
                 "driver": "ray", "queue": self.queue.state(), "executors": counters}
        ckpt = exp.checkpoints.save(index, lambda d: write_training_state(
            d, index, exp.bank, exp.loops, rng_state(), to_yaml(self.cfg), sync_state=sync_state, extra=extra))
        self.checkpoint_due, self.last_checkpoint = False, index
        self.metrics.log("checkpoint", step=index, tasks=index, inner_steps=self.queue.steps_done,
                         elapsed=time.perf_counter() - self.start, checkpoint=ckpt.name)
        return ckpt

    def _executor_states(self) -> list[tuple[dict, dict]]:
        """Every executor's tensors and counters. One that Ray is restarting restores its own checkpoint,
        which holds every update it acknowledged (ray.executor_checkpoint_every=1), so it is asked again."""
        ray = self.ray
        states: dict[int, tuple[dict, dict]] = {}
        tries = 0
        while len(states) < len(self.actors):
            asked = {g: actor.state.remote() for g, actor in enumerate(self.actors) if g not in states}
            for g, ref in asked.items():
                try:
                    states[g] = ray.get(ref)
                except ray.exceptions.RayTaskError:
                    raise
                except ray.exceptions.RayError as exc:
                    tries += 1
                    if tries * RESTART_BACKOFF_S > self.cfg.dist.timeout_s:
                        raise DistributedError(f"executor {g} did not come back within "
                                               f"dist.timeout_s={self.cfg.dist.timeout_s}s: {exc}") from None
                    echo(f"[train] executor {g} unavailable for the run checkpoint: asking again")
                    time.sleep(RESTART_BACKOFF_S)
        return [states[g] for g in range(len(self.actors))]

    def close(self) -> None:
        for actor in (*self.workers, *self.actors):
            self.ray.kill(actor, no_restart=True)


def _restore_async(exp: Experiment, resume_from: str | None) -> tuple[dict, dict[int, tuple]]:
    """The queue state and every executor's saved state from the newest (or given) run checkpoint."""
    completed, ckpt = restore(exp, resume_from)  # config check, bank, paths' AdamW states
    state = load_state(ckpt / "trainer_state.pt")
    if state.get("driver") != "ray":
        raise ConfigError(f"{ckpt}: written by train.driver=torchrun; an asynchronous run cannot continue it")
    tensors = {stem: load_tensors(ckpt / f"{stem}.safetensors") for stem in ("outer", "async_outer")}
    bank = {m: exp.bank.params[m].detach().clone() for m in range(len(exp.topology.modules))}
    saved = {}
    for module in exp.topology.modules:
        name, counters = module.name, state["executors"][module.name]
        saved[module.id] = ({"bank": {name: bank[module.id]}, "outer": {name: tensors["outer"][name]},
                             "async_outer": {name: tensors["async_outer"][name]}},
                            {"pending": {module.id: counters["pending"]}, "log": counters["log"]})
    return state["queue"], saved


def merge_saved(parts: Sequence[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The saved states of single modules as one executor group's."""
    tensors: dict[str, dict] = {}
    counters: dict[str, Any] = {"pending": {}, "log": []}
    for part_tensors, part_counters in parts:
        for stem, named in part_tensors.items():
            tensors.setdefault(stem, {}).update(named)
        counters["pending"].update(part_counters["pending"])
        counters["log"].extend(part_counters["log"])
    return tensors, counters


def train_ray(cfg: Config, resume: bool = False, resume_from: str | None = None, until_round: int | None = None,
              on_start: Callable[[RayRun], None] | None = None) -> Experiment:
    """Trains asynchronously on Ray (train.driver=ray). ``until_round`` N stops once N rounds' worth of
    inner steps (N x inner_steps x paths) are done; ``on_start`` is called with the :class:`RayRun`
    before its first task (fault drills kill its actors from another thread)."""
    seed_everything(cfg.run.seed)
    exp = build_experiment(cfg, load_prepared(cfg))
    topo = exp.topology
    check_staleness_bound(cfg, topo)
    queue_state, saved = None, None
    latest = exp.checkpoints.latest()
    if resume or resume_from:
        check_routing(cfg, exp.dir)
        queue_state, saved = _restore_async(exp, resume_from)
    elif latest is not None:
        raise ConfigError(f"{exp.dir} already has checkpoints; pass --resume to continue it, "
                          f"or choose another train.name to start a new experiment")
    save_config(cfg, exp.dir / "config.yaml")
    record_routing(cfg, exp.dir)
    per_round = cfg.train.inner_steps * topo.num_paths
    rounds = cfg.train.rounds if until_round is None else min(until_round, cfg.train.rounds)
    queue = TaskQueue(topo, cfg.train.inner_steps, rounds * per_round, cfg.ray.schedule, cfg.ray.max_staleness,
                      cfg.train.dynamic_local_steps, queue_state)
    started = start_ray(cfg)
    ray = _ray()
    metrics = MetricsLogger(exp.dir)
    run = None
    try:
        run = RayRun(cfg, exp, queue, saved)
        echo(f"[train] {cfg.train.name} on Ray: {topo.describe()}; {len(run.workers)} workers "
             f"(speeds {run.speeds}), {len(run.actors)} executors for {len(run.executors)} modules; {queue.budget - queue.steps_done} "
             f"inner steps to go ({cfg.ray.schedule}, outer.sync={cfg.outer.sync})")
        if on_start is not None:
            on_start(run)
        run.run(metrics)
    finally:
        metrics.close()
        if run is not None:
            run.close()
        if started:
            ray.shutdown()
    return exp


def executor_log_files(exp_dir: Path) -> dict[str, list[dict]]:
    """Every module's update log from its executor's newest checkpoint, for the newest run on Ray."""
    runs = sorted((exp_dir / EXECUTORS_DIR).glob("run_*"))
    if not runs:
        return {}
    logs: dict[str, list[dict]] = {}
    for group_dir in sorted(p for p in runs[-1].iterdir() if p.is_dir()):
        state = load_state(resolve_checkpoint(CheckpointManager(group_dir)) / "trainer_state.pt")
        for update in state["counters"]["log"]:
            logs.setdefault(state["modules"][update["module"]], []).append(update)
    return logs


def count_applied(logs: dict[str, Sequence[dict]]) -> dict[tuple[str, str], int]:
    """(module, task id) -> times applied, from executor update logs."""
    counts: dict[tuple[str, str], int] = {}
    for module, log in logs.items():
        for update in log:
            key = (module, update["task"])
            counts[key] = counts.get(key, 0) + 1
    return counts
