"""The server hands its allocator's free memory back (dipaco.serve.heap): the trimmer itself, and a served app
whose freed heap memory leaves its RSS within two trims (issue 76)."""

from __future__ import annotations

import http.client
import os
import time

import numpy as np
import pytest
import torch
from test_serve import needs_web, running

from dipaco.errors import DipacoError
from dipaco.serve.heap import HeapTrimmer, glibc_malloc_trim
from dipaco.serve.http import AppOptions, create_app
from dipaco.serve.pipeline import Pipeline

TRIM_S = 0.2


@pytest.fixture(scope="module")
def pipe(served_run):
    needs_web()
    return Pipeline.from_run(served_run.run.dir, cache_size=4)


def wait_for(check, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_trimmer_calls_trim_every_interval_until_closed():
    trimmer = HeapTrimmer(0.01, trim=lambda: True)
    trimmer.start()
    wait_for(lambda: trimmer.trims >= 3)
    trimmer.close()
    done = trimmer.trims
    time.sleep(0.05)
    assert trimmer.trims == done >= 3 and trimmer.seconds >= 0
    assert "every 0.01 s" in trimmer.describe()


def test_an_interval_of_zero_starts_nothing():
    trimmer = HeapTrimmer(0, trim=lambda: True)
    trimmer.start()
    assert trimmer._thread is None and not trimmer.active and trimmer.describe() == "heap trim off"
    trimmer.close()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_a_bad_interval_is_refused_by_name(bad):
    with pytest.raises(DipacoError, match="--heap-trim-s must be a finite number of seconds >= 0"):
        HeapTrimmer(bad)


def test_glibc_trim_is_found_on_glibc():
    if os.confstr("CS_GNU_LIBC_VERSION") is None:
        pytest.skip("not glibc")
    trim = glibc_malloc_trim()
    assert trim is not None and trim() in (True, False)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def fragment_the_heap(total_mb: int = 96) -> list:
    """What varied decoding batches leave in glibc's heap, on purpose: tensors of many small sizes (below malloc's
    mmap threshold, so they come from the heap), all freed but one in 64 and the last one, which pins the heap's top
    so that free() alone returns nothing. Returns the survivors (keep them alive)."""
    rng = np.random.default_rng(0)
    made, size = [], 0
    while size < total_mb * 2**20:
        n = int(rng.integers(1_000, 15_000))  # float32 elements: 4-60 KB
        made.append(torch.ones(n))
        size += 4 * n
    kept = made[::64] + [made[-1]]
    del made
    return kept


def test_the_server_hands_freed_heap_memory_back(pipe):
    """A varied load's tensors, freed in the middle of glibc's heap, stay in the process's RSS until malloc_trim: the
    server trims every --heap-trim-s (the growth of issue 76's per-path soak; malloc_trim gave it all back)."""
    if glibc_malloc_trim() is None:
        pytest.skip("not glibc")
    app = create_app(pipe, AppOptions(batching="path", heap_trim_s=TRIM_S))
    with running(app):
        heap = app.state.heap
        wait_for(lambda: heap.trims >= 1)
        base = rss_mb()
        kept = fragment_the_heap()
        grown = rss_mb()
        seen = heap.trims
        wait_for(lambda: heap.trims >= seen + 2)
        trimmed = rss_mb()
    assert len(kept) > 1 and grown - base > 60  # the pattern did fill the heap
    assert trimmed - base < 0.5 * (grown - base), (base, grown, trimmed)
    assert f"every {TRIM_S:g} s" in heap.describe()


def test_heap_trims_are_metrics(pipe):
    app = create_app(pipe, AppOptions(heap_trim_s=TRIM_S))
    with running(app) as port:
        wait_for(lambda: app.state.heap.trims >= 1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    assert "dipaco_heap_trims_total" in text and "dipaco_heap_trim_seconds_total" in text
