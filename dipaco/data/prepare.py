"""`dipaco prepare`: corpus -> train/validation split -> tokenizer -> tokenized Arrow datasets.

Everything later jobs need from the raw text is computed once here and stored in the run
directory. Later jobs check, through a hash of the config keys that shaped it, that the prepared
data matches their own config, so a changed corpus or tokenizer setting is never silently ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerFast

from dipaco import json_text
from dipaco.atomic import remove_tree, replacing
from dipaco.config import Config, DataConfig, TokenizerConfig, config_diff, merge_config
from dipaco.data.corpus import CorpusSpec, load_corpus_with_stats
from dipaco.data.reading import SplitReader, drop_mapped_pages
from dipaco.data.tokenizer import TokenizeOptions, load_tokenizer, token_dtype, tokenize_to_disk, train_tokenizer
from dipaco.errors import ConfigError, DataError, DipacoError
from dipaco.metrics import echo
from dipaco.run_dir import RunDir

PREPARE_INFO = "prepare.json"
# 3: each split is the tokenized shard files themselves (``<split>-NNNNN.arrow``, listed in prepare.json),
#    hard-linked from prepare.work instead of copied by ``save_to_disk``: no second copy of the corpus
#    on disk or in the page cache. 2: a ``save_to_disk`` DatasetDict, token ids uint16/uint32
#    (:func:`dipaco.data.tokenizer.token_dtype`); 1 (no format): the same with int64 ids. All are read.
DATA_FORMAT = 3
_DONE = "done"  # marks a finished step in prepare.work
TOKENIZE_SHARD_DOCS = 50_000  # documents per tokenized shard: what a killed prepare redoes at most
_NOT_PREPARE_KEYS = ("seq_len", "prefix_tokens", "num_proc")  # not what the data is: later jobs', or speed
_OUTPUT_KEYS = ("keep_text",)  # what prepare writes of the corpus, not what the corpus is


def corpus_spec(data: DataConfig) -> CorpusSpec:
    fields = {k: v for k, v in asdict(data).items() if k not in (*_NOT_PREPARE_KEYS, *_OUTPUT_KEYS)}
    fields["source"] = fields.pop("corpus")
    return CorpusSpec(**fields)


def check_data(data: DataConfig) -> None:
    """The ``data`` section's values (the corpus reader checks the rest when it loads)."""
    if data.seq_len <= 0:
        raise ConfigError(f"data.seq_len: must be > 0, got {data.seq_len}")
    if not 0.0 < data.validation_fraction < 1.0:
        raise ConfigError(f"data.validation_fraction: must be in (0, 1), got {data.validation_fraction}")
    if data.num_proc is not None and data.num_proc < 1:
        raise ConfigError(f"data.num_proc: must be >= 1 or null (automatic), got {data.num_proc}")
    if not 0 <= data.prefix_tokens < data.seq_len:
        raise ConfigError(f"data.prefix_tokens: must be in [0, data.seq_len={data.seq_len}), got {data.prefix_tokens}")


def check_tokenizer(tokenizer: TokenizerConfig) -> None:
    if tokenizer.vocab_size <= 0:
        raise ConfigError(f"tokenizer.vocab_size: must be > 0, got {tokenizer.vocab_size}")
    if tokenizer.train_docs is not None and tokenizer.train_docs <= 0:
        raise ConfigError(f"tokenizer.train_docs: must be > 0 or null (all), got {tokenizer.train_docs}")


def prepare_hash(data: DataConfig, tokenizer: TokenizerConfig) -> str:
    corpus = asdict(corpus_spec(data))
    corpus.pop("hub")  # permission to use the hub, not a property of the data
    corpus.pop("streaming")  # how it is read, not what it is
    if corpus["csv_columns"] is None:  # keys added later hash as before while unset
        corpus.pop("csv_columns")
    tokenizer_keys = asdict(tokenizer)
    if tokenizer.train_docs == TokenizerConfig.train_docs:  # data prepared before the key existed still matches
        tokenizer_keys.pop("train_docs")
    payload: dict = {"corpus": corpus, "tokenizer": tokenizer_keys}
    if not data.keep_text:  # only when set: data prepared before the key existed still matches
        payload["keep_text"] = False
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Prepared:
    tokenizer: PreTrainedTokenizerFast
    train: datasets.Dataset
    validation: datasets.Dataset
    info: dict


