"""Which rank trains which paths, and which rank writes each module's state.

DiPaCo (Douillard et al., arXiv 2403.10616, section 2.3) keeps only the modules a worker's paths go
through on that worker. A rank trains a fixed set of paths, chosen once by :func:`paths_by_rank`;
it holds the modules of those paths, and the lowest rank holding a module writes its state.
"""

from __future__ import annotations

from collections.abc import Sequence

from dipaco.comm.groups import module_ranks
from dipaco.errors import ConfigError
from dipaco.model.topology import Topology


def check_world_size(num_paths: int, world_size: int) -> None:
    """Every rank trains at least one path; raised on every rank before any communication."""
    if num_paths < world_size:
        raise ConfigError(
            f"dist: {world_size} ranks but the topology has only {num_paths} paths; every rank trains at "
            f"least one path, so run at most {num_paths} ranks (--nproc-per-node x --nnodes) or use more paths"
        )


def paths_by_rank(tokens: Sequence[int], world_size: int) -> list[tuple[int, ...]]:
    """Paths of each rank, balanced by shard tokens.

    Deterministic greedy (longest-processing-time first, Graham 1969): paths in order of decreasing
    tokens (ties: lower path id first), each to the rank with the fewest tokens so far (ties: lower
    rank). Every rank computes the same answer from the same shards.
    """
    check_world_size(len(tokens), world_size)
    load = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for p in sorted(range(len(tokens)), key=lambda p: (-tokens[p], p)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owned[r].append(p)
        load[r] += int(tokens[p])
    return [tuple(sorted(ps)) for ps in owned]


def owners_of(by_rank: Sequence[Sequence[int]]) -> dict[int, int]:
    """path id -> rank, from :func:`paths_by_rank`."""
    return {p: r for r, ps in enumerate(by_rank) for p in ps}




def module_writers(topology: Topology, by_rank: Sequence[Sequence[int]]) -> dict[int, int]:
    """Module id -> the rank that checkpoints it (its lowest holder), so each is written exactly once."""
    return {m: ranks[0] for m, ranks in module_ranks(topology, owners_of(by_rank)).items()}
