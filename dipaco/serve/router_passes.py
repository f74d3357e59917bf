"""The router's passes in the server: the prompts waiting at once share one pass, run in this process or in a
process of its own.

An LM-prefix router (``routing.featurize``) scores a prompt from a dense forward of the pretrained model over its
first ``prefix_tokens`` tokens: one prefill for every routed request. Run one request at a time, a burst of
requests (a batch's rows finish together, and their clients ask again together) waited in line for it: on the
4x4 benchmark run a routed request spent 10.8 ms in routing and more waiting for a planning thread, out of the
decoding batch all the while. :class:`RouterBatcher` takes every prompt waiting when the router frees up into
one pass, and one forward per prompt length in it (16 prompts of 32 tokens: 11.3 ms in one forward, 38.6 ms one
by one). With ``dipaco serve --router-process`` (the default) the forward runs in a child process
(:class:`RouterProcess`), so its Python (most of a small model's forward) does not hold the interpreter lock the
decoding loop needs, and ``--router-cpus`` (by default the last CPU, when there are two or more) puts that
process on CPUs of its own and the server off them, so that it does not take the decoding thread's CPU either;
docs/notes/2026-11-29-router-passes.md and docs/notes/2026-11-29-default-placement.md have the measurements.

Guarantee: a prompt's scores do not depend on what else is routed with it. Prompts share a forward only when
they have the same number of tokens, so no row is padded and every row's products are its own; that the
matrix kernels give a row the same bits whatever the number of rows is checked, not assumed
(``tests/dipaco/serve/test_router_passes.py``; on a device where it failed, ``--router-batch 1`` routes one
prompt a pass). The child process computes the same function on weights read from the same files, at the
same precision and, when it has as many CPUs, number of torch threads, so its scores are the in-process ones bit
for bit. Placed on fewer CPUs it runs fewer threads; torch does not promise the same bits then, and the tests
check that a router process on one CPU routes every prompt as the server's own forward does.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.errors import DipacoError
from dipaco.model.pretrained import load_pretrained
from dipaco.precision import Precision, resolve_precision
from dipaco.run_dir import RunDir
from routing.featurize import pool_prefix_states

ScoreMany = Callable[[list[list[int]]], list[torch.Tensor]]  # prompts' token ids -> each one's path scores


@torch.inference_mode()
def lm_prefix_features(model: LlamaForCausalLM, featurizer: dict, prefixes: torch.Tensor,
                       precision: Precision) -> torch.Tensor:
    """(N, D) float32 on the CPU: the router's LM-prefix features of N token sequences of one length, the mean
    of the hidden states ``featurizer`` names, pooled by ``routing.featurize.pool_prefix_states`` as
    ``lm_prefix_features`` does for a corpus (which also moves the model and flips train/eval on every call:
    too slow per request)."""
    layers = [int(layer) for layer in featurizer.get("layers", [-1])]
    x = prefixes.to(precision.device)
    mask = torch.ones_like(x)
    with precision.autocast():
        if layers == [-1]:
            # The base model's last_hidden_state (after the final norm) is the causal LM's hidden_states[-1];
            # skipping the LM head and the per-layer states saves their compute.
            states = (model.base_model(input_ids=x, attention_mask=mask).last_hidden_state,)
        else:
            states = model(input_ids=x, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states
    return pool_prefix_states(states, mask, layers, int(featurizer.get("skip_tokens", 0))).cpu()


def lm_prefix_scores(router, model: LlamaForCausalLM, batch: Sequence[Sequence[int]],
                     precision: Precision) -> list[torch.Tensor]:
    """(num_paths,) float32 for each prompt of ``batch``: ``router``'s score of every path. Prompts whose
    routing prefixes have one length share a forward; each is scored against the centroids alone."""
    k = int(router.featurizer.get("prefix_tokens", 32))
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(batch):
        by_length[min(len(ids), k)].append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
    for n, rows in by_length.items():
        prefixes = torch.tensor([list(batch[i][:n]) for i in rows], dtype=torch.long)
        features = lm_prefix_features(model, router.featurizer, prefixes, precision)
        for row, i in enumerate(rows):
            # One row at a time: the distance matmul over a batch does not give a row the bits it gets alone
            # (the forward does), and it is a small part of the pass.
            out[i] = router.scores(features[row:row + 1])[0]
    return out


# --- the passes ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterOptions:
    """How a server runs an LM-prefix router: its forward in a child process (``in_child``), and the prompts one
    pass scores at most (``batch``)."""

    in_child: bool = False
    batch: int = 16
    cpus: tuple[int, ...] | None = None  # the child's CPUs (``--router-cpus``); None: wherever the OS puts it


def router_cpus(text: str, in_child: bool) -> tuple[int, ...] | None:
    """``dipaco serve --router-cpus``: ``auto`` (the default) is the last CPU this process may use, when it may use
    two or more and the router has a process of its own; ``none`` leaves both where the OS puts them; anything
    else is a list for :func:`parse_cpus`. On the 2-core benchmark machine a routed load had 0.59 of a pinned load's
    throughput unplaced, 0.92 placed (docs/notes/2026-11-29-default-placement.md)."""
    if text == "none":
        return None
    if text == "auto":
        allowed = os.sched_getaffinity(0)
        return (max(allowed),) if in_child and len(allowed) >= 2 else None
    if not in_child:
        raise DipacoError("--router-cpus places the router process: it needs --router-process (the default), "
                          "not --no-router-process")
    return parse_cpus(text)


def parse_cpus(text: str, option: str = "--router-cpus") -> tuple[int, ...]:
    """``--router-cpus`` (or another ``option``): a list of CPU numbers and ranges, ``"1"``, ``"2,3"`` or
    ``"2-5,7"``, as ``taskset -c`` takes it; each CPU must exist on this machine."""
    cpus: set[int] = set()
    for item in text.split(","):
        low, _, high = item.strip().partition("-")
        if not (low.isdigit() and (high.isdigit() or not high)) or (high and int(high) < int(low)):
            raise DipacoError(f"{option} {text!r}: expected CPU numbers and ranges such as 1 or 2-3,5")
        cpus.update(range(int(low), int(high or low) + 1))
    count = os.cpu_count() or 1
    if max(cpus) >= count:
        raise DipacoError(f"{option} {text!r}: this machine has CPUs 0-{count - 1}")
    return tuple(sorted(cpus))


@dataclass
class Routing:
    """An experiment's router as the pipeline runs it: an LM-prefix router's model in this process (``model``) or
    the process it runs in (``process``); neither for a router that runs no model."""

    router: Any  # routing.router.Router
    model: LlamaForCausalLM | None = None
    process: RouterProcess | None = None
    batch: int = 16


@dataclass
class RouterStats:
    """The router's passes, the prompts they scored, and their time: summed over passes, and summed over
    requests from asking to the answer (waiting included)."""

    requests: int = 0
    passes: int = 0
    pass_seconds: float = 0.0
    request_seconds: float = 0.0


class RouterBatcher:
    """Routes prompts on one thread of its own: each pass takes every prompt waiting (up to ``max_rows``) and
    scores them with one ``score_many`` call; a caller waits for its own scores."""

    def __init__(self, score_many: ScoreMany, max_rows: int = 16) -> None:
        if max_rows < 1:
            raise DipacoError(f"--router-batch must be >= 1, got {max_rows}")
        self.score_many = score_many
        self.max_rows = max_rows
        self.stats = RouterStats()  # written by the router's thread only
        self._waiting: queue.SimpleQueue[tuple[list[int], Future, float] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="dipaco-router", daemon=True)
        self._thread.start()

    def scores(self, ids: list[int]) -> torch.Tensor:
        """The scores of every path for one prompt's token ids (raises what the pass raised)."""
        answer: Future = Future()
        self._waiting.put((list(ids), answer, time.perf_counter()))
        return answer.result()

    def _serve(self) -> None:
        while (first := self._waiting.get()) is not None:
            batch = [first]
            while len(batch) < self.max_rows:
                try:
                    item = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # closing: answer these, then stop
                    self._run(batch)
                    return
                batch.append(item)
            self._run(batch)

    def _run(self, batch: list[tuple[list[int], Future, float]]) -> None:
        start = time.perf_counter()
        try:
            results = self.score_many([ids for ids, _, _ in batch])
        except BaseException as exc:  # noqa: BLE001  (each waiting caller gets it; the thread goes on)
            for _, answer, _ in batch:
                answer.set_exception(exc)
            return
        done = time.perf_counter()
        self.stats.passes += 1
        self.stats.requests += len(batch)
        self.stats.pass_seconds += done - start
        self.stats.request_seconds += sum(done - asked for _, _, asked in batch)
        for (_, answer, _), scores in zip(batch, results):
            answer.set_result(scores)

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join()