def prepare(run_dir: str | Path, data: DataConfig, tokenizer_cfg: TokenizerConfig, config_yaml: str,
            progress: bool = True) -> dict:
    """Builds ``data/`` and ``tokenizer/`` in the run directory; returns the summary it writes.
    ``config_yaml``: the run's resolved config, kept next to the data it shaped.

    Memory does not grow with the corpus: the corpus is read into memory-mapped Arrow files batch by
    batch, the BPE is trained on a bounded sample (``tokenizer.train_docs``), and the token ids are
    written shard by shard. The trained tokenizer and every finished shard are kept in
    ``<run.dir>/prepare.work`` until the end, so a killed prepare run again picks up where it stopped."""
    check_data(data)
    check_tokenizer(tokenizer_cfg)
    run = RunDir(run_dir)
    echo(f"[prepare] loading corpus {data.corpus!r}")
    start = time.perf_counter()
    with _scratch(run) as scratch:
        # before the run directory: a bad corpus leaves none
        corpus, stats = load_corpus_with_stats(corpus_spec(data), scratch)
        echo(f"[prepare] {len(corpus['train']):,} train / {len(corpus['validation']):,} validation documents "
             f"({time.perf_counter() - start:.0f}s)")
        run.root.mkdir(parents=True, exist_ok=True)
        work = _work_dir(run, f"{prepare_hash(data, tokenizer_cfg)}-{stats.fingerprint}")
        # Written next to the old tokenizer and data and swapped at the end: a failure never destroys a good prepare.
        with replacing(run.tokenizer) as tmp_tok, replacing(run.data) as tmp_data:
            tokenizer = _tokenizer(tokenizer_cfg, corpus["train"], work / "tokenizer", progress)
            _write_tokenizer(tokenizer, None if tokenizer_cfg.path else work / "tokenizer", tmp_tok)
            tokenizing = time.perf_counter()
            tokenized = {
                split: tokenize_to_disk(corpus[split], tokenizer, work / "tokens", split,
                                        log=lambda line: echo(f"[prepare] {line}"),
                                        options=TokenizeOptions(tokenizer_processes(data.num_proc, len(corpus[split])),
                                                                TOKENIZE_SHARD_DOCS, keep_text=data.keep_text))
                for split in ("train", "validation")}
            info = _summary(tokenized, tokenizer, data, tokenizer_cfg, stats.n_skipped_empty)
            seconds = time.perf_counter() - tokenizing
            tokens = sum(s["tokens"] for s in info["splits"].values())
            processes = tokenizer_processes(data.num_proc, len(corpus["train"]))
            echo(f"[prepare] tokenized {tokens:,} tokens in {seconds:.0f}s ({tokens / max(seconds, 1e-9):,.0f} tokens/s, "
                 f"{processes} process{'es' if processes > 1 else ''}); writing {run.data}")
            info["files"] = _link_shards(tokenized, tmp_data)
            (tmp_data / PREPARE_INFO).write_text(json_text.dumps(info, indent=2))
            (tmp_data / "config.yaml").write_text(config_yaml)
    remove_tree(run.prepare_work)
    for split, s in info["splits"].items():
        echo(f"[prepare] {split}: {s['docs']:,} docs, {s['tokens']:,} tokens")
    short = info["validation_docs_within_prefix"]
    if short:
        echo(f"[prepare] note: {short} validation docs have <= {data.prefix_tokens} tokens (all routing prefix) "
             f"and score no tokens")
    echo(f"[prepare] wrote {run.data} and {run.tokenizer} in {time.perf_counter() - start:.0f}s")
    return info


