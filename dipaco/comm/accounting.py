"""Bytes on the wire, per rank, with the bandwidth-optimal ring algorithms.

For a buffer of B bytes on n ranks (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005):
ring all-reduce sends 2 (n-1)/n B and receives as much (reduce-scatter, then all-gather); ring
all-gather of B per rank sends (n-1) B (each rank forwards the n-1 other blocks); all-to-all of n
blocks of B/n sends and receives (n-1)/n B.

The DDP baseline (:func:`ddp_bytes`) is data-parallel training of one path-sized model on all W
ranks for the same inner steps: one fp32 ring all-reduce of every parameter's gradient per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_allgather_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-gather of ``nbytes`` per rank over ``n`` ranks."""
    return float((n - 1) * nbytes)


def ddp_bytes(path_numel: int, steps: int, world_size: int) -> float:
    """What DDP sends per rank: one fp32 gradient all-reduce of a path-sized model per inner step."""
    return steps * ring_allreduce_bytes(4.0 * path_numel, world_size)


@dataclass
class CommStats:
    """Bytes this rank sent and received in one sync, in total and per module (by name)."""

    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    check_bytes: float = 0.0  # the replica check's all-gathers (debug mode), not in the totals
    modules: dict[str, dict] = field(default_factory=dict)

    def add(self, name: str, ranks: tuple[int, ...], sent: float, received: float) -> None:
        self.modules[name] = {"ranks": list(ranks), "bytes_sent": sent, "bytes_received": received}
