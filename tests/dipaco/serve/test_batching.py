"""PathBatcher's scheduling, with a stand-in decoder: which requests share a batch, cancelling, errors."""

import gc
import threading
import time
import weakref

import pytest

from dipaco.errors import DipacoError
from dipaco.serve.batching import PathBatcher
from dipaco.serve.decode import DecodeRow


class Recorder:
    """A run_batch that records each batch as (path, rows) and ends every row with one token."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.batches: list[tuple[int, list[DecodeRow]]] = []
        self.hold = hold
        self.started = threading.Event()

    def __call__(self, path: int, rows: list[DecodeRow], admit=None, on_step=None) -> None:
        self.batches.append((path, rows))
        self.started.set()
        if self.hold is not None:
            self.hold.wait(10)
        for row in rows:
            if row.cancelled:
                row.finish("cancelled")
                continue
            row.tokens.append(path)
            row.finish("length")


def row() -> DecodeRow:
    return DecodeRow([1, 2], max_new_tokens=1)


def test_requests_of_one_path_within_the_window_share_a_batch_up_to_max_batch():
    decoder = Recorder()
    batcher = PathBatcher(decoder, max_batch=3, batch_wait_s=0.2, workers=2)
    try:
        # Every request is queued before a worker looks (it waits for this lock): a pause of this thread longer
        # than the window, which a loaded machine gives, would otherwise close a window on fewer requests.
        with batcher._cond:
            tickets = [batcher.submit(path, row()) for path in (0, 1, 0, 0, 0, 1)]
        for t in tickets:
            assert t.future.result(5).tokens == [t.path]
    finally:
        batcher.close()
    sizes = sorted((path, len(rows)) for path, rows in decoder.batches)
    assert sizes == [(0, 1), (0, 3), (1, 2)]  # path 0: a full batch of 3 at once, then the one left over
    assert batcher.waiting == 0


def test_max_batch_one_is_the_unbatched_server():
    decoder = Recorder()
    batcher = PathBatcher(decoder, max_batch=1, batch_wait_s=3600.0, workers=1)
    try:
        tickets = [batcher.submit(0, row()) for _ in range(4)]
        assert all(t.future.result(60) for t in tickets)  # a batch of one is due at once: no hour's window to wait for
    finally:
        batcher.close()
    assert [len(rows) for _, rows in decoder.batches] == [1, 1, 1, 1]


def test_a_busy_path_gathers_its_next_batch_while_other_paths_decode():
    hold = threading.Event()
    decoder = Recorder(hold)
    batcher = PathBatcher(decoder, max_batch=8, batch_wait_s=0.0, workers=2)
    try:
        first = batcher.submit(0, row())
        assert decoder.started.wait(5)
        queued = [batcher.submit(0, row()) for _ in range(3)]
        other = batcher.submit(1, row())
        deadline = time.monotonic() + 5
        while len(decoder.batches) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [p for p, _ in decoder.batches] == [0, 1]  # path 1 decodes beside path 0's batch
        assert batcher.waiting == 3
        hold.set()
        assert all(t.future.result(5) for t in [first, other, *queued])
    finally:
        hold.set()
        batcher.close()
    assert sorted(len(rows) for path, rows in decoder.batches if path == 0) == [1, 3]


def test_a_cancelled_request_leaves_its_queue_and_never_decodes():
    hold = threading.Event()
    decoder = Recorder(hold)
    batcher = PathBatcher(decoder, max_batch=8, batch_wait_s=0.0, workers=1)
    try:
        busy = batcher.submit(0, row())
        assert decoder.started.wait(5)
        gone, kept = batcher.submit(0, row()), batcher.submit(0, row())
        batcher.cancel(gone)
        assert gone.future.result(5).finish_reason == "cancelled" and batcher.waiting == 1
        hold.set()
        assert kept.future.result(5).finish_reason == "length" and busy.future.result(5)
    finally:
        hold.set()
        batcher.close()
    assert all(gone.row not in rows for _, rows in decoder.batches)


def test_an_error_in_a_batch_reaches_each_of_its_requests_and_the_batcher_goes_on():
    calls = []

    def failing_once(path, rows, admit, on_step):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("the model failed")
        for r in rows:
            r.tokens.append(0)
            r.finish("length")

    # Each batch is due at its two rows, never at the window's end: a pause between two submits (a loaded
    # machine) cannot split a batch.
    batcher = PathBatcher(failing_once, max_batch=2, batch_wait_s=3600.0, workers=1)
    try:
        first = [batcher.submit(0, row()) for _ in range(2)]
        for t in first:
            with pytest.raises(RuntimeError, match="the model failed"):
                t.future.result(5)
        again = [batcher.submit(0, row()) for _ in range(2)]
        assert [t.future.result(5).tokens for t in again] == [[0], [0]]
    finally:
        batcher.close()
    assert calls == [2, 2]


def test_the_result_is_computed_by_the_worker_and_close_fails_what_waits():
    batcher = PathBatcher(Recorder(), max_batch=2, batch_wait_s=0.0, workers=1)
    ticket = batcher.submit(3, row(), result=lambda r: f"text of {r.tokens}")
    assert ticket.future.result(5) == "text of [3]"
    batcher.close()
    with pytest.raises(DipacoError, match="shutting down"):
        batcher.submit(0, row())


def test_an_answered_request_is_freed_without_the_cycle_collector():
    """A row's on_finish held its ticket, which holds the row: every answered request was cyclic garbage, and the
    full collections that freed it paused a loaded server for 0.4-0.5 s once a minute (issue 62)."""
    def one_token(path, rows, admit, on_step) -> None:
        for r in rows:
            r.tokens.append(path)
            r.finish("length")

    batcher = PathBatcher(one_token, max_batch=1, batch_wait_s=0.0, workers=1)
    gc.disable()
    try:
        ticket = batcher.submit(0, row(), result=lambda r: list(r.tokens))
        assert ticket.future.result(5) == [0]
        refs = [weakref.ref(ticket), weakref.ref(ticket.row), weakref.ref(ticket.future)]
        del ticket
        deadline = time.monotonic() + 5  # the worker drops its last batch when it waits for the next
        while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()
        batcher.close()


def test_a_batch_that_never_drains_does_not_hold_the_requests_it_answered():
    """Under steady load a module batch (one queue) admits rows at every step and never ends. The batcher kept every
    ticket the running batch had admitted, and so every answered request's row, until it did: the server's memory
    grew with each request (issue 76). The stand-in decoder ends one row a step and admits the next, for 300 steps."""
    live: dict[int, weakref.ref] = {}
    steps_done = threading.Event()
    check = threading.Event()

    def continuous(path, rows, admit, on_step) -> None:
        running = list(rows)
        for step in range(300):
            deadline = time.monotonic() + 10
            while not running and not stop.is_set() and time.monotonic() < deadline:  # waited for, not raced
                running += admit(len(running)) or (time.sleep(0.001) or [])
            if step == 250:
                steps_done.set()
                check.wait(10)  # the test looks while the batch still runs
            if running:
                done = running.pop(0)
                done.tokens.append(step)
                done.finish("length")

    batcher = PathBatcher(continuous, max_batch=4, batch_wait_s=0.0, workers=1, one_queue=True)
    stop = threading.Event()

    def client() -> None:  # one request at a time, each as soon as the last is answered
        n = 0
        while not stop.is_set() and n < 400:
            ticket = batcher.submit(n % 4, row())
            live[n] = weakref.ref(ticket.row)
            ticket.future.result(10)
            n += 1

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        assert steps_done.wait(30)
        gc.collect()
        held = [n for n, ref in live.items() if ref() is not None]
        assert len(live) >= 200 and len(held) <= 8, f"{len(held)} of {len(live)} answered rows are still alive"
    finally:
        check.set()
        stop.set()
        thread.join(10)
        batcher.close()


class Stepper:
    """A run_batch of ``steps`` steps that asks ``admit`` for joiners between steps, as the decoding loop does,
    and waits for ``gate`` before its first step."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.gate = threading.Event()
        self.started = threading.Event()
        self.batches: list[tuple[int, int, int]] = []  # path, rows at the start, rows at the end

    def __call__(self, path, rows, admit, on_step):
        rows = list(rows)
        start = len(rows)
        self.started.set()
        self.gate.wait(10)
        for _ in range(self.steps):
            rows += admit(len(rows))
        self.batches.append((path, start, len(rows)))
        for r in rows:
            r.tokens.append(path)
            r.finish("length")


