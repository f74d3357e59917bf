"""Dynamic batching per path for ``dipaco serve``: requests routed to the same path that arrive within a
short window are decoded together (:func:`dipaco.serve.decode.decode_batch`).

    batcher = PathBatcher(pipeline.run_batch, max_batch=16, batch_wait_s=0.005, workers=1)
    ticket = batcher.submit(path, row, result=lambda row: ...)    # a concurrent.futures.Future
    ticket.future.result()                                        # or asyncio.wrap_future(ticket.future)

- One queue per path. A batch is due when its path's oldest request has waited ``batch_wait_s``, or
  when ``max_batch`` requests wait; it then takes up to ``max_batch`` of them, oldest first.
- ``workers`` threads decode; a worker takes the due path whose oldest request has waited longest, and
  a path is decoded by one worker at a time (its requests meanwhile gather into its next batch), so
  batches of different paths run in parallel, at most ``workers`` at once. One is the default: decoding
  threads of one process contend for the GIL around every small torch op, and on the 2-core CPU four
  of them halved the unbatched server's throughput (docs/notes/2026-11-27-single-path-inference.md); one thread also lets the
  other paths' requests pile up into larger batches while it decodes.
- Requests of a path that is decoding join its running batch between two steps (up to ``max_batch``
  rows), unless that would keep a request of another path waiting for a worker: with every worker
  busy and another path's request queued, the running batch takes no one and ends as its rows end,
  and the worker moves on to the path whose oldest request has waited longest.
- Each row still ends on its own (its EOS, its ``max_new_tokens``): its result is computed and its future
  resolved at once, from the worker, while the rest of its batch goes on.
- ``one_queue=True`` (module batching, :mod:`dipaco.serve.module_batch`): requests of every path share one
  queue, so a batch, and the rows joining it, hold any paths; each row keeps its own path (``DecodeRow.path``),
  and ``run_batch`` is called with the queue's key, :data:`ALL_PATHS`. One worker decodes that queue at a time.
- ``max_batch=1`` is the unbatched server: the same queues and workers, every batch one row, no waiting,
  nothing joining.
- A request whose client has gone is cancelled: taken out of its queue, or dropped from its running
  batch at the next step (:meth:`DecodeRow.cancel`); the other rows are not touched.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from dipaco.errors import DipacoError
from dipaco.serve.decode import FINISH_CANCELLED, Admit, DecodeRow, OnStep

DEFAULT_MAX_BATCH = 16
DEFAULT_BATCH_WAIT_MS = 5.0
DEFAULT_DECODE_WORKERS = 1
BATCHING_MODES = ("module", "path")  # `dipaco serve --batching`
DEFAULT_BATCHING = "module"
ALL_PATHS = -1  # the queue of a one-queue batcher (module batching): requests of every path batch together


class BatchObserver(Protocol):
    """What a batcher reports as it runs (the server's metrics)."""

    def queue_depth(self, depth: int) -> None: ...

    def decode_step(self, rows: int) -> None: ...

    def row_finished(self, path: int, row: DecodeRow) -> None: ...


@dataclass(eq=False)
class Ticket:
    """A submitted request: ``future`` resolves with ``result(row)`` once its row has ended."""

    path: int
    row: DecodeRow
    result: Callable[[DecodeRow], Any]
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


class PathBatcher:
    """Per-path request queues and the worker threads that decode them in batches."""

    def __init__(self, run_batch: Callable[[int, list[DecodeRow], Admit, OnStep | None], None],
                 max_batch: int = DEFAULT_MAX_BATCH,
                 batch_wait_s: float = DEFAULT_BATCH_WAIT_MS / 1000, workers: int = DEFAULT_DECODE_WORKERS,
                 observer: BatchObserver | None = None, one_queue: bool = False) -> None:
        if max_batch < 1:
            raise DipacoError(f"--max-batch must be >= 1, got {max_batch}")
        if not batch_wait_s >= 0:
            raise DipacoError(f"--batch-wait-ms must be >= 0, got {batch_wait_s * 1000:g}")
        if workers < 1:
            raise DipacoError(f"--decode-workers must be >= 1, got {workers}")
        self.run_batch = run_batch
        self.workers = workers
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.observer = observer
        self.one_queue = one_queue
        self._queues: dict[int, deque[Ticket]] = {}
        self._decoding: set[int] = set()  # paths a worker is decoding now
        self._waiting = 0
        self._closed = False
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._work, name=f"dipaco-batch-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    # --- the callers' side ----------------------------------------------------------------------
    def submit(self, path: int, row: DecodeRow, result: Callable[[DecodeRow], Any] = lambda row: row) -> Ticket:
        ticket = Ticket(path, row, result)
        row.path = path  # a module batch runs each row on its own path
        row.on_finish = lambda finished: self._resolve(ticket)
        with self._cond:
            if self._closed:
                raise DipacoError("the server is shutting down")
            self._queues.setdefault(self._queue_of(path), deque()).append(ticket)
            self._set_waiting(self._waiting + 1)
            self._cond.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client is gone: out of its queue if it still waits, else dropped from its batch at the next step."""
        with self._cond:
            queue = self._queues.get(self._queue_of(ticket.path))
            if queue is not None and ticket in queue:
                queue.remove(ticket)
                self._set_waiting(self._waiting - 1)
                waiting = True
            else:
                waiting = False
        ticket.row.cancel()
        if waiting:
            ticket.row.finish(FINISH_CANCELLED)

    @property
    def waiting(self) -> int:
        """Requests queued for a batch (not yet decoding)."""
        return self._waiting

    def close(self, timeout: float = 10.0) -> None:
        """Stops the workers after their current batches; requests still queued fail with an error."""
        with self._cond:
            self._closed = True
            left = [t for queue in self._queues.values() for t in queue]
            self._queues.clear()
            self._set_waiting(0)
            self._cond.notify_all()
        for ticket in left:
            if not ticket.future.done():
                ticket.future.set_exception(DipacoError("the server is shutting down"))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    # --- the workers' side ----------------------------------------------------------------------
    def _queue_of(self, path: int) -> int:
        return ALL_PATHS if self.one_queue else path

    def _set_waiting(self, n: int) -> None:
        self._waiting = n
        if self.observer is not None:
            self.observer.queue_depth(n)

    def _resolve(self, ticket: Ticket) -> None:
        if self.observer is not None:
            self.observer.row_finished(ticket.path, ticket.row)
        if ticket.future.done():
            return
        try:
            ticket.future.set_result(ticket.result(ticket.row))
        except Exception as exc:  # the caller's result function failed: its request reports it
            ticket.future.set_exception(exc)

    def _due_batch(self, now: float) -> tuple[tuple[int, list[Ticket]] | None, float | None]:
        """The batch to decode now, if one is due; else how long until the next one is (None: none waits)."""
        ready = sorted((queue[0].enqueued, path) for path, queue in self._queues.items()
                       if queue and path not in self._decoding)
        wake = None
        for enqueued, path in ready:
            queue = self._queues[path]
            due = enqueued + self.batch_wait_s
            if len(queue) >= self.max_batch or now >= due:
                batch = [queue.popleft() for _ in range(min(len(queue), self.max_batch))]
                self._set_waiting(self._waiting - len(batch))
                self._decoding.add(path)
                return (path, batch), None
            wake = due - now if wake is None else min(wake, due - now)
        return None, wake

    def _next_batch(self) -> tuple[int, list[Ticket]] | None:
        with self._cond:
            while not self._closed:
                batch, wake = self._due_batch(time.monotonic())
                if batch is not None:
                    return batch
                self._cond.wait(wake)
            return None

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._decode(*batch)
            finally:
                with self._cond:
                    self._decoding.discard(batch[0])
                    self._cond.notify_all()  # its path may have a batch due, and other workers may wait on it
                batch = None  # its requests are freed while this worker waits for the next

    def _joinable(self, path: int) -> bool:
        """Whether requests may join ``path``'s running batch: not while another path's request waits for
        a worker and none is free (it would wait for a batch that keeps growing)."""
        if len(self._decoding) < self.workers:
            return True
        return not any(queue for p, queue in self._queues.items() if p != path and p not in self._decoding)

    def _admitter(self, path: int, tickets: list[Ticket]) -> Admit:
        """The decoding loop's ``admit``: up to ``max_batch`` rows in all, from ``path``'s queue, oldest first.
        ``tickets`` keeps the batch's requests that have not ended (for :meth:`_decode`'s errors): under steady load a
        batch never drains, and a list of every request it admitted held each one's row for as long as it ran."""

        def admit(decoding: int) -> list[DecodeRow]:
            with self._cond:
                queue = self._queues.get(path)
                room = self.max_batch - decoding
                if not queue or room < 1 or not self._joinable(path):
                    return []
                joining = [queue.popleft() for _ in range(min(room, len(queue)))]
                self._set_waiting(self._waiting - len(joining))
            tickets[:] = [t for t in tickets if not t.future.done()]
            tickets.extend(joining)
            return [t.row for t in joining]

        return admit

    def _decode(self, path: int, tickets: list[Ticket]) -> None:
        on_step = None if self.observer is None else self.observer.decode_step
        try:
            self.run_batch(path, [t.row for t in tickets], self._admitter(path, tickets), on_step)
        except Exception as exc:  # every request of the batch that has not ended gets the error
            for ticket in tickets:
                if not ticket.future.done():
                    ticket.future.set_exception(exc)
