"""Single-path inference: route a prompt, compose its path from the module bank, decode with its KV cache.

At inference only one path runs (DiPaCo section 1): the router picks it from the prompt with the
same rule that sharded the training documents, and the path is an ordinary dense
``LlamaForCausalLM`` composed from the bank of the experiment's checkpoint.

    pipe = Pipeline.from_run("runs/demo", experiment="dipaco_2x2")
    pipe.route("Shares in the bank rose")          # -> (path, scores of every path)
    pipe.generate("Shares in the bank rose", max_new_tokens=32).text

What a run directory gives the pipeline (see dipaco.run_dir): the experiment's resolved
``config.yaml``, its newest (or a given) checkpoint's ``bank.safetensors``, the tokenizer, and,
when the experiment was trained on routed shards (``train.sharding=kmeans``), the router in
``routing/router`` plus the pretrained dense model its LM-prefix featurizer runs. An experiment
sharded ``iid`` or ``column`` has no router: a caller then names the path.

Generation is :meth:`Pipeline.plan` (check, tokenize, route, seed), :meth:`Pipeline.run_batch`
(decode one or more planned rows of one path together: :mod:`dipaco.serve.decode`) and
:meth:`Pipeline.finish` (the text); ``generate`` runs them for one prompt, ``dipaco serve`` batches
the middle step (:mod:`dipaco.serve.batching`).

Threads: composed paths live in an LRU cache; each cached model has its own lock, so two batches
never decode on the same model instance at once, while batches of different paths run
in parallel. Each call tokenizes with a copy of the tokenizer that no other call uses meanwhile (a
fast tokenizer's settings are mutable shared state), taken from a pool of at most ``TOKENIZER_COPIES``
copies (a caller beyond them waits for a free one: tokenizing a prompt takes well under a millisecond),
so no lock is held while text is tokenized. The bound is a memory bound: each copy keeps its own BPE
word cache (the ``tokenizers`` library's, up to 10,000 words) for the server's life, a few MB a copy,
and a pool that grew to every concurrent caller grew the server by that much per caller (issue 62,
docs/notes/2026-11-27-serving-memory.md). The router runs on a thread of its own, each pass scoring every
prompt waiting, in this process or a child (:mod:`dipaco.serve.router_passes`); a prompt gets the same scores
whatever else is routed with it.
Sampling draws from a private ``torch.Generator`` per request, so a seeded request returns the
same text whatever else runs concurrently.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from dipaco.checkpoint.experiment import read_bank
from dipaco.checkpoint.spec import ExperimentSpec, read_spec
from dipaco.checkpoint.store import CheckpointManager, resolve_checkpoint
from dipaco.data.tokenizer import load_tokenizer
from dipaco.errors import DipacoError
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.pretrained import load_pretrained
from dipaco.model.topology import Topology
from dipaco.precision import resolve_precision
from dipaco.run_dir import RunDir
from dipaco.runtime import resolve_device
from dipaco.serve.decode import (  # noqa: F401  (SeededSampler, SafeTemperature: importable from here as before)
    Admit,
    DecodeRow,
    OnStep,
    SafeTemperature,
    SeededSampler,
    decode_batch,
    sampling_processors,
)
from dipaco.serve.module_batch import ModuleBatchedDecoder
from dipaco.serve.offsets import text_offsets
from dipaco.serve.router_passes import (
    RouterBatcher,
    RouterOptions,
    RouterProcess,
    RouterStats,
    Routing,
    lm_prefix_scores,
    router_source,
)

DEFAULT_CACHE_SIZE = 4
# Tokenizer copies a Pipeline keeps: each holds a BPE word cache of up to 10,000 words for its life, so the pool,
# not the number of concurrent callers, bounds that memory; 4 keep tokenizing off the critical path on a few cores.
TOKENIZER_COPIES = 4
EVAL_REPORT = "eval.json"


# --- the experiment of a run directory -------------------------------------------------------------
@dataclass
class LoadedExperiment:
    """What inference and export need from a run: the experiment's spec, tokenizer and the checkpoint's bank."""

    run: RunDir
    spec: ExperimentSpec
    name: str
    dir: Path
    checkpoint: Path
    tokenizer: Any
    topology: Topology
    bank: ModuleBank

    def llama_config(self, use_cache: bool = True):
        return self.spec.llama_config(use_cache)  # training turns the KV cache off; generation wants it

    def module_names(self, path: int) -> list[str]:
        return [self.topology.modules[m].name for m in self.topology.path_modules(path)]

    def check_path(self, path: int) -> int:
        if isinstance(path, bool) or not isinstance(path, int) or not 0 <= path < self.topology.num_paths:
            raise DipacoError(f"path {path!r} is not a path of {self.name}: choose 0..{self.topology.num_paths - 1}")
        return path


def resolve_experiment(run: RunDir, experiment: str | None) -> Path:
    """The experiment directory: the named one, or the only one of the run."""
    if not run.root.is_dir():
        raise DipacoError(f"run directory not found: {run.root}")
    found = [e for e in run.experiments() if (e / "config.yaml").is_file()]
    names = [e.name for e in found]
    if not found:
        raise DipacoError(f"{run.root}: no trained experiment under {run.root / 'train'}; run `dipaco train` first")
    if experiment is None:
        if len(found) > 1:
            raise DipacoError(f"{run.root} has {len(found)} experiments; choose one with --experiment: {', '.join(names)}")
        return found[0]
    if experiment not in names:
        raise DipacoError(f"{run.root}: no experiment {experiment!r}; the run has: {', '.join(names)}")
    return run.experiment(experiment)


def load_experiment(run_dir: str | Path, experiment: str | None = None, checkpoint: str | Path | None = None,
                    device: str = "cpu") -> LoadedExperiment:
    """Loads an experiment's spec (:mod:`dipaco.checkpoint.spec`), its tokenizer and the newest (or given)
    checkpoint's bank."""
    run = RunDir(run_dir)
    exp_dir = resolve_experiment(run, experiment)
    resolve_device(device)  # a clear error for an unavailable device, before loading anything
    ckpt = resolve_checkpoint(CheckpointManager(exp_dir / "checkpoints"), checkpoint)
    spec = read_spec(exp_dir)
    tokenizer = load_tokenizer(run.root / spec.tokenizer.dir)
    spec.check_tokenizer(tokenizer)
    topology = spec.build_topology()
    bank = read_bank(ckpt, topology, spec.llama_config())
    return LoadedExperiment(run, spec, exp_dir.name, exp_dir, ckpt, tokenizer, topology, bank)


