"""Which peer is gone: heartbeats in the job's store, and the bound on how long a lock-step round may wait.

A collective that fails says that *some* peer did not answer, not which one: a ring all-reduce times out
on its neighbour even when the silent rank is further round the ring, and a site whose link is cut sends
nothing that would reset a connection. So every rank of a torchrun job counts up its own key in the job's
key-value store (the store torchrun's agent hosts on the rendezvous host) once per ``interval_s``. When a
collective fails, :meth:`Heartbeat.lost_ranks` reads every rank's count twice, a few intervals apart: the
ranks whose count stood still are the lost ones. When the store itself does not answer, this rank is the
one cut off (or the store's host is lost), and the error says that instead.

:class:`RoundTimeout` is how long a collective waits once a round has been timed. The first round of an
attempt waits up to ``dist.timeout_s`` (start-up, compilation, a first checkpoint); after it, ranks wait
``dist.round_timeout_factor`` times the slowest round so far, at least ``dist.round_timeout_min_s``: a rank
that finished early waits at most about one round for the slowest, so a few rounds' worth is slack, and a
lost site is noticed within that time instead of after half an hour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class RoundTimeout:
    """How long collectives wait (``dist.timeout_s``, ``dist.round_timeout_factor``, ``dist.round_timeout_min_s``)."""

    ceiling_s: float  # setup and the first round of an attempt; never exceeded
    factor: float = 3.0  # x the slowest round so far; 0: always ceiling_s
    min_s: float = 60.0

    def after(self, slowest_round_s: float) -> float:
        """The timeout once rounds as slow as ``slowest_round_s`` have been seen."""
        if self.factor <= 0:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.min_s, self.factor * slowest_round_s))


class Heartbeat:
    """This rank's heartbeat in the job's store, and every peer's, read back when a collective failed.

    ``connect`` makes a store client; the beating thread has one of its own, and each check of the peers makes a
    new one, so a check never waits behind a beat stuck on a connection whose link went down."""

    KEY = "alive/rank_{}"
    WINDOW = 3.0  # beats a peer's count must stand still for before it is called lost

    def __init__(self, connect: Callable[[], Any], rank: int, world_size: int, interval_s: float = 1.0) -> None:
        self.connect, self.rank, self.world_size, self.interval_s = connect, rank, world_size, interval_s
        self._stop = threading.Event()
        self._store = connect()
        self._thread = threading.Thread(target=self._beat, name=f"dipaco-heartbeat-{rank}", daemon=True)

    @classmethod
    def to_store(cls, addr: str, port: int, prefix: str, rank: int, world_size: int,
                 interval_s: float = 1.0) -> Heartbeat:
        """Heartbeats in the TCP store at ``addr:port`` (a client, never its host), keys under ``prefix``."""
        timeout = timedelta(seconds=max(5.0, 5 * interval_s))

        def connect() -> Any:
            client = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
            return dist.PrefixStore(prefix, client)

        return cls(connect, rank, world_size, interval_s)

    def start(self) -> Heartbeat:
        self._store.add(self.KEY.format(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self.KEY.format(self.rank), 1)
            except Exception:  # the store is unreachable: this rank stops beating, which is what peers see
                return

    @property
    def window_s(self) -> float:
        return self.WINDOW * self.interval_s

    def lost_ranks(self) -> list[int] | None:
        """The peers whose heartbeat stood still for ``window_s``; None when this rank is the one cut off:
        the store does not answer, or this rank's own beats did not reach it."""
        try:
            store = self.connect()
            before = [int(store.add(self.KEY.format(r), 0)) for r in range(self.world_size)]
            time.sleep(self.window_s)
            after = [int(store.add(self.KEY.format(r), 0)) for r in range(self.world_size)]
        except Exception:
            return None
        if after[self.rank] == before[self.rank]:
            return None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
