"""The built experiment: everything :func:`dipaco.build.build_trainer` (the composition root of training) makes for one
rank, in one record that both schedulers, the Ray workers and the trainer read.

    spec (what the experiment is) -> topology -> placement of the paths on the ranks
      -> shards and outer weights -> the bank of this rank's modules
      -> the path-loop factory (dipaco.paths.factory) and this rank's loops, built with it

The outer step and its transport are built by the root from this record (:func:`dipaco.sync.build_sync`
for the lock-step scheduler; the module executors of the task scheduler hold theirs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dipaco.checkpoint.spec import ExperimentSpec
from dipaco.comm.world import World
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.paths.factory import PathLoops
from dipaco.paths.inner import InnerLoop


@dataclass
class BuiltExperiment:
    """One experiment as one rank trains it."""

    spec: ExperimentSpec  # written into the experiment and into every checkpoint
    config_yaml: str  # the resolved config: written beside the spec (resume compares it)
    run_dir: Path
    dir: Path  # <run.dir>/train/<name>
    rounds: int  # train.rounds: the LR schedule spans rounds x inner_steps (the Ray scheduler: that many tasks' steps)
    inner_steps: int  # train.inner_steps: a round's steps
    topology: Topology
    world: World  # this rank and the job's collectives (one rank in a single process)
    by_rank: list[tuple[int, ...]]  # the paths of every rank
    weights: dict[int, float]  # every path's outer weight w_p
    bank: ModuleBank  # the modules this rank's paths go through (all of them in a single process)
    path_loops: PathLoops  # builds any path's inner loop (every shard, the seed rule)
    load_path_loops: Callable[[], PathLoops]  # builds path_loops again from the run's files (a Ray worker on any node)
    loops: dict[int, InnerLoop]  # this rank's path id -> its inner loop, built by path_loops

    @property
    def routed(self) -> bool:
        """Trains on routed shards (train.sharding=kmeans), whose routing is recorded and checked."""
        return self.spec.routed

    @property
    def paths(self) -> tuple[int, ...]:
        """This rank's paths."""
        return tuple(self.by_rank[self.world.rank])
