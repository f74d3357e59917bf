"""The plan of the asynchronous scheduler: the task queue (which path runs next, on which worker, for
how many steps), the workers and executors, and the checks of the ``ray`` section.

Plain Python, no Ray: :class:`dipaco.train.tasks.TaskScheduler` asks the queue for the next task of a
free worker, and tells it when a task's deltas were sent and when every module applied them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from dipaco.config import DistConfig, OuterConfig, RayConfig, TrainConfig
from dipaco.errors import ConfigError
from dipaco.model.topology import Topology
from dipaco.sync.async_nesterov import dynamic_local_steps


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


def check_ray(ray: RayConfig, train: TrainConfig, outer: OuterConfig, dist: DistConfig, async_syncs: Sequence[str],
              eval_every: int = 0) -> None:
    """``train.driver``, ``outer.sync`` and the ``ray`` keys fit together (``async_syncs``: the algorithms
    without rounds); the staleness bound is checked against the topology by :func:`check_staleness_bound`."""
    is_async = outer.sync in async_syncs
    if train.driver == "ray" and not is_async:
        raise ConfigError(f"train.driver: ray runs outer.sync={', '.join(async_syncs)} "
                          f"(ray.schedule=rounds for lock-step rounds), got outer.sync={outer.sync!r}")
    if is_async and train.driver != "ray":
        raise ConfigError(f"outer.sync: {outer.sync} has no rounds to run under torchrun; set train.driver=ray")
    for key in ("num_cpus", "num_workers", "executors", "checkpoint_every"):
        if getattr(ray, key) is not None and getattr(ray, key) <= 0:
            raise ConfigError(f"ray.{key}: must be > 0 or null, got {getattr(ray, key)}")
    if ray.simulate_speeds is not None:
        if not ray.simulate_speeds:
            raise ConfigError("ray.simulate_speeds: must list one speed per worker, or be null")
        for i, v in enumerate(ray.simulate_speeds):
            if not (math.isfinite(v) and 0 < v <= 1):
                raise ConfigError(f"ray.simulate_speeds[{i}]: must be in (0, 1] (1 = full speed), got {v}")
        if ray.num_workers is not None and ray.num_workers != len(ray.simulate_speeds):
            raise ConfigError(f"ray.simulate_speeds: {len(ray.simulate_speeds)} speeds for "
                              f"ray.num_workers={ray.num_workers} workers")
    for key in ("max_staleness", "task_retries"):
        if getattr(ray, key) is not None and getattr(ray, key) < 0:
            raise ConfigError(f"ray.{key}: must be >= 0, got {getattr(ray, key)}")
    if ray.executor_checkpoint_every <= 0:
        raise ConfigError(f"ray.executor_checkpoint_every: must be > 0, got {ray.executor_checkpoint_every}")
    if train.dynamic_local_steps and train.driver != "ray":
        raise ConfigError("train.dynamic_local_steps: needs train.driver=ray (lock-step rounds give every path "
                          "train.inner_steps)")
    if train.driver == "ray":
        unsupported = {"train.early_stopping_holdout": train.early_stopping_holdout, "outer.drop_prob": outer.drop_prob,
                       "dist.comm_dtype": dist.comm_dtype, "outer.nesterov": outer.nesterov, "eval.every": eval_every}
        defaults = {"train.early_stopping_holdout": 0.0, "outer.drop_prob": 0.0, "dist.comm_dtype": "fp32",
                    "outer.nesterov": True, "eval.every": 0}
        for key, value in unsupported.items():
            if value != defaults[key]:
                raise ConfigError(f"{key}: {value!r} is not supported by train.driver=ray "
                                  f"(async_nesterov sends fp32 deltas to Nesterov executors); use its default")


def check_staleness_bound(max_staleness: int | None, topology: Topology) -> None:
    """A task always competes with the other paths through its modules: S must allow that."""
    widest = max(len(topology.paths_through(m.id)) for m in topology.modules)
    if max_staleness is not None and max_staleness < widest - 1:
        raise ConfigError(f"ray.max_staleness: {max_staleness} is below {widest - 1}, the other paths "
                          f"through the most shared module; raise it or leave it null")


def worker_speeds(ray: RayConfig, num_paths: int) -> list[float]:
    count = ray.num_workers or (len(ray.simulate_speeds) if ray.simulate_speeds else num_paths)
    return list(ray.simulate_speeds) if ray.simulate_speeds else [1.0] * count


def executor_groups(num_modules: int, executors: int | None) -> list[list[int]]:
    """Modules dealt round-robin to ``executors`` actors (None: one actor per module)."""
    count = num_modules if executors is None else min(executors, num_modules)
    return [list(range(g, num_modules, count)) for g in range(count)]