# --- the router ------------------------------------------------------------------------------------
def experiment_router(loaded: LoadedExperiment):
    """The experiment's router, or None when it was not trained on routed shards."""
    from dipaco.route.artifact import load_router
    from dipaco.route.provenance import check_routing

    if not loaded.spec.routed:
        return None
    check_routing(loaded.run.root, loaded.dir, routed=True)
    return load_router(loaded.run, loaded.topology.num_paths)


# --- the LRU cache of composed paths ---------------------------------------------------------------
@dataclass
class CachedPath:
    path: int
    model: LlamaForCausalLM
    lock: threading.Lock  # held while the model generates: one request per model instance at a time


class PathCache:
    """The most recently used ``size`` composed path models.

    A miss deep-copies a template model (cheaper than initialising one) and loads the path's
    modules into it. An evicted model still in use by a request finishes its request; a later
    request for that path composes a fresh copy.
    """

    def __init__(self, bank: ModuleBank, template: LlamaForCausalLM, size: int) -> None:
        if size < 1:
            raise DipacoError(f"cache size must be >= 1, got {size}")
        self.bank = bank
        self.template = template
        self.size = size
        self._entries: OrderedDict[int, CachedPath] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, path: int) -> CachedPath:
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:
                self._entries.move_to_end(path)
                self.hits += 1
                return entry
            self.misses += 1
            model = copy.deepcopy(self.template)
            self.bank.load_path(path, model)
            entry = CachedPath(path, model, threading.Lock())
            self._entries[path] = entry
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
                self.evictions += 1
            return entry

    def cached_paths(self) -> list[int]:
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"size": self.size, "cached": list(self._entries), "hits": self.hits,
                    "misses": self.misses, "evictions": self.evictions}


# --- the pipeline ----------------------------------------------------------------------------------
@dataclass
class Generation:
    path: int
    scores: list[float] | None  # the router's score of every path (higher is better); None if the caller chose
    text: str  # the completion only (the prompt is not repeated), special tokens removed
    prompt_tokens: int
    completion_tokens: int  # generated tokens, the closing EOS included when there is one
    latency_ms: float  # routing + composing (on a cache miss) + waiting for a batch + generation + decoding
    finish_reason: str = "length"  # "stop" (EOS), "length" (max_new_tokens reached) or "cancelled" (client gone)
    seed: int | None = None  # the seed that sampling used (None for greedy decoding)
    batch_size: int = 1  # the rows decoded together with this one, itself included