@contextmanager
def _scratch(run: RunDir) -> Iterator[Path]:
    """``.<run dir name>.prepare-scratch`` beside the run directory, removed after. Not in the system temp
    dir: it holds a copy of the corpus, and /tmp is often small, or a tmpfs whose files live in memory.
    One fixed name, so what a killed prepare left there (11 GB at 10M documents) goes with the next one."""
    parent = run.root.resolve().parent
    scratch = (parent if parent.is_dir() else Path(tempfile.gettempdir())) / f".{run.root.name}.prepare-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _link_shards(tokenized: dict[str, list[Path]], out: Path) -> dict[str, list[str]]:
    """Puts each split's tokenized shard files into ``out`` as ``<split>-NNNNN.arrow``, hard-linked (copied
    where the file system cannot link): prepare.work keeps its files until the new data is in place."""
    out.mkdir(parents=True)
    files = {}
    for split, shards in tokenized.items():
        files[split] = [f"{split}-{i:05d}.arrow" for i in range(len(shards))]
        for shard, name in zip(shards, files[split]):
            try:
                os.link(shard, out / name)
            except OSError:
                shutil.copyfile(shard, out / name)
    return files


def _load_splits(data_dir: Path, info: dict) -> dict[str, datasets.Dataset]:
    """The prepared splits of any data format (see ``DATA_FORMAT``), memory-mapped."""
    fmt = info.get("format", 1)
    if fmt > DATA_FORMAT:
        raise DataError(f"{data_dir}: prepared data format {fmt}, newer than this dipaco reads ({DATA_FORMAT}); "
                        f"upgrade dipaco or rerun `dipaco prepare`")
    if fmt < 3:
        return dict(datasets.load_from_disk(str(data_dir)))
    splits = {}
    for split, names in info["files"].items():
        try:
            parts = [datasets.Dataset.from_file(str(data_dir / name)) for name in names]
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"{data_dir}: cannot read the prepared {split} split ({exc}); rerun `dipaco prepare`") from None
        splits[split] = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        if len(splits[split]) != info["splits"][split]["docs"]:
            raise DataError(f"{data_dir}: the {split} split has {len(splits[split]):,} documents, prepare.json says "
                            f"{info['splits'][split]['docs']:,}; rerun `dipaco prepare`")
    return splits


def tokenizer_processes(num_proc: int | None, docs: int) -> int:
    """``data.num_proc``, or when null: one process on a machine of up to 4 cores, where the Rust
    tokenizer's own threads already use every core (measured on 2 cores: the speed of 2 processes at a
    quarter of their memory); else one per core for a split of 10,000 documents or more (a forked
    worker tokenizes on one thread, and starting the processes costs more than a small split takes)."""
    if num_proc is not None:
        return num_proc
    cores = os.cpu_count() or 1
    return cores if cores > 4 and docs >= 10_000 else 1


def _work_dir(run: RunDir, key: str) -> Path:
    """``prepare.work/<key>``: the finished steps of an earlier, killed prepare of the same config and
    corpus are reused; those of any other are removed."""
    if run.prepare_work.is_dir():
        for old in run.prepare_work.iterdir():
            if old.name == key:
                continue
            if old.name.startswith("."):  # what a killed removal left: already out of the way
                shutil.rmtree(old, ignore_errors=True)
            else:
                remove_tree(old)
    work = run.prepare_work / key
    if work.is_dir():
        echo(f"[prepare] resuming: reusing the finished steps in {work}")
    return work


def _tokenizer(cfg: TokenizerConfig, train: datasets.Dataset, saved: Path, progress: bool) -> PreTrainedTokenizerFast:
    """``tokenizer.path``'s tokenizer, or a byte-level BPE trained on at most ``tokenizer.train_docs``
    training documents (a fixed random sample, kept in corpus order); one trained by an earlier, killed
    run of this prepare is reused."""
    if cfg.path:
        return load_tokenizer(cfg.path)
    if (saved / _DONE).is_file() and (saved / "tokenizer.json").is_file():
        return load_tokenizer(saved)
    sample = train
    if cfg.train_docs is not None and cfg.train_docs < len(train):
        rows = np.sort(np.random.default_rng(0).choice(len(train), cfg.train_docs, replace=False))
        sample = train.select(rows)
    echo(f"[prepare] training a byte-level BPE tokenizer, vocab {cfg.vocab_size}, on {len(sample):,} documents")
    texts = (text for _, batch in SplitReader(sample).chunks(["text"], 1000) for text in batch["text"])
    tokenizer = train_tokenizer(texts, cfg.vocab_size, saved, show_progress=progress,
                                log=lambda line: echo(f"[prepare] {line}"))
    (saved / _DONE).touch()
    return tokenizer