# --- the child process -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterSource:
    """What a router process loads: everything here pickles, no weights travel."""

    run_root: str
    num_paths: int
    llama_config: LlamaConfig  # the pretrained model's shape, checked on loading as in the server
    device: str
    precision: str
    threads: int  # torch's intra-op threads: the server's, so the products sum in one order (at most one a CPU of cpus)
    cpus: tuple[int, ...] | None = None  # where the child runs (os.sched_setaffinity); None: anywhere


# The child's router, model and precision, set once by _start (the pool's one worker runs one task at a time).
_loaded: tuple | None = None
_failure: BaseException | None = None


def _start(source: RouterSource) -> None:
    global _loaded, _failure
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which closes this process
    # A server killed outright cannot close it, and the pool's queue keeps a writer open here, so its end never
    # comes as end-of-file: leave when the parent's sentinel says it is gone.
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent.sentinel,), name="dipaco-router-parent", daemon=True).start()
    # No more threads than CPUs: two OpenMP threads on one CPU wait on each other at every parallel region.
    torch.set_num_threads(source.threads if source.cpus is None else min(source.threads, len(source.cpus)))
    try:
        if source.cpus is not None:
            _run_on(source.cpus)
        from dipaco.route.artifact import load_router

        router = load_router(RunDir(source.run_root), source.num_paths)
        device = torch.device(source.device)
        model = load_pretrained(RunDir(source.run_root).pretrain, source.llama_config).to(device).eval()
        _loaded = (router, model, resolve_precision(source.precision, device, "--precision"))
    except BaseException as exc:  # noqa: BLE001  (raised again by the first pass: a failed initializer
        _failure = exc  # would only break the pool, and its message would be lost)


