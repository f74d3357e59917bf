"""The stateful components of a training run, and what of them one rank puts in a checkpoint.

Like torchtitan's checkpoint manager, a checkpoint is the state of named components; here they are

* ``bank``: the modules, each written by its lowest holder (:class:`~dipaco.model.bank.ModuleBank`);
* ``sync``: the outer optimizer's momentum (part ``outer``) and whatever else the algorithm keeps, by
  part (:meth:`dipaco.sync.base.OuterSync.state_dict`, or the task scheduler's executors);
* ``paths``: each of this rank's paths: its parameters and its inner loop's AdamW state, LR schedule,
  data cursor and loss scale (:class:`~dipaco.paths.inner.InnerLoop`);
* ``scheduler``: the scheduler's own state (the task queue; nothing for lock-step rounds);
* the RNG states, the checkpoint index and the placement of paths on ranks.

Both schedulers write and read this one format; :mod:`dipaco.checkpoint.store` knows the files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dipaco.checkpoint.store import BANK, SavedCheckpoint, Snapshot
from dipaco.errors import CheckpointError
from dipaco.model.bank import ModuleBank
from dipaco.runtime import rng_state, set_rng_state
from dipaco.tensor_io import copy_params

# 1: paths saved before the outer step; 2: after it; 3: the scheduler's state under "scheduler" (the
# task scheduler's format-2 checkpoints kept it elsewhere and are refused).
CHECKPOINT_FORMAT = 3


class PathState(Protocol):
    """What a checkpoint keeps of a path (:class:`~dipaco.paths.inner.InnerLoop`)."""

    model: torch.nn.Module

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class SyncState(Protocol):
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]: ...

    def load_state_dict(self, saved: Any) -> None: ...


class SchedulerState(Protocol):
    driver: str  # torchrun | ray: which scheduler wrote a checkpoint

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainingState:
    """One rank's stateful components (see the module docstring)."""

    bank: ModuleBank
    writes: frozenset[str]  # the modules whose state this rank writes (it is their lowest holder), by name
    paths: Mapping[int, PathState]  # this rank's paths
    sync: SyncState
    scheduler: SchedulerState
    rank: int
    by_rank: Sequence[tuple[int, ...]]  # the paths of every rank

    def snapshot(self, index: int, records: list | None, info: dict, texts: dict[str, str],
                 earlier: Sequence[tuple[int, list | None, dict]] = ()) -> Snapshot:
        """This rank's share of checkpoint ``index``; rank 0 also keeps the metrics ``records`` of the
        work it completed and the ``info`` of its checkpoint event (a resumed run logs them if it came
        before they were), those of the ``earlier`` points the checkpoint covers (train.checkpoint_every
        > 1), and the ``texts`` (config, spec)."""
        bank = {k: v for k, v in self.bank.state_dict().items() if k.split("/", 1)[0] in self.writes}
        state = {"round": index, "rng": rng_state(), "format": CHECKPOINT_FORMAT, "world_size": len(self.by_rank),
                 "paths_by_rank": [list(ps) for ps in self.by_rank], "driver": self.scheduler.driver,
                 "scheduler": self.scheduler.state_dict(),
                 **({"reports": records, "checkpoint_info": info} if self.rank == 0 else {}),
                 **({"earlier": [list(e) for e in earlier]} if self.rank == 0 and earlier else {})}
        paths: dict[int, tuple[Mapping[str, torch.Tensor], dict]] = {
            p: (dict(loop.model.named_parameters()), loop.state_dict()) for p, loop in self.paths.items()}
        return Snapshot(parts={BANK: bank, **self.sync.state_dict()}, state=state, paths=paths,
                        texts=texts if self.rank == 0 else {})

    @torch.no_grad()
    def restore(self, saved: SavedCheckpoint) -> dict:
        """Loads every component from ``saved`` (this rank's share, whatever the ranks that wrote it);
        returns the trainer state."""
        state = saved.state()
        driver = state.get("driver", "torchrun")
        if driver != self.scheduler.driver:
            raise CheckpointError(f"{saved.root}: written by train.driver={driver}; train.driver="
                                  f"{self.scheduler.driver} cannot continue it")
        if driver == "ray" and state.get("format", 1) < CHECKPOINT_FORMAT:
            raise CheckpointError(f"{saved.root}: a format-{state.get('format', 1)} checkpoint of the Ray driver "
                                  f"(before its outer step became the lock-step one); it cannot be resumed by this "
                                  f"version, which reads format {CHECKPOINT_FORMAT}: start the experiment again")
        self.bank.load_state_dict(saved.replicated(BANK, set(self.bank.state_dict())))
        for p, loop in self.paths.items():
            params, inner = saved.path(p)
            copy_params(loop.model, params, saved.root / f"paths/path_{p:03d}")
            loop.load_state_dict(inner)
            if state.get("format", 1) < 2:  # format 1 saved each path before the outer step
                self.bank.load_path(p, loop.model)
        saved.same_placement = state.get("paths_by_rank") == [list(ps) for ps in self.by_rank]
        self.sync.load_state_dict(saved)
        if "scheduler" in state:
            self.scheduler.load_state_dict(_with_every_segment(state["scheduler"], saved))
        set_rng_state(state["rng"])
        return state


def _with_every_segment(scheduler: dict, saved: SavedCheckpoint) -> dict:
    """A step checkpoint keeps, per rank, the steps each of its paths did in the stopped round. When the paths
    moved to other ranks (a lost site, a late joiner), a rank gathers its paths' steps from every rank's file."""
    stopped = scheduler.get("stopped_at")
    if stopped is None or saved.same_placement:
        return scheduler
    segments: dict = {}
    for other in saved.every_state():
        segments.update((other.get("scheduler") or {}).get("stopped_at", {}).get("segments", {}))
    return {**scheduler, "stopped_at": {**stopped, "segments": segments}}
