"""Which ranks talk about which module: one group per distinct set of ranks holding a module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dipaco.model.topology import Topology


@dataclass(frozen=True)
class CommGroup:
    """Ranks that all hold every one of ``modules`` (global module ids, ascending)."""

    ranks: tuple[int, ...]
    modules: tuple[int, ...]


def module_ranks(topology: Topology, owners: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    """Module id -> ranks holding a path through it (``owners``: path id -> rank), ascending."""
    return {
        m.id: tuple(sorted({owners[p] for p in topology.paths_through(m.id)})) for m in topology.modules
    }


def plan_groups(topology: Topology, owners: Mapping[int, int]) -> list[CommGroup]:
    """Groups of two or more ranks, one per distinct rank set, in the same order on every rank.

    A module held by one rank (path-specific, or all its paths on one rank) is in no group: it is
    never communicated.
    """
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for module, ranks in module_ranks(topology, owners).items():
        if len(ranks) >= 2:
            by_ranks.setdefault(ranks, []).append(module)
    return [CommGroup(ranks, tuple(sorted(mods))) for ranks, mods in sorted(by_ranks.items())]
