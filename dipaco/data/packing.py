"""Token layouts: packed fixed-length training rows, and per-document evaluation windows.

Training packs a shard's documents into one stream, doc0 EOS doc1 EOS ..., cut into rows of
seq_len tokens (the last partial row is dropped). :class:`PackedShard` reads those rows from the
memory-mapped prepared data on demand, so a worker's memory does not grow with its shard;
:func:`pack_documents` builds the same rows in memory.

Evaluation scores each document on its own, so its perplexity does not depend on which other
documents share its path. Token j of a document is a *scored target* iff j >= prefix_tokens and
j >= 1: the first prefix_tokens tokens are the routing context, never scored for any model, and
token 0 has nothing to be predicted from. Labels follow the HF causal-LM convention: the loss at
position i predicts input_ids[i] from the tokens before it, and -100 means "not scored".

A document longer than seq_len is cut into windows of at most seq_len tokens that overlap by one
token (stride seq_len - 1). Every scored token is then a target in exactly one window, with its
preceding token in the same window; the shared first token of a later window is context only.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch

from dipaco.data.reading import SplitReader
from dipaco.errors import ConfigError, DataError

IGNORE_INDEX = -100  # label of a position that is not scored (torch/HF cross-entropy convention)


# ----------------------------------------------------------------------------- training


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate docs with an EOS after each one and cut into rows: a (n_rows, seq_len) LongTensor."""
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be positive")
    if len(docs) == 0:
        raise DataError("cannot pack an empty shard (no documents)")

    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    total = int(lengths.sum()) + len(docs)  # one EOS per document
    if total < seq_len:
        raise DataError(
            f"shard has {total} tokens (with one EOS per document), fewer than seq_len={seq_len}: "
            "use more documents per shard or a shorter seq_len"
        )

    # Fill the EOS slots (each document's end, shifted by the EOS tokens before it), then the tokens.
    stream = np.empty(total, dtype=np.int64)
    eos_positions = np.cumsum(lengths + 1) - 1
    is_token = np.ones(total, dtype=bool)
    is_token[eos_positions] = False
    stream[eos_positions] = eos_id
    non_empty = [np.asarray(d, dtype=np.int64) for d in docs if len(d)]
    if non_empty:
        stream[is_token] = np.concatenate(non_empty)

    n_rows = total // seq_len
    return torch.from_numpy(stream[: n_rows * seq_len].reshape(n_rows, seq_len))


def _by_chunk(chunk: np.ndarray) -> Iterator[tuple[int, np.ndarray | slice]]:
    """(chunk, where its elements are) for each chunk in ``chunk``: one pass, not a mask per chunk (a
    shard of 2.5M documents spans thousands of chunks)."""
    if chunk.size == 0:
        return
    order = None if (chunk[1:] >= chunk[:-1]).all() else np.argsort(chunk, kind="stable")
    ordered = chunk if order is None else chunk[order]
    bounds = np.concatenate(([0], np.flatnonzero(ordered[1:] != ordered[:-1]) + 1, [chunk.size]))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        yield int(ordered[lo]), (slice(lo, hi) if order is None else order[lo:hi])