def _write_tokenizer(tokenizer: PreTrainedTokenizerFast, trained: Path | None, out: Path) -> None:
    """The run's ``tokenizer/``: the files the BPE training wrote into ``trained`` (prepare.work), copied as they
    are, so a prepare that reuses the tokenizer a killed one trained writes the same bytes as one that trained it
    (the reloaded tokenizer, saved, added the options it was loaded with to tokenizer_config.json); a
    ``tokenizer.path`` tokenizer (``trained`` None) is saved."""
    if trained is None:
        tokenizer.save_pretrained(out)
        return
    out.mkdir(parents=True)
    for path in sorted(trained.iterdir()):
        if path.is_file() and path.name != _DONE:
            shutil.copyfile(path, out / path.name)


def _shard_lengths(shards: list[Path]) -> tuple[np.ndarray, list[str]]:
    """``num_tokens`` of every document of a split's shard files, and their columns; one file open at a time."""
    lengths, columns = [], []
    for path in shards:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
            lengths.append(np.array(table.column("num_tokens").to_numpy(), dtype=np.int64))
            columns = table.column_names
            del table
    return np.concatenate(lengths), columns


def _summary(tokenized: dict[str, list[Path]], tokenizer: PreTrainedTokenizerFast, data: DataConfig,
             tokenizer_cfg: TokenizerConfig, skipped: int) -> dict[str, Any]:
    num_tokens, columns = {}, {}
    for split, shards in tokenized.items():
        num_tokens[split], columns[split] = _shard_lengths(shards)
    return {
        "prepare_hash": prepare_hash(data, tokenizer_cfg),
        "format": DATA_FORMAT,
        "vocab_size": len(tokenizer),
        "token_dtype": token_dtype(len(tokenizer)),
        "splits": {split: {"docs": len(n), "tokens": int(n.sum())} for split, n in num_tokens.items()},
        "skipped_empty_docs": skipped,
        "validation_docs_within_prefix": int((num_tokens["validation"] <= data.prefix_tokens).sum()),
        "has_labels": "label" in columns["train"],
    }


def _prepared_diff(data: DataConfig, tokenizer: TokenizerConfig, saved: Path) -> str:
    """`` (key: prepared value vs this config's value; ...)`` over the keys that shape the prepared data."""
    try:
        prepared_cfg = merge_config(saved)
    except DipacoError:
        return f" (see {saved})"
    then = Config(data=prepared_cfg.data, tokenizer=prepared_cfg.tokenizer)
    diff = [
        line for line in config_diff(then, Config(data=data, tokenizer=tokenizer), ignore=())
        if line.startswith(("data.", "tokenizer."))
        and line.split(":", 1)[0] not in {f"data.{k}" for k in (*_NOT_PREPARE_KEYS, "hub", "streaming")}
    ]
    if not diff:
        return f" (see {saved})"
    return " (" + "; ".join(d.replace(" -> ", " when prepared, now ", 1) for d in diff) + f"; see {saved})"


def load_prepared(run_dir: str | Path, data: DataConfig, tokenizer: TokenizerConfig) -> Prepared:
    """The prepared data of ``run_dir``, checked to come from these ``data``/``tokenizer`` settings.
    The routed copies of the splits (with a ``path`` column) come from :func:`dipaco.route.shards.with_routing`."""
    run = RunDir(run_dir)
    info_path = run.data / PREPARE_INFO
    if not info_path.is_file():
        raise DataError(f"{run.data}: no prepared data; run `dipaco prepare` with this config first")
    info = json.loads(info_path.read_text())
    if info["prepare_hash"] != prepare_hash(data, tokenizer):
        raise DataError(
            f"{run.data} was prepared with different data/tokenizer settings than this config"
            f"{_prepared_diff(data, tokenizer, run.data / 'config.yaml')}; rerun `dipaco prepare` or use the same config"
        )
    splits = _load_splits(run.data, info)
    drop_mapped_pages(run.data)  # the headers opening them read: tens of MB at 10M documents
    return Prepared(load_tokenizer(run.tokenizer), splits["train"], splits["validation"], info)