def _run_on(cpus: tuple[int, ...]) -> None:
    """Pins this process to ``cpus``: a router on CPUs of its own does not take the decoding thread's."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        allowed = sorted(os.sched_getaffinity(0))
        raise DipacoError(f"--router-cpus {','.join(map(str, cpus))}: the router process cannot run there ({exc}); "
                          f"this process may use CPUs {allowed}") from None


def leave_cpus(cpus: tuple[int, ...]) -> tuple[int, ...] | None:
    """Moves this process off ``cpus`` (the router's) when it may run elsewhere: every thread it has, and so every
    thread it starts later, and torch's intra-op threads down to the CPUs left when they were more. With only the
    router held to its CPUs the decoding thread still met its forward there: a routed load had 0.61 of a pinned
    load's throughput on the 2-core benchmark machine, 0.90 with the server moved off them
    (docs/notes/2026-11-29-module-batch-kernels.md). Returns the CPUs this process now runs on, or None when
    ``cpus`` are all it may use (it stays)."""
    rest = tuple(sorted(os.sched_getaffinity(0) - set(cpus)))
    if not rest:
        return None
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(int(task), rest)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(min(torch.get_num_threads(), len(rest)))
    return rest


def _exit_with(parent_sentinel: int) -> None:
    multiprocessing.connection.wait([parent_sentinel])
    os._exit(0)


def _score_many(batch: list[list[int]]) -> list[list[float]]:
    if _failure is not None:
        raise _failure
    assert _loaded is not None
    router, model, precision = _loaded
    return [scores.tolist() for scores in lm_prefix_scores(router, model, batch, precision)]


class RouterProcess:
    """The LM-prefix router's forward in a child process, started with ``spawn`` (the server has threads, and
    a forked copy of torch's thread pools can hang; like every ``spawn`` user, a script that starts one needs
    the ``if __name__ == "__main__":`` guard). Loading happens here, so a bad run fails at start-up; a
    child that dies (killed, out of memory) is started again once, for the pass that found it gone."""

    def __init__(self, source: RouterSource) -> None:
        self.source = source
        self._pool = self._new_pool()
        self.score_many([[0]])  # waits for the child to load, and raises what loading raised

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
                                   initargs=(self.source,))

    def score_many(self, batch: list[list[int]]) -> list[torch.Tensor]:
        try:
            values = self._pool.submit(_score_many, batch).result()
        except BrokenProcessPool:
            self._pool.shutdown(wait=False)
            self._pool = self._new_pool()
            try:
                values = self._pool.submit(_score_many, batch).result()
            except BrokenProcessPool:
                raise RuntimeError("the router process stopped twice in a row; see the server's log") from None
        return [torch.tensor(v, dtype=torch.float32) for v in values]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def router_source(run_root: str | Path, num_paths: int, llama_config: LlamaConfig, device: torch.device,
                  precision: str, cpus: tuple[int, ...] | None = None) -> RouterSource:
    return RouterSource(str(run_root), num_paths, llama_config, str(device), precision, torch.get_num_threads(), cpus)