def test_requests_join_a_running_batch_of_their_path_unless_another_path_waits():
    stepper = Stepper()
    batcher = PathBatcher(stepper, max_batch=3, batch_wait_s=0.0, workers=1)
    try:
        first = batcher.submit(0, row())
        assert stepper.started.wait(5)
        joiners = [batcher.submit(0, row()) for _ in range(3)]
        stepper.gate.set()
        for t in [first, *joiners]:
            assert t.future.result(5)
        # Two joined the running batch (3 rows at most); the third waited for the next batch.
        assert stepper.batches == [(0, 1, 3), (0, 1, 1)]
        assert joiners[0].row.tokens == [0] and batcher.waiting == 0

        stepper.gate.clear()
        stepper.started.clear()
        busy = batcher.submit(0, row())
        assert stepper.started.wait(5)
        other, same = batcher.submit(1, row()), batcher.submit(0, row())
        stepper.gate.set()
        assert all(t.future.result(5) for t in (busy, same, other))
        # Path 1 waited for the only worker: path 0's running batch took no one, and path 1's request, the
        # oldest waiting, went next.
        assert stepper.batches[2:] == [(0, 1, 1), (1, 1, 1), (0, 1, 1)]
    finally:
        stepper.gate.set()
        batcher.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch=0), "--max-batch"), (dict(batch_wait_s=-1.0), "--batch-wait-ms"),
    (dict(batch_wait_s=float("nan")), "--batch-wait-ms"), (dict(workers=0), "--decode-workers"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(DipacoError, match=match):
        PathBatcher(Recorder(), **kwargs)
