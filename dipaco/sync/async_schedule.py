"""The schedule of asynchronous DiPaCo: which path task runs next, on which worker, for how many steps.

Plain Python, no Ray, no tensors: the task scheduler (:mod:`dipaco.train.tasks`) asks the queue for
the next task of a free worker and tells it when a task's deltas were sent and when every module
applied them; :class:`~dipaco.sync.async_nesterov.AsyncNesterov` is the outer step they feed.

Guarantees:

* the budget of inner steps is spent exactly (the last task of a path may be shorter);
* ``schedule="rounds"`` hands out task k of a path only when every path completed k tasks (lock-step
  DiLoCo's rounds); ``"async"`` hands out the next ready path (its last update reached every module);
* with ``max_staleness`` S, ``clock_m - start_t + (in-flight tasks on m other than t) <= S`` holds for
  every in-flight task t on module m after every dispatch, so no update is staler than S
  (``clock_m``: the updates sent to m);
* a task whose worker died goes back to the front of the queue; so does a task a signal stopped, restored
  from a checkpoint, which continues from its step and the versions it started from.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

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
    done: int = 0  # steps done before a signal stopped it: it continues from there, from the same start

    @property
    def id(self) -> str:
        return f"p{self.path:03d}-t{self.index:04d}"


class TaskQueue:
    """Path tasks for free workers under a budget of total inner steps (see the module docstring)."""

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

    def admissible(self, path: int) -> bool:
        """Whether a new task of ``path`` keeps every update within the staleness bound."""
        if self.max_staleness is None:
            return True
        for m in self.topology.path_modules(path):
            flying = [t for t in self.running.values() if m in t.start]
            oldest = min((t.start[m] for t in flying), default=self.clock[m])
            if self.clock[m] - oldest + len(flying) > self.max_staleness:
                return False
        return True

    def dispatch(self, worker: int, among: Container[int] | None = None) -> Task | None:
        """The next task for ``worker`` (retries first), or None when none may start now; ``among``: only
        a task of these paths."""
        for task in list(self.retry):
            if (among is None or task.path in among) and self.admissible(task.path):
                self.retry.remove(task)
                return self._start(task, worker)
        if self.remaining <= 0:
            return None
        for path in list(self.ready):
            in_round = self.schedule != "rounds" or min(self.next_index.values()) >= self.next_index[path]
            if (among is None or path in among) and in_round and self.admissible(path):
                self.ready.remove(path)
                task = Task(path, self.next_index[path], min(self.planned_steps(worker), self.remaining))
                self.reserved += task.steps
                return self._start(task, worker)
        return None

    def _start(self, task: Task, worker: int) -> Task:
        task.worker, task.started = worker, time.monotonic()
        if not task.done:  # a task continued after a signal keeps the start its steps so far were taken from
            task.start = {m: self.clock[m] for m in self.topology.path_modules(task.path)}
        self.running[task.id] = task
        return task

    def failed(self, task: Task, count: bool = True) -> None:
        """The task did not return (its worker died); ``count``: whether this was one of its attempts."""
        del self.running[task.id]
        task.attempt += int(count)
        self.retry.appendleft(task)

    def paused(self, task: Task) -> None:
        """A signal stopped the task mid-way: the scheduler keeps where it is; :meth:`resume` continues it."""
        del self.running[task.id]

    def resume(self, task: Task) -> None:
        """A task a signal stopped after ``task.done`` of its steps (restored from a checkpoint): first in
        line, keeping the versions it started from."""
        self.ready.remove(task.path)
        self.reserved += task.steps
        self.retry.appendleft(task)

    def sent(self, task: Task, tokens_per_s: float) -> None:
        """The task returned and its deltas were sent to its modules' executors."""
        del self.running[task.id]
        self.sending[task.id] = task
        for m in task.start:
            self.clock[m] += 1
        if tokens_per_s > 0:
            self.speed[task.worker] = tokens_per_s

    def lost(self, task: Task) -> None:
        """A sent task's deltas were lost before every executor took them (the node holding them is gone): it
        runs again, first in line (an executor that took its update refuses the same task id again)."""
        del self.sending[task.id]
        for m in task.start:
            self.clock[m] -= 1
        task.done = 0
        self.retry.appendleft(task)

    def applied(self, task: Task) -> None:
        """Every module took the task's update: the path may run again."""
        del self.sending[task.id]
        self.reserved -= task.steps
        self.steps_done += task.steps
        self.completed += 1
        self.next_index[task.path] = task.index + 1
        self.ready.append(task.path)


def check_staleness_bound(max_staleness: int | None, topology: Topology) -> None:
    """A task always competes with the other paths through its modules: S must allow that."""
    widest = max(len(topology.paths_through(m.id)) for m in topology.modules)
    if max_staleness is not None and max_staleness < widest - 1:
        raise ConfigError(f"ray.max_staleness: {max_staleness} is below {widest - 1}, the other paths "
                          f"through the most shared module; raise it or leave it null")
