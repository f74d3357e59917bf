"""The OuterSync protocol: how the modules of a bank are kept in sync across the paths that share them.

The round driver (:mod:`dipaco.train.loop`) advances this rank's paths in *segments*: every path runs
the inner steps up to the next offset of :meth:`OuterSync.sync_points`, then the driver calls
:meth:`OuterSync.at` with every path of the rank. An algorithm owns everything else: its schedule,
its outer optimizer states, its communication (a :class:`~dipaco.comm.reduce.Transport`, possibly
wrapped in :class:`~dipaco.comm.feedback.ErrorFeedback`), what it writes back into the path models,
and its checkpointable state.

A new algorithm is one class in one file of this package, plus one line in
:data:`dipaco.sync.SYNCS`; ``outer.sync=<name>`` selects it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from dipaco.checkpoint.store import load_selected, load_tensors, rank_files
from dipaco.comm.accounting import CommStats
from dipaco.comm.world import World
from dipaco.config import Config
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology


@dataclass(frozen=True)
class SyncContext:
    """What every algorithm is built from."""

    cfg: Config
    topology: Topology
    bank: ModuleBank  # the modules this rank's paths go through
    weights: Mapping[int, float]  # every path's outer weight w_p
    by_rank: Sequence[tuple[int, ...]]  # the paths of every rank
    world: World


@dataclass
class SyncReport:
    """What one call of :meth:`OuterSync.at` did, for the metrics."""

    norms: dict[str, float] = field(default_factory=dict)  # outer-gradient norm per updated module
    dropped: list[int] = field(default_factory=list)  # paths whose contribution was dropped
    stats: CommStats = field(default_factory=CommStats)
    comm_seconds: float = 0.0  # waiting for the transport
    seconds: float = 0.0  # the whole sync


class SavedState:
    """A verified checkpoint as one rank's sync reads it back.

    ``same_placement``: whether the ranks train the same paths as when it was written.
    """

    def __init__(self, root: Path, rank: int, device: torch.device, same_placement: bool) -> None:
        self.root, self.rank, self.device, self.same_placement = root, rank, device, same_placement

    def replicated(self, stem: str, names: set[str]) -> dict[str, torch.Tensor]:
        """Tensors every holder has identical copies of, from whichever rank wrote them."""
        return load_selected(rank_files(self.root, f"{stem}.safetensors").values(), names, self.device)

    def per_rank(self, stem: str) -> dict[int, dict[str, torch.Tensor]]:
        """Every rank's own ``stem`` file (rank -> tensors), for state that is private to a rank."""
        return {r: load_tensors(path, self.device) for r, path in rank_files(self.root, f"{stem}.safetensors").items()}


class OuterSync(ABC):
    """One outer-synchronization algorithm; subclasses cite their paper and state their guarantees."""

    name: str

    @abstractmethod
    def sync_points(self) -> tuple[int, ...]:
        """Inner-step offsets within a round (ascending, the last one = ``train.inner_steps``) after
        which :meth:`at` is called."""

    @abstractmethod
    def at(self, round_index: int, offset: int, paths: Mapping[int, PreTrainedModel]) -> SyncReport:
        """Syncs after ``offset`` inner steps of round ``round_index``; ``paths``: this rank's path
        models (path id -> model), all at that step. Updates the bank and the path models in place."""

    @abstractmethod
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's share of the checkpointable state: file stem -> tensors by name."""

    @abstractmethod
    def load_state(self, saved: SavedState) -> None:
        """Restores the state from a checkpoint written by :meth:`state_dict` (on any number of ranks)."""
