"""The OuterSync protocol: how the modules of a bank are kept in sync across the paths that share them.

The round scheduler (:mod:`dipaco.train.rounds`) advances this rank's paths in *segments*: every path
runs the inner steps up to the next offset of :meth:`OuterSync.sync_points`, then the scheduler calls
:meth:`OuterSync.at` with every path of the rank. An algorithm owns everything else: its schedule,
its outer optimizer states, its communication (DiLoCo's: :class:`~dipaco.sync.transport.OuterTransport`
over a :class:`~dipaco.comm.reduce.Transport`, possibly wrapped in error feedback and adaptive
codecs), what it writes back into the path models, and its checkpointable state
(:meth:`OuterSync.state_dict` / :meth:`OuterSync.load_state_dict`).

A new algorithm is one class in one file of this package, plus one line in
:data:`dipaco.sync.SYNCS`; ``outer.sync=<name>`` selects it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from dipaco.comm.accounting import CommStats
from dipaco.comm.world import World
from dipaco.config import DistConfig, OuterConfig
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology

OUTER_MOMENTUM_PART = "outer"  # the checkpoint part of the outer optimizer's momentum, by module name


@dataclass(frozen=True)
class SyncContext:
    """What every algorithm is built from: its sections of the config, and the run it syncs."""

    outer: OuterConfig
    dist: DistConfig
    inner_steps: int  # train.inner_steps: the steps of a round
    rounds: int  # train.rounds: the rounds of the run
    seed: int  # run.seed: outer.drop_prob's draws
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

    def merge(self, other: SyncReport) -> None:
        """Adds what another call did (several exchanges applied at one sync point)."""
        self.norms.update(other.norms)  # the newest norm of a module is kept
        self.dropped = sorted(set(self.dropped) | set(other.dropped))
        self.stats.bytes_sent += other.stats.bytes_sent
        self.stats.bytes_received += other.stats.bytes_received
        self.stats.check_bytes += other.stats.check_bytes
        self.stats.modules.update(other.stats.modules)
        self.comm_seconds += other.comm_seconds


class SavedState(Protocol):
    """A verified checkpoint as one rank's sync reads it back (:class:`dipaco.checkpoint.store.SavedCheckpoint`).

    ``same_placement``: whether the ranks train the same paths as when it was written."""

    rank: int
    device: torch.device
    same_placement: bool

    def replicated(self, part: str, names: set[str]) -> dict[str, torch.Tensor]:
        """Tensors every holder has identical copies of, from whichever rank wrote them."""
        ...

    def per_rank(self, part: str) -> dict[int, dict[str, torch.Tensor]]:
        """Every rank's own ``part`` (rank -> tensors), for state that is private to a rank."""
        ...


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
        """This rank's share of the checkpointable state: part name -> tensors by name.
        :data:`OUTER_MOMENTUM_PART` (the outer optimizer's momentum, by module name) is the part every
        sync has."""

    @abstractmethod
    def load_state_dict(self, saved: SavedState) -> None:
        """Restores the state from a checkpoint written by :meth:`state_dict` (on any number of ranks)."""
