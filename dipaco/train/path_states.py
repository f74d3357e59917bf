"""Where each path's AdamW state lives while the Ray driver runs (``train.driver=ray``, issue 72).

A path task returns the path's new AdamW state (twice the path's parameters) as an object on the node of
the worker that ran it. Sending it back to the driver after every task is most of a slow link's traffic, so
the state stays where it was made: the next task of the path goes to that worker first (path affinity), and
the driver takes a copy only every ``ray.state_sync_every`` tasks of the path, before a checkpoint, and when a
signal stops a task. Where the worker's node is lost, the path continues from the driver's copy: the AdamW
steps of the tasks since it (``state_age``) are lost, its parameters are not (they are the executors').

Plain Python over the object store's ``put`` and ``get`` (Ray's, or any pair in a test), so it runs without Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObjectStore:
    """What the states are kept in: ``put`` a value on the driver, ``get`` one (or a list) from where it is, ``lost``: what
    ``get`` raises for an object whose node is gone, and ``on_lost(path, age)``, told of each fall back."""

    put: Callable[[Any], Any]
    get: Callable[[Any], Any]
    lost: tuple[type[BaseException], ...]
    on_lost: Callable[[int, int], None]


class PathStates:
    """Every path's newest AdamW state (a reference), the worker that made it, and the driver's copy."""

    def __init__(self, states: dict[int, Any], sync_every: int, store: ObjectStore) -> None:
        """``states``: path -> its state as the driver holds it (a reference ``store.get`` reads)."""
        self.sync_every, self.store = sync_every, store
        self.newest = dict(states)  # path -> its newest state
        self.synced = dict(states)  # path -> the newest state the driver holds
        self.current = set(states)  # the paths whose synced state is their newest (each is fetched once)
        self.holder: dict[int, int] = {}  # path -> the worker that made newest[path] (absent: the driver holds it)
        self.tasks_of = dict.fromkeys(states, 0)  # path -> its tasks applied in this run
        self.synced_at = dict.fromkeys(states, 0)  # path -> tasks_of[path] when synced[path] was taken

    def made_by(self, worker: int) -> set[int]:
        """The paths whose newest state ``worker`` made: its first choice of task."""
        return {p for p, w in self.holder.items() if w == worker}

    def applied(self, path: int, state: Any, worker: int) -> None:
        """A task of ``path`` by ``worker`` was applied; its new ``state`` stays on the worker's node until a sync
        is due."""
        self.newest[path], self.holder[path] = state, worker
        self.current.discard(path)
        self.tasks_of[path] += 1
        if self.age(path) >= self.sync_every:
            self.sync(path)

    def stopped(self, path: int, state: Any) -> None:
        """A signal stopped a task of ``path`` mid-way: its state goes to the driver now (the checkpoint needs it)."""
        self.newest[path] = state
        self.current.discard(path)
        self.sync(path)

    def sync(self, path: int) -> None:
        """The driver takes the path's newest state (fetched from the node that made it, once); where that node
        is gone, the path falls back to the driver's copy."""
        if path not in self.current:
            try:
                self.synced[path] = self.store.put(self.store.get(self.newest[path]))
            except self.store.lost:
                self.fall_back(path)
                return
            self.current.add(path)
        self.synced_at[path] = self.tasks_of[path]

    def sync_all(self) -> None:
        for path in self.synced:
            self.sync(path)

    def age(self, path: int) -> int:
        """The path's tasks whose AdamW steps the driver's copy does not hold."""
        return self.tasks_of[path] - self.synced_at[path]

    def oldest(self) -> int:
        return max((self.age(p) for p in self.synced), default=0)

    def fall_back(self, path: int) -> None:
        """The node holding the path's newest state may be gone: the path continues from the driver's copy, and
        ``store.on_lost`` hears its age (the tasks whose AdamW steps are lost). Nothing where the driver held it."""
        if self.holder.pop(path, None) is None:
            return
        age = self.age(path)
        self.newest[path] = self.synced[path]
        self.current.add(path)
        self.synced_at[path] = self.tasks_of[path]  # the driver's copy is the newest again
        self.store.on_lost(path, age)

    def lost_worker(self, worker: int) -> None:
        """``worker`` died: each path whose newest state it made falls back."""
        for path in sorted(self.made_by(worker)):
            self.fall_back(path)

    def gathered(self) -> dict[int, Any]:
        """Every path's state as the driver holds it, read (what a checkpoint writes)."""
        return dict(zip(self.synced, self.store.get(list(self.synced.values()))))  # one call: Ray fetches them together