class DocumentTokens:
    """Every document's token ids, read in place from a dataset's memory-mapped Arrow column.

    Nothing is copied when it is built: a document's tokens and the column's offsets are numpy views of
    the Arrow file, which the OS pages in and out. It pickles as the dataset does (by the path of its
    files), so a shard sent to another process or machine reads the same files, e.g. on shared storage.

    Where the column comes from stacked Arrow files (a prepared split of at least
    ``dipaco.data.reading.RELEASE_MIN_BYTES``), it maps those files itself and, every
    ``RELEASE_TOKENS`` tokens gathered, tells the OS it no longer needs their pages
    (``madvise(MADV_DONTNEED)``: they leave the process and stay in the page cache). Random reads over
    a large corpus otherwise leave a page resident for every read: the process would grow with the
    steps trained until it held the whole corpus."""

    RELEASE_TOKENS = 1 << 14  # 8 batches of 16 x 128: a few MB of pages on Linux, 256 MB where a touch maps 2 MB

    def __init__(self, ds: datasets.Dataset, column: str = "input_ids") -> None:
        if column not in ds.column_names:
            raise DataError(f"the dataset has no {column!r} column (columns: {', '.join(ds.column_names)})")
        self._ds = ds
        self._column = column
        self._views: tuple[list[np.ndarray], list[np.ndarray], np.ndarray] | None = None
        self._maps: list[mmap.mmap] = []
        self._gathered = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": None, "_maps": [], "_gathered": 0}

    def _loaded(self) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Per Arrow chunk: its flat token values and its offsets into them (views, nothing copied); and
        each chunk's first row of the table."""
        if self._views is None:
            self._views = self._mapped_files() or self._in_place()
        return self._views

    def _in_place(self) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        chunks = self._ds.data.column(self._column).chunks
        values = [c.values.to_numpy(zero_copy_only=False) for c in chunks]
        offsets = [c.offsets.to_numpy(zero_copy_only=False) for c in chunks]
        return values, offsets, np.cumsum([0] + [len(c) for c in chunks])

    def _mapped_files(self) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray] | None:
        """The column's chunks read from its own maps of the stacked files (None: not such a split)."""
        files = SplitReader(self._ds).files_with([self._column])
        if files is None or not hasattr(mmap, "MADV_DONTNEED"):
            return None
        values, offsets, rows, maps = [], [], [0], []
        for f in files:
            with open(f.path, "rb") as handle:
                maps.append(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
            for batch in pa.ipc.open_stream(pa.py_buffer(maps[-1])):
                column = batch.column(self._column)
                values.append(column.values.to_numpy(zero_copy_only=False))
                offsets.append(column.offsets.to_numpy(zero_copy_only=False))
                rows.append(rows[-1] + len(column))
            maps[-1].madvise(mmap.MADV_DONTNEED)  # each file's header pages now, not all 180 files' at the end
        if rows[-1] != self._ds.data.num_rows:
            raise DataError(f"the {self._column!r} column's files hold {rows[-1]:,} rows, the dataset "
                            f"{self._ds.data.num_rows:,}")
        self._maps = maps
        self.release()
        return values, offsets, np.asarray(rows)

    def release(self) -> None:
        """Gives the pages of the token files back to the OS (a no-op for a column read in place)."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)
        self._gathered = 0

    @property
    def num_table_rows(self) -> int:
        """Rows of the Arrow table under the dataset (more than the dataset's own after a select())."""
        return self._ds.data.num_rows

    def table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The table's row numbers of the dataset's ``rows``: a select()ed dataset maps its rows onto its
        table's (only the rows asked for are read of that mapping)."""
        rows = np.asarray(rows, dtype=np.int64)
        indices = self._ds._indices
        if indices is None:
            return rows
        return np.asarray(indices.column(0).take(pa.array(rows)).to_numpy(), dtype=np.int64)

    def locate(self, table_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each of the table's ``table_rows``: the Arrow chunk holding it, its first token's position
        in that chunk's values, and its length (int64 each)."""
        _, offsets, first_rows = self._loaded()
        table_rows = np.asarray(table_rows, dtype=np.int64)
        chunk = np.searchsorted(first_rows, table_rows, side="right") - 1
        start = np.empty(len(table_rows), dtype=np.int64)
        length = np.empty(len(table_rows), dtype=np.int64)
        for c, where in _by_chunk(chunk):
            local = table_rows[where] - first_rows[c]
            start[where] = offsets[c][local]
            length[where] = offsets[c][local + 1] - start[where]
        return chunk, start, length

    def spans(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`locate` for the dataset's ``rows``."""
        return self.locate(self.table_rows(rows))

    def documents(self, rows: np.ndarray, dtype: type = np.int64) -> list[np.ndarray]:
        """The token ids of the dataset's ``rows``, each document an array of ``dtype`` in memory (a
        copy: nothing refers to the file)."""
        values = self._loaded()[0]
        chunk, start, length = self.spans(rows)
        docs = [values[c][s : s + n].astype(dtype) for c, s, n in zip(chunk.tolist(), start.tolist(), length.tolist())]
        self._gathered += int(length.sum())
        if self._maps and self._gathered >= self.RELEASE_TOKENS:
            self.release()
        return docs

    def gather(self, chunk: np.ndarray, position: np.ndarray) -> np.ndarray:
        """The token at ``position`` of Arrow chunk ``chunk``, elementwise, as int64."""
        values = self._loaded()[0]
        out = np.empty(len(position), dtype=np.int64)
        for c, where in _by_chunk(np.asarray(chunk)):
            out[where] = values[c][position[where]]
        self._gathered += len(position)
        if self._maps and self._gathered >= self.RELEASE_TOKENS:
            self.release()
        return out


class PackedShard:
    """The rows :func:`pack_documents` would build from a shard's documents, read from disk on demand.

    Only the shard's document table is in memory: each document's row of the Arrow table (4 bytes, 8
    past 2^31 rows) and where it ends in the packed stream (8 bytes). Where a document's tokens start in
    the file, and how many there are, is read from the column's offsets for the rows of a batch; the
    tokens stay in the memory-mapped file. Indexing it like the (n_rows, seq_len) tensor gives exactly
    that tensor's rows, so training on either is the same run."""

    ndim = 2
    _BUILD_ROWS = 1 << 20  # documents located at a time while building the table: bounded temporaries

    def __init__(self, tokens: DocumentTokens, rows: np.ndarray, seq_len: int, eos_id: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be positive")
        if len(rows) == 0:
            raise DataError("cannot pack an empty shard (no documents)")
        self.tokens, self.seq_len, self.eos_id = tokens, seq_len, eos_id
        # Filled a chunk at a time: no (N,) int64 copy of the rows beside the table (its garbage stayed in the heap)
        self._rows = np.empty(len(rows), dtype=np.int32 if tokens.num_table_rows < 2**31 else np.int64)
        self._end = np.empty(len(rows), dtype=np.int64)  # one past each document's EOS in the packed stream
        for i in range(0, len(rows), self._BUILD_ROWS):
            table_rows = tokens.table_rows(rows[i : i + self._BUILD_ROWS])
            self._rows[i : i + self._BUILD_ROWS] = table_rows
            self._end[i : i + self._BUILD_ROWS] = tokens.locate(table_rows)[2] + 1
        np.cumsum(self._end, out=self._end)
        tokens.release()  # the offsets just read: the whole column's
        total = int(self._end[-1])
        if total < seq_len:
            raise DataError(
                f"shard has {total} tokens (with one EOS per document), fewer than seq_len={seq_len}: "
                "use more documents per shard or a shorter seq_len"
            )
        self.shape = (total // seq_len, seq_len)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
        """Rows ``index`` (a 1-d sequence of row numbers) as a (len(index), seq_len) LongTensor."""
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for a shard of {self.shape[0]} rows")
        position = (rows[:, None] * self.seq_len + np.arange(self.seq_len)).reshape(-1)
        doc = np.searchsorted(self._end, position, side="right")
        begin = np.where(doc > 0, self._end[doc - 1], 0)  # the document's first position in the stream
        offset = position - begin
        is_token = offset < self._end[doc] - begin - 1  # == the document's length: its EOS
        out = np.full(position.size, self.eos_id, dtype=np.int64)
        docs, which = np.unique(doc[is_token], return_inverse=True)
        chunk, start, _ = self.tokens.locate(self._rows[docs])
        out[is_token] = self.tokens.gather(chunk[which], start[which] + offset[is_token])
        return torch.from_numpy(out.reshape(rows.size, self.seq_len))

    def materialize(self) -> torch.Tensor:
        """Every row, in memory (for tests and small shards)."""
        return self[np.arange(self.shape[0])]


# ----------------------------------------------------------------------------- evaluation


@dataclass
class EvalWindow:
    """One window of one document: tokens doc[start : start + len(input_ids)]."""

    doc_index: int
    start: int
    input_ids: torch.Tensor  # (T,), T <= seq_len
    labels: torch.Tensor  # (T,), IGNORE_INDEX where not scored in this window


@dataclass
class EvalBatch:
    input_ids: torch.Tensor  # (B, T), right-padded with pad_id
    attention_mask: torch.Tensor  # (B, T), 0 on padding
    labels: torch.Tensor  # (B, T), IGNORE_INDEX where not scored and on padding
    doc_index: torch.Tensor  # (B,), the source document of each row


def count_scored_tokens(doc_len: int, prefix_tokens: int) -> int:
    """Number of scored targets in a document: tokens j with max(prefix_tokens, 1) <= j < doc_len."""
    return max(doc_len - max(prefix_tokens, 1), 0)


def unscored_docs(docs: Sequence[Sequence[int]], prefix_tokens: int) -> list[int]:
    """Indices of documents too short to have any scored token (they get no eval windows)."""
    return [i for i, doc in enumerate(docs) if count_scored_tokens(len(doc), prefix_tokens) == 0]


def eval_windows(docs: Sequence[Sequence[int] | np.ndarray], seq_len: int, prefix_tokens: int) -> list[EvalWindow]:
    """Cut every document into windows that score each of its scored tokens exactly once.

    Documents without scored tokens (doc_len <= max(prefix_tokens, 1)) produce no window; count
    them with `unscored_docs`. Windows that would hold only routing context are skipped too.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len={seq_len} must be at least 2 to score a token from its predecessor")
    if prefix_tokens < 0:
        raise ConfigError(f"prefix_tokens={prefix_tokens} must be >= 0")

    windows = []
    first_scored = max(prefix_tokens, 1)
    for doc_index, doc in enumerate(docs):
        if count_scored_tokens(len(doc), prefix_tokens) == 0:
            continue
        tokens = torch.as_tensor(doc, dtype=torch.long)
        for start in _window_starts(len(tokens), seq_len):
            window = tokens[start : start + seq_len]
            labels = window.clone()
            # Position 0 of a window has no context inside it: the first window's token 0 is never
            # scored, and a later window's token 0 was scored as the last target of the previous one.
            labels[: max(first_scored - start, 1)] = IGNORE_INDEX
            if (labels != IGNORE_INDEX).any():
                windows.append(EvalWindow(doc_index=doc_index, start=start, input_ids=window, labels=labels))
    return windows


def count_eval_windows(lengths: np.ndarray | Sequence[int], seq_len: int, prefix_tokens: int) -> int:
    """``len(eval_windows(docs, seq_len, prefix_tokens))`` from the documents' lengths alone.

    A document with scored tokens has ceil((L - 1) / stride) windows (at least one), starting at
    k * stride; every one scores a token except those that end before the first scored position,
    the k with k * stride <= first_scored - seq_len."""
    if seq_len < 2:
        raise ConfigError(f"seq_len={seq_len} must be at least 2 to score a token from its predecessor")
    lengths = np.asarray(lengths, dtype=np.int64)
    first_scored, stride = max(prefix_tokens, 1), seq_len - 1
    windows = np.maximum(-(-(lengths - 1) // stride), 1)
    context_only = (first_scored - seq_len) // stride + 1 if first_scored >= seq_len else 0
    return int(np.maximum(windows - context_only, 0)[lengths > first_scored].sum())


def _window_starts(doc_len: int, seq_len: int) -> range:
    # Windows [s, s + seq_len) with s = 0, seq_len-1, 2(seq_len-1), ... until one reaches the end.
    stride = seq_len - 1
    n_windows = max(-(-(doc_len - 1) // stride), 1)  # ceil((doc_len - 1) / stride)
    return range(0, n_windows * stride, stride)


def batch_eval_windows(windows: Sequence[EvalWindow], batch_size: int, pad_id: int) -> Iterator[EvalBatch]:
    """Group windows, in order, into batches right-padded to the longest window of each batch.

    Sorting windows by length first (e.g. sorted(windows, key=lambda w: len(w.input_ids))) wastes
    less compute on padding; the scores do not change.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be positive")
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        width = max(len(w.input_ids) for w in group)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)
        labels = torch.full((len(group), width), IGNORE_INDEX, dtype=torch.long)
        for row, w in enumerate(group):
            n = len(w.input_ids)
            input_ids[row, :n] = w.input_ids
            attention_mask[row, :n] = 1
            labels[row, :n] = w.labels
        doc_index = torch.tensor([w.doc_index for w in group], dtype=torch.long)
        yield EvalBatch(input_ids=input_ids, attention_mask=attention_mask, labels=labels, doc_index=doc_index)
