"""dipaco/train/path_states.py: where each path's AdamW state lives under the Ray driver (issue 72), without Ray.

A ``Ref`` stands in for an object-store reference: ``put`` makes one on the driver, a task's result is one made
on its worker's node, and ``get`` counts what crosses to the driver."""

from __future__ import annotations

from dataclasses import dataclass

from dipaco.train.path_states import ObjectStore, PathStates


@dataclass(eq=False)  # compared by identity, as Ray's references are
class Ref:
    value: str
    where: str


class Lost(Exception):
    pass


class Store:
    def __init__(self) -> None:
        self.fetched: list[str] = []
        self.gone: set[str] = set()  # nodes lost
        self.lost: list[tuple[int, int]] = []  # (path, age) fall backs, as the scheduler hears them

    def put(self, value: str) -> Ref:
        return Ref(value, "driver")

    def get(self, ref: Ref | list[Ref]) -> str | list[str]:
        if isinstance(ref, list):  # as ray.get takes a list
            return [self.get(r) for r in ref]
        if ref.where in self.gone:
            raise Lost(ref.value)
        if ref.where != "driver":
            self.fetched.append(ref.value)
        return ref.value


def _states(sync_every: int, paths: int = 2) -> tuple[PathStates, Store]:
    store = Store()
    objects = ObjectStore(store.put, store.get, (Lost,), lambda path, age: store.lost.append((path, age)))
    return PathStates({p: store.put(f"p{p}@0") for p in range(paths)}, sync_every, objects), store


def test_every_task_syncs_by_default_and_each_state_is_fetched_once():
    states, store = _states(sync_every=1)
    made = Ref("p0@1", "node-a")
    states.applied(0, made, worker=3)
    assert store.fetched == ["p0@1"] and states.age(0) == 0
    assert states.synced[0].where == "driver" and states.newest[0] is made  # the next task still reads it in place
    states.sync(0)
    assert store.fetched == ["p0@1"]  # already the driver's: not fetched again


def test_a_state_stays_on_its_node_until_state_sync_every_tasks():
    states, store = _states(sync_every=3)
    for t in (1, 2):
        states.applied(0, Ref(f"p0@{t}", "node-a"), worker=1)
    assert store.fetched == [] and states.age(0) == 2 and states.oldest() == 2
    assert states.gathered() == {0: "p0@0", 1: "p1@0"}  # a checkpoint now would write the driver's copies
    states.applied(0, Ref("p0@3", "node-a"), worker=1)
    assert store.fetched == ["p0@3"] and states.age(0) == 0 and states.gathered()[0] == "p0@3"


def test_a_worker_first_takes_the_paths_it_made():
    states, _ = _states(sync_every=8, paths=3)
    states.applied(0, Ref("p0@1", "a"), worker=0)
    states.applied(2, Ref("p2@1", "a"), worker=0)
    states.applied(1, Ref("p1@1", "b"), worker=1)
    assert states.made_by(0) == {0, 2} and states.made_by(1) == {1} and states.made_by(5) == set()
    states.applied(2, Ref("p2@2", "b"), worker=1)  # another worker ran path 2's next task
    assert states.made_by(0) == {0} and states.made_by(1) == {1, 2}


def test_a_lost_node_falls_back_to_the_drivers_copy_and_says_how_old_it_is():
    states, store = _states(sync_every=4, paths=3)
    states.applied(0, Ref("p0@1", "a"), worker=0)
    states.applied(0, Ref("p0@2", "a"), worker=0)
    states.applied(1, Ref("p1@1", "a"), worker=0)
    states.applied(2, Ref("p2@1", "b"), worker=1)
    states.lost_worker(0)
    assert store.lost == [(0, 2), (1, 1)]
    assert states.newest[0] is states.synced[0] and states.gathered() == {0: "p0@0", 1: "p1@0", 2: "p2@0"}
    assert states.age(0) == 0 and states.made_by(0) == set() and store.fetched == []
    states.fall_back(0)
    assert store.lost == [(0, 2), (1, 1)]  # the driver holds it now: nothing more is lost
    assert states.made_by(1) == {2} and states.oldest() == 1
    states.applied(0, Ref("p0@3", "c"), worker=2)  # the path goes on from there, counting anew
    assert states.age(0) == 1


def test_a_sync_from_a_node_that_is_gone_falls_back():
    """The node went away before anything noticed (its worker idle): the sync that was due falls back."""
    states, store = _states(sync_every=2)
    states.applied(0, Ref("p0@1", "a"), worker=0)
    store.gone.add("a")
    states.applied(0, Ref("p0@2", "a"), worker=0)
    assert store.lost == [(0, 2)] and states.gathered()[0] == "p0@0" and states.made_by(0) == set()
    states.sync_all()  # nothing left on the lost node
    assert store.lost == [(0, 2)] and store.fetched == []


def test_a_stopped_task_sends_its_state_to_the_driver_at_once():
    states, store = _states(sync_every=100)
    states.applied(1, Ref("p1@1", "a"), worker=0)
    states.stopped(1, Ref("p1@1.5", "a"))
    assert store.fetched == ["p1@1.5"] and states.gathered()[1] == "p1@1.5" and states.age(1) == 0


def test_sync_all_leaves_nothing_only_on_a_node():
    states, store = _states(sync_every=100, paths=3)
    for p in range(3):
        states.applied(p, Ref(f"p{p}@1", "a"), worker=p)
    states.sync_all()
    assert sorted(store.fetched) == ["p0@1", "p1@1", "p2@1"] and states.oldest() == 0
