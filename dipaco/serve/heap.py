"""Handing the C allocator's free memory back to the operating system while the server runs.

Why: the tensors of a decoding batch come in as many sizes as prompts have lengths and batches have rows. glibc's
malloc serves the small ones from its heaps, and memory freed in the middle of a heap stays with the process: only
the heap's top is ever returned. Under varied traffic the server's RSS therefore crept up with no object alive to
account for it, and ``malloc_trim(0)`` gave it all back (docs/notes/2026-12-04-serving-heap-trim.md). A
:class:`HeapTrimmer` calls it every ``interval_s`` seconds from a thread of its own.

- glibc only: elsewhere (musl, macOS) :func:`glibc_malloc_trim` finds nothing and the trimmer does nothing. Under
  another allocator preloaded (jemalloc, tcmalloc) glibc's heaps are idle, so a trim finds nothing to return.
- ``malloc_trim`` takes each arena's lock while it walks it: another thread's ``malloc`` can wait that long. ctypes
  releases the GIL for the call, so Python threads run on.
"""

from __future__ import annotations

import ctypes
import platform
import threading
import time
from collections.abc import Callable

from dipaco.errors import DipacoError

DEFAULT_HEAP_TRIM_S = 10.0  # `dipaco serve --heap-trim-s`; 0 turns trimming off


def glibc_malloc_trim() -> Callable[[], bool] | None:
    """``malloc_trim(0)`` of this process's glibc, true when it returned memory; None when the C library is not
    glibc or has no ``malloc_trim``."""
    if platform.libc_ver()[0] != "glibc":
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: bool(trim(0))


def check_interval(interval_s: float) -> float:
    if not (interval_s >= 0 and interval_s < float("inf")):
        raise DipacoError(f"--heap-trim-s must be a finite number of seconds >= 0 (0: off), got {interval_s}")
    return float(interval_s)


class HeapTrimmer:
    """Calls ``trim`` (default: :func:`glibc_malloc_trim`) every ``interval_s`` seconds between :meth:`start` and
    :meth:`close`. ``interval_s`` 0, or no ``trim`` on this platform, starts nothing. ``trims`` counts the calls,
    ``seconds`` their time in all (``/metrics``)."""

    def __init__(self, interval_s: float = DEFAULT_HEAP_TRIM_S, trim: Callable[[], bool] | None = None) -> None:
        self.interval_s = check_interval(interval_s)
        self.trim = trim if trim is not None else glibc_malloc_trim()
        self.trims = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.interval_s > 0 and self.trim is not None

    def describe(self) -> str:
        """For the server's start-up line."""
        if self.interval_s == 0:
            return "heap trim off"
        return f"heap trimmed every {self.interval_s:g} s" if self.trim is not None else "heap trim: not glibc, off"

    def start(self) -> None:
        if self.active and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="dipaco-heap-trim", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def trim_once(self) -> None:
        assert self.trim is not None
        start = time.perf_counter()
        self.trim()
        self.seconds += time.perf_counter() - start
        self.trims += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.trim_once()
