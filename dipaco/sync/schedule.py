"""The schedule of DiLoCo's outer exchanges: which slices leave when, when they land, what the paths do then.

One class, three parameters (as torchft's ``local_sgd.DiLoCo``): a :class:`Schedule` says which
slices (:mod:`dipaco.sync.slices`) leave together (*fragments*, each at its offset of the round), how
many inner steps an exchange runs before it lands (*delay*), and what a path does with a landed
fragment (*mixing* ``theta_path <- alpha * theta_path + (1 - alpha) * theta_bank``, or a restart from
the bank after every sync, optionally *eager*: keeping its own change while it is in flight).

* Plain DiLoCo (Douillard et al., arXiv 2311.08105) is one fragment holding every slice, leaving at
  offset ``train.inner_steps``, delay 0, alpha 0 (:meth:`Schedule.diloco`);
* Streaming DiLoCo (Douillard et al., arXiv 2501.18512; :mod:`dipaco.sync.streaming`): F fragments
  at staggered offsets, a delay of tau inner steps, mixing alpha;
* the one-round delay of DiLoCoX (Qi et al., arXiv 2506.21263; :mod:`dipaco.sync.delayed`): one
  fragment, a delay of d rounds, paths restarting from the bank.

The sync (:class:`dipaco.sync.diloco.DiLoCo`) is called at every :meth:`Schedule.sync_points` offset:
every offset at which a fragment leaves or lands. An exchange leaving at offset s of round r lands
``delay`` inner steps later (:meth:`Schedule.landing`); one whose landing would fall after the run
lands at the run's last sync point (round ``train.rounds - 1``, offset ``train.inner_steps``), so
the final bank holds every outer gradient.

Pure arithmetic: no tensors, no bank, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """When the slices leave, when they land, and what the paths do then (see the module docstring)."""

    inner_steps: int  # H: the inner steps of a round
    rounds: int  # the rounds of the run (the last one lands everything still in flight)
    fragments: tuple[tuple[int, ...], ...]  # the slice ids of each fragment
    leaves: tuple[int, ...]  # the offset in the round at which each fragment leaves, in 1..H
    delay: int = 0  # inner steps from leaving to landing (Streaming DiLoCo's tau; DiLoCoX: a round)
    alpha: float = 0.0  # landing: theta_path <- alpha * theta_path + (1 - alpha) * theta_bank on its slices
    restart: bool = False  # after every sync each path restarts from the whole bank (DiLoCoX), alpha unused
    eager: bool = False  # with restart: a path keeps its own change while it is in flight (Kale et al.)

    def __post_init__(self) -> None:
        if not self.fragments:
            raise ValueError("a schedule without fragments")
        if len(self.leaves) != len(self.fragments):
            raise ValueError(f"{len(self.fragments)} fragments but {len(self.leaves)} offsets to leave at")
        if any(not 1 <= s <= self.inner_steps for s in self.leaves):
            raise ValueError(f"fragments leave at offsets {list(self.leaves)}, not all in 1..{self.inner_steps}")
        if self.delay < 0:
            raise ValueError(f"a delay of {self.delay} inner steps")
        if self.eager and not self.restart:
            raise ValueError("an eager schedule restarts the paths from the bank after every sync")
        if self.sync_points()[-1] != self.inner_steps:
            raise ValueError(f"offset {self.inner_steps}, the round's last step, is not a sync point")

    @classmethod
    def diloco(cls, inner_steps: int, rounds: int, slices: int, at: tuple[int, ...] | None = None) -> Schedule:
        """Plain DiLoCo over ``slices`` slices: every slice leaves at the end of the round (or at each
        offset of ``at``) and lands at once."""
        leaves = (inner_steps,) if at is None else at
        every = tuple(range(slices))
        return cls(inner_steps, rounds, tuple(every for _ in leaves), leaves)

    def landing(self, round_index: int, offset: int) -> tuple[int, int]:
        """(round, offset) at which an exchange leaving at ``offset`` of ``round_index`` lands; one that
        would land after the run lands at its last sync point."""
        h, last = self.inner_steps, self.rounds - 1
        landed_round, landed_offset = divmod(round_index * h + offset + self.delay - 1, h)
        if landed_round > last:
            return last, h
        return landed_round, landed_offset + 1

    def departures(self, round_index: int) -> list[tuple[int, int, tuple[int, int]]]:
        """(offset, fragment, landing (round, offset)) of every fragment that leaves in ``round_index``."""
        return sorted((leave, k, self.landing(round_index, leave)) for k, leave in enumerate(self.leaves))

    def leaving(self, round_index: int, offset: int) -> list[tuple[int, tuple[int, int]]]:
        """(fragment, landing) of the fragments that leave at ``offset`` of ``round_index``, in order."""
        return [(k, due) for leave, k, due in self.departures(round_index) if leave == offset]

    def sync_points(self) -> tuple[int, ...]:
        """The offsets of a round at which a fragment leaves or lands, ascending."""
        h, tau = self.inner_steps, self.delay
        return tuple(sorted(set(self.leaves) | {(s + tau - 1) % h + 1 for s in self.leaves}))