@dataclass(frozen=True)
class Sampling:
    """How a request continues its prompt.

    ``temperature`` 0 is greedy decoding; above 0 it samples (with ``top_k`` > 0 and ``top_p`` < 1
    filtering), from ``seed`` when given. Generation stops at EOS or after ``max_new_tokens``;
    ``min_new_tokens`` suppresses EOS until that many tokens exist (benchmarks use it)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_new_tokens: int = 0

    def check(self, least_new_tokens: int = 1) -> None:
        """A value out of range is a DipacoError naming it. ``least_new_tokens``: 0 where the prompt's
        log-probabilities alone are an answer (echo)."""
        if self.max_new_tokens < least_new_tokens:
            raise DipacoError(f"max_new_tokens must be >= {least_new_tokens}, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise DipacoError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                              f"got {self.min_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise DipacoError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DipacoError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DipacoError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass(frozen=True)
class Scored:
    """What a row records and obeys beyond sampling (the completions API's ``logprobs``, ``echo``, ``stop``).

    ``logprobs``: each new token's log-probability with that many alternatives (None: none);
    ``prompt_logprobs``: the prompt tokens' too, which lets ``max_new_tokens`` be 0; ``stop``: strings
    that end the completion as soon as its text holds one."""

    logprobs: int | None = None
    prompt_logprobs: bool = False
    stop: tuple[str, ...] = ()


@dataclass
class PlannedGeneration:
    """A request ready to decode: routed, its path chosen, its row built (its sampler seeded)."""

    path: int
    scores: list[float] | None
    seed: int | None
    row: DecodeRow
    start: float  # time.perf_counter() when the request was planned


class Pipeline:
    def __init__(self, loaded: LoadedExperiment, routing: Routing | None = None, device: str = "cpu",
                 cache_size: int = DEFAULT_CACHE_SIZE, precision: str = "auto") -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.topology = loaded.topology
        self.bank = loaded.bank
        self.router: Any = None if routing is None else routing.router  # routing.router.Router
        # the LM-prefix router's model, when it runs in this process, or the process it runs in
        self.featurizer_model = None if routing is None else routing.model
        self.router_process = None if routing is None else routing.process
        self.device = resolve_device(device)
        self.precision = resolve_precision(precision, self.device, "--precision")
        template = build_model(loaded.llama_config(use_cache=True), seed=0, device=self.device).eval()
        self.cache = PathCache(self.bank, template, cache_size)
        self._tokenizer_template = copy.deepcopy(loaded.tokenizer)  # never used itself: only copied
        self._tokenizer_pool: list = []  # free copies; a caller takes one, tokenizes, puts it back
        self._tokenizer_copies = 0  # copies made, at most TOKENIZER_COPIES (see the module's docstring)
        self._tokenizer_free = threading.Condition()  # held only to take or put back a copy
        self.max_token_chars = max_token_chars(self.tokenizer)
        # Token ids a prompt may hold: those of both the tokenizer and the model's embedding.
        self.vocab_size = min(len(self.tokenizer), int(loaded.llama_config().vocab_size))
        self.router_batcher = None if routing is None else RouterBatcher(self._score_many, max_rows=routing.batch)
        self.router_stats = RouterStats() if self.router_batcher is None else self.router_batcher.stats
        self._module_decoder: ModuleBatchedDecoder | None = None
        self._module_decoder_lock = threading.Lock()
        self._module_batch_lock = threading.Lock()  # one module batch at a time: its caches are its own, its timers shared

    @classmethod
    def from_run(cls, run_dir: str | Path, experiment: str | None = None, checkpoint: str | Path | None = None,
                 device: str = "cpu", cache_size: int = DEFAULT_CACHE_SIZE, precision: str = "auto",
                 router: RouterOptions | None = None) -> Pipeline:
        """Loads everything up front, so a missing or bad run fails here with a DipacoError. ``router``: an
        LM-prefix router's forward in a child process of its own or here, and its pass size
        (:mod:`dipaco.serve.router_passes`; a router that runs no model ignores ``in_child`` and ``cpus``)."""
        router = router or RouterOptions()
        loaded = load_experiment(run_dir, experiment, checkpoint, device)
        found = experiment_router(loaded)
        routing = None if found is None else Routing(found, batch=router.batch)
        if routing is not None and found.featurizer.get("kind") == "lm_prefix":
            want = loaded.llama_config(use_cache=False)
            if router.in_child:
                routing.process = RouterProcess(router_source(loaded.run.root, loaded.topology.num_paths, want,
                                                              resolve_device(device), precision, router.cpus))
            else:
                routing.model = load_pretrained(loaded.run.pretrain, want).to(resolve_device(device)).eval()
        return cls(loaded, routing, device=device, cache_size=cache_size, precision=precision)

    def close(self) -> None:
        """Stops the router's thread and process (nothing else here holds an outside resource)."""
        if self.router_batcher is not None:
            self.router_batcher.close()
        if self.router_process is not None:
            self.router_process.close()

    # --- facts ---------------------------------------------------------------------------------
    @property
    def num_paths(self) -> int:
        return self.topology.num_paths

    @property
    def experiment(self) -> str:
        return self.loaded.name

    @property
    def checkpoint(self) -> str:
        return self.loaded.checkpoint.name

    def describe(self) -> dict:
        positions = self.spec.served_positions()
        return {
            "experiment": self.experiment,
            "checkpoint": self.checkpoint,
            "topology": self.topology.describe(),
            "num_paths": self.num_paths,
            "router": None if self.router is None else self.router.kind,
            "featurizer": None if self.router is None else self.router.featurizer.get("kind"),
            "sharding": self.spec.sharding.rule,
            "seq_len": self.spec.seq_len,
            # a request's prompt and new tokens together, and why (ExperimentSpec.served_positions)
            "positions": positions.limit,
            "positions_from": positions.source,
            "cache": self.cache.stats(),
        }

    def paths(self) -> list[dict]:
        """Per path: id, module names, training shard size and validation perplexity (when known)."""
        shards = self._shard_sizes()
        evaluated = self._eval_report()
        rows = []
        for p in range(self.num_paths):
            row = {"id": p, "modules": self.loaded.module_names(p), "train_docs": None, "train_tokens": None,
                   "val_docs": None, "val_ppl": None, "val_checkpoint": None}
            if shards is not None:
                row["train_docs"], row["train_tokens"] = shards["docs"][p], shards["tokens"][p]
            if evaluated is not None and p < len(evaluated.get("paths", [])):
                row["val_docs"] = evaluated["paths"][p].get("docs")
                row["val_ppl"] = evaluated["paths"][p].get("ppl")
                row["val_checkpoint"] = evaluated.get("checkpoint")
            rows.append(row)
        return rows

    def _eval_report(self) -> dict | None:
        path = self.loaded.dir / EVAL_REPORT
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except (OSError, json.JSONDecodeError):
            return None

    def _shard_sizes(self) -> dict | None:
        """Documents and tokens of each path's training shard, as training recorded them in the spec."""
        sharding = self.spec.sharding
        if len(sharding.docs) != self.num_paths or len(sharding.tokens) != self.num_paths:
            return None
        return {"docs": list(sharding.docs), "tokens": list(sharding.tokens)}

    # --- text <-> tokens -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _own_tokenizer(self):
        """A tokenizer no other caller uses until this one is done: tokenizing never waits on another request."""
        with self._tokenizer_free:
            while not self._tokenizer_pool and self._tokenizer_copies >= TOKENIZER_COPIES:
                self._tokenizer_free.wait()  # a holder never waits on anything: it is back within a tokenize call
            tokenizer = self._tokenizer_pool.pop() if self._tokenizer_pool else None
            if tokenizer is None:
                self._tokenizer_copies += 1
        if tokenizer is None:  # every copy is in use and there is room for one more (copying only reads the template)
            tokenizer = copy.deepcopy(self._tokenizer_template)
        try:
            yield tokenizer
        finally:
            with self._tokenizer_free:
                self._tokenizer_pool.append(tokenizer)
                self._tokenizer_free.notify()

    def encode(self, text: str) -> list[int]:
        """Token ids as training saw them: no special tokens added."""
        with self._own_tokenizer() as tokenizer:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_prefix(self, text: str, n_tokens: int) -> list[int]:
        """The first ``n_tokens`` of ``encode(text)``, tokenizing at most ``n_tokens * max_token_chars``
        characters of ``text`` however long it is.

        ``n_tokens`` tokens never span more characters than that (see :func:`max_token_chars`). The
        text is cut at the start of the last whitespace run before the bound: the byte-level
        pre-tokenizer never joins a non-space character to the whitespace after it, so every token
        before the cut is the whole text's. Only when those characters hold no whitespace (or too
        little text before it) is the cut made at the bound itself.
        """
        if n_tokens < 1:
            raise DipacoError(f"n_tokens must be >= 1, got {n_tokens}")
        bound = n_tokens * self.max_token_chars
        if len(text) <= bound:
            return self.encode(text)[:n_tokens]
        cut = bound
        while cut > 0 and not text[cut].isspace():
            cut -= 1
        while cut > 0 and text[cut - 1].isspace():
            cut -= 1
        ids = self.encode(text[:cut]) if cut > 0 else []
        if len(ids) < n_tokens:  # no usable whitespace: the last token read may differ from the whole text's
            ids = self.encode(text[:bound])
        return ids[:n_tokens]

    def decode(self, ids: Sequence[int]) -> str:
        with self._own_tokenizer() as tokenizer:
            return tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text, special tokens spelt out (a partial UTF-8 character reads as U+FFFD)."""
        with self._own_tokenizer() as tokenizer:
            return list(tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False))

    def text_offsets(self, ids: Sequence[int]) -> list[int]:
        """Where each token starts in ``decode(ids)``, in time linear in ``len(ids)``: a token that starts inside a
        character (split over tokens) at that character, one after bytes that never complete a character after
        their U+FFFD, a special token where the text after it starts (:mod:`dipaco.serve.offsets`)."""
        with self._own_tokenizer() as tokenizer:
            return text_offsets(tokenizer, ids)

    def routing_prefix_tokens(self) -> int | None:
        """How many leading tokens of a text the router reads (None: all of them, or no router)."""
        if self.router is None:
            return None
        if self.router.featurizer.get("kind") == "lm_prefix":
            return int(self.router.featurizer.get("prefix_tokens", 32))
        return self.spec.prefix_tokens or None

    # --- routing -------------------------------------------------------------------------------
    def route(self, text: str) -> tuple[int, list[float]]:
        """The path the router picks for ``text`` and its score for every path (higher is better).

        Only the routing prefix of ``text`` is tokenized (:meth:`routing_prefix_tokens`)."""
        n = self.routing_prefix_tokens()
        return self._route(text, self.encode(text) if n is None else self.encode_prefix(text, n))

    def _route(self, text: str, ids: list[int]) -> tuple[int, list[float]]:
        if self.router is None:
            raise DipacoError(
                f"experiment {self.experiment} was trained with train.sharding={self.spec.sharding.rule}: "
                f"it has no router, so name a path (0..{self.num_paths - 1})"
            )
        if not ids:
            raise DipacoError("cannot route an empty text: it has no tokens")
        assert self.router_batcher is not None
        scores = self.router_batcher.scores(ids)
        # Router contract: assign() is the argmax of scores() (nearest centroid, per-level nearest for
        # product k-means, best logit for the linear router); one pass instead of two.
        path = int(torch.argmax(scores))
        return path, scores.tolist()

    def _score_many(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """One router pass (:class:`RouterBatcher`): every prompt's score of every path."""
        if self.router_process is not None:
            return self.router_process.score_many(batch)
        if self.router.featurizer.get("kind") == "lm_prefix":
            return lm_prefix_scores(self.router, self.featurizer_model, batch, self.precision)
        # Like `dipaco route`, a text featurizer reads only the routing context: the first prefix_tokens tokens.
        # One prompt at a time: a corpus featurizer (TF-IDF, hashing) need not give a row the same bits in a batch.
        return [self.router.scores(self.router.featurize([self.decode(ids[: self.spec.prefix_tokens or len(ids)])])
                                   .float())[0] for ids in batch]

    # --- generation ----------------------------------------------------------------------------
    def plan(self, prompt: str, path: int | None = None, ids: list[int] | None = None,
             scoring: Scored | None = None, **sampling: Any) -> PlannedGeneration:
        """Checks the arguments, tokenizes ``prompt`` (unless its ``ids`` are given), routes it (unless
        ``path`` is given) and builds its decoding row; nothing runs the model but the router.
        ``sampling``: the fields of :class:`Sampling` (an unknown one is a TypeError); ``scoring``: the
        log-probabilities and stop strings the row records and obeys (:class:`Scored`)."""
        start = time.perf_counter()
        how = Sampling(**sampling)
        scoring = scoring or Scored()
        how.check(least_new_tokens=0 if scoring.prompt_logprobs else 1)
        seed = how.seed
        if ids is None:
            ids = self.encode(prompt)
        if not ids:
            raise DipacoError("the prompt is empty: it has no tokens to continue")
        scores = None
        if path is None and self.router is None and self.num_paths == 1:
            path = 0  # one path (a dense run): nothing to choose
        if path is None:
            path, scores = self._route(prompt, ids)
        else:
            self.loaded.check_path(path)
        processors = None
        if how.temperature > 0:
            seed = secrets.randbits(63) if seed is None else int(seed)
            processors = sampling_processors(how.temperature, how.top_p, how.top_k, seed, self.device)
        else:
            seed = None
        row = DecodeRow(list(ids), how.max_new_tokens, processors, path=path, min_new_tokens=how.min_new_tokens,
                        logprobs=scoring.logprobs, prompt_logprobs=scoring.prompt_logprobs,
                        stop=self.stop_check(scoring.stop))
        return PlannedGeneration(path, scores, seed, row, start)

    def stop_check(self, stop: Sequence[str]) -> Callable[[DecodeRow], bool] | None:
        """A row's ``stop``: whether one of the ``stop`` strings is in its completion's text. Asked after every
        token, so only the tail that a newly completed stop string can span is decoded: a string of c
        characters has at most 4c UTF-8 bytes, and every token is at least one byte."""
        if not stop:
            return None
        strings = tuple(stop)
        tail = 4 * max(len(s) for s in strings) + 1

        def stopped(row: DecodeRow) -> bool:
            text = self.decode(row.tokens[-tail:])
            return any(s in text for s in strings)

        return stopped

    def run_batch(self, path: int, rows: Sequence[DecodeRow], admit: Admit | None = None,
                  on_step: OnStep | None = None) -> None:
        """Decodes ``rows`` together on ``path``'s model (one batch at a time per cached model); ``admit``
        and ``on_step`` as :func:`dipaco.serve.decode.decode_batch` takes them."""
        entry = self.cache.get(path)
        with entry.lock, self.precision.autocast():
            decode_batch(entry.model, rows, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id,
                         admit=admit, on_step=on_step)

    @property
    def module_decoder(self) -> ModuleBatchedDecoder:
        """Every module of the bank once, for batches of rows on any paths (built on first use: embeddings and
        heads are views of the bank's weights on the CPU; the levels are one stacked copy)."""
        with self._module_decoder_lock:
            if self._module_decoder is None:
                self._module_decoder = ModuleBatchedDecoder(self.bank, self.loaded.llama_config(use_cache=True),
                                                            self.device)
            return self._module_decoder

    def run_module_batch(self, path: int, rows: Sequence[DecodeRow], admit: Admit | None = None,
                         on_step: OnStep | None = None) -> None:
        """Decodes ``rows``, each on its own path (``DecodeRow.path``), together: every level's modules run once
        per pass on the rows through them (:mod:`dipaco.serve.module_batch`). ``path`` is not used (the
        batcher's signature: a module batch holds rows of any paths)."""
        decoder = self.module_decoder
        with self._module_batch_lock, self.precision.autocast():
            decode_batch(decoder, rows, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id,
                         admit=admit, on_step=on_step)

    def finish(self, planned: PlannedGeneration) -> Generation:
        """The answer of a decoded request: its completion as text and how it ended."""
        row = planned.row
        return Generation(path=planned.path, scores=planned.scores, text=self.decode(row.tokens),
                          prompt_tokens=len(row.prompt_ids), completion_tokens=len(row.tokens),
                          latency_ms=(time.perf_counter() - planned.start) * 1000.0,
                          finish_reason=row.finish_reason or "length", seed=planned.seed, batch_size=row.batch_size)

    def generate(self, prompt: str, path: int | None = None, **sampling: Any) -> Generation:
        """Routes ``prompt`` (unless ``path`` is given), composes that path and continues the prompt as
        ``sampling`` (the fields of :class:`Sampling`) says. A batch of one row of
        :func:`dipaco.serve.decode.decode_batch`, the loop the server batches.
        """
        planned = self.plan(prompt, path=path, **sampling)
        self.run_batch(planned.path, [planned.row])
        return self.finish(planned)


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary entry.

    A byte-level BPE vocabulary spells each token with one character per byte (and has no
    normalizer), so a text of N tokens has at most N times this many UTF-8 bytes, hence characters.
    Callers bound the characters they tokenize with it.
    """
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))
