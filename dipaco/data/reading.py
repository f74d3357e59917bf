"""Passes over corpus-sized files whose memory does not grow with the corpus.

A memory-mapped file costs nothing to open, but every page a pass reads stays mapped into the
process, and counted in its resident set, until the mapping is closed. One pass over a 10 GB split
through one mapping leaves 10 GB resident: page cache the kernel may drop under pressure, but the
process's peak RSS all the same, and on a machine that is short of memory, real pressure.

So the long passes here open a fresh mapping for each chunk and close it after, keeping about one
chunk's pages:

* :class:`SplitReader`: rows of a memory-mapped ``datasets`` split, through the Arrow files that hold
  those rows only;
* :class:`ChunkedArray`: an (N, D) ``.npy`` file read and written with positioned reads and writes,
  never mapped: a read keeps nothing resident, however sparse its rows.

Random access in training (``dipaco.data.packing.PackedShard``) keeps one mapping: it reads a batch
of rows per step, a bounded working set that the kernel manages.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.fingerprint import generate_random_fingerprint
from numpy.lib.format import open_memmap

RELEASE_MIN_BYTES = 256 << 20  # below this, a split's pages are few enough to keep
# Rows per record batch of the corpus and token files dipaco writes (datasets' default: 1,000; ``map`` writes a
# function's returned batch as it is, so the tokenizer encodes batches of this many rows). Opening a file
# reads every batch's header, and each header read maps a whole folio of the file (up to 2 MB here):
# with 1 MB batches, opening the 11 GB conversion of 10M documents made 750 MB of it resident.
WRITER_BATCH_ROWS = 10_000


def in_memory_dataset(table: pa.Table, info: datasets.DatasetInfo | None = None) -> datasets.Dataset:
    """A ``datasets.Dataset`` of an in-memory Arrow table, without hashing its data.

    Given no fingerprint, ``datasets.Dataset`` computes one by pickling the whole table and hashing
    the bytes: for the 10M path ids `dipaco route` writes, a 300 MB spike and 80 MB that stayed
    resident; for every 20k-row piece of a corpus that prepare reads, 4 ms a MB. Nothing caches
    transforms of these tables, so a random fingerprint (what ``datasets`` falls back to when it
    cannot hash) serves."""
    return datasets.Dataset(table, info=info, fingerprint=generate_random_fingerprint())


@dataclass(frozen=True)
class _ArrowFile:
    path: str
    first: int  # the split's row number of the file's first row
    rows: int


def _open(paths: list[str]) -> datasets.Dataset:
    parts = [datasets.Dataset.from_file(p) for p in paths]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _overlapping(files: list[_ArrowFile], start: int, stop: int) -> list[_ArrowFile]:
    """The files holding any of rows [start, stop) (start < stop)."""
    return [f for f in files if f.first < stop and start < f.first + f.rows]


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric column as a numpy array in memory, its own dtype kept; a list column of equal-length
    lists (e.g. ``paths_topk``) as a 2-d array."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        rows = column.to_numpy(zero_copy_only=False)
        return np.stack(rows).copy() if len(rows) else np.empty((0, 0), dtype=column.type.value_type.to_pandas_dtype())
    return np.array(column.to_numpy(), copy=True)


def _converted(table: pa.Table, columns: list[str], numpy: bool, list_prefix: int | None) -> dict[str, Any]:
    out = {}
    for name in columns:
        column = table.column(name)
        if list_prefix is not None and pa.types.is_list(column.type):
            column = pc.list_slice(column, 0, list_prefix)
        # numpy through Arrow: the datasets numpy format turns uint64 into int64
        out[name] = _numpy(column) if numpy else column.to_pylist()
    return out


def drop_mapped_pages(directory: str | Path) -> int:
    """Gives back the resident pages of this process's read-only maps of files under ``directory``
    (``madvise(MADV_DONTNEED)``: they stay in the page cache, and a later read faults them in again);
    returns the bytes of the maps advised, 0 where the OS has no such call (not Linux).

    Opening a prepared split reads every record batch's header through ``datasets``' own map of each
    file, and each read maps a folio around it: 71 MB of the 10M-document train split's 180 files stayed
    resident in every later job, against 11 MB at 1M. Those maps are ``datasets``', so their pages are
    dropped by address range, found in /proc/self/maps."""
    maps = Path("/proc/self/maps")
    if not hasattr(mmap, "MADV_DONTNEED") or not maps.is_file():
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    prefix = os.path.join(os.path.realpath(directory), "")
    advised = 0
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        # never a writable map: MADV_DONTNEED would discard a private map's changes
        if len(fields) < 6 or "w" in fields[1] or not fields[5].startswith(prefix):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, mmap.MADV_DONTNEED) == 0:
            advised += end - start
    return advised


def release_mappings() -> None:
    # A Dataset holds its memory map through reference cycles; collecting them closes the map now.
    gc.collect()


class SplitReader:
    """Rows of a split, each read through a mapping of only the Arrow files that hold them, closed
    after the read.

    A split whose rows are Arrow files stacked in order, as ``dipaco prepare`` writes and
    ``load_from_disk`` reads (optionally ``select()``-ed, or with columns joined beside them, as
    routing joins its path column), is read that way for the columns those files hold. Anything else
    (in memory, a slice) is read through the dataset itself: correct, without the release."""

    def __init__(self, ds: datasets.Dataset, min_bytes: int | None = None) -> None:
        """``min_bytes`` (default ``RELEASE_MIN_BYTES``): splits whose files are smaller are read in place
        (their pages are few, and each release costs a garbage collection)."""
        self.ds = ds
        size = sum(os.path.getsize(f) for f in {c["filename"] for c in ds.cache_files} if os.path.exists(f))
        least = RELEASE_MIN_BYTES if min_bytes is None else min_bytes
        self._groups = self._stacked_groups(ds) if size >= least and size > 0 else []
        # A select()ed split's row numbers, read a slice at a time (they may be a memory-mapped file of
        # 8 bytes a document: a copy in memory would grow with the corpus).
        self._indices: pa.ChunkedArray | None = ds._indices.column(0) if self._groups and ds._indices is not None else None

    @staticmethod
    def _stacked_groups(ds: datasets.Dataset) -> list[tuple[frozenset[str], list[_ArrowFile]]]:
        """The cache files grouped by their columns, each group in row order, where a group stacks to
        every row of the table.

        A table with columns joined beside it (routing's path column) lists its cache files interleaved,
        one entry per block of rows: the 180 files of a split of 10M documents came out as (train-00000,
        routing data, train-00001, routing data, ...), which no run of consecutive files stacks."""
        groups: dict[tuple[str, ...], list[_ArrowFile]] = {}
        for name in dict.fromkeys(f["filename"] for f in ds.cache_files):
            try:
                with pa.memory_map(name) as source:
                    table = pa.ipc.open_stream(source).read_all()
                    columns, rows = tuple(table.column_names), table.num_rows
                    del table
            except (OSError, pa.ArrowInvalid):
                return []
            files = groups.setdefault(columns, [])
            files.append(_ArrowFile(name, files[-1].first + files[-1].rows if files else 0, rows))
        table_rows = ds.data.num_rows
        return [(frozenset(columns), files) for columns, files in groups.items()
                if files[-1].first + files[-1].rows == table_rows]

    def files_with(self, columns: list[str]) -> list[_ArrowFile] | None:
        """The stacked files that hold ``columns`` (None: they are read through the dataset)."""
        for held, files in self._groups:
            if set(columns) <= held:
                return files
        return None

    @property
    def releases(self) -> bool:
        """Whether reads go through their own mappings (else through the dataset's own)."""
        return bool(self._groups)

    def __len__(self) -> int:
        return len(self.ds)

    def dataset(self, start: int, stop: int, columns: list[str] | None = None) -> datasets.Dataset:
        """Rows [start, stop) (of ``columns``, default all) as a dataset of their own, over a fresh
        mapping where it can: drop it (and :func:`release_mappings`) to give its pages back."""
        columns = list(self.ds.column_names) if columns is None else columns
        files = self.files_with(columns)
        if files is None or start >= stop:
            return self.ds.select_columns(columns).select(range(start, stop))
        if self._indices is None:
            files = _overlapping(files, start, stop)
            base = _open([f.path for f in files]).select_columns(columns)
            return base.select(range(start - files[0].first, stop - files[0].first))
        # Only the files the selected rows lie in: a sorted selection (a split of a corpus) reads one or two.
        rows = self._index_rows(start, stop)
        files = _overlapping(files, int(rows.min()), int(rows.max()) + 1)
        base = _open([f.path for f in files]).select_columns(columns)
        return base.select(rows - files[0].first, keep_in_memory=True)

    def rows(self, start: int, stop: int, columns: list[str], numpy: bool = False,
             list_prefix: int | None = None) -> dict[str, Any]:
        """``columns`` of rows [start, stop) as Python lists, or numpy arrays (``numpy``, for numeric
        columns); ``list_prefix``: list columns cut to their first values (a routing prefix), before any
        conversion. Nothing returned refers to the files it was read from.

        Read with pyarrow alone, each file through a memory map closed as soon as the rows are copied
        out: no ``datasets`` object, whose reference cycles only a garbage collection closes (a full
        collection per chunk cost 31 s of a 2:50 route of 1M documents)."""
        files = self.files_with(columns)
        if files is None or start >= stop:
            return _converted(self.ds.select_columns(columns).select(range(start, stop)).with_format("arrow")[:],
                              columns, numpy, list_prefix)
        if self._indices is not None:
            return _converted(self._taken(files, self._index_rows(start, stop), columns), columns, numpy, list_prefix)
        files = _overlapping(files, start, stop)
        maps = [pa.memory_map(f.path) for f in files]
        try:
            table = pa.concat_tables([pa.ipc.open_stream(m).read_all().select(columns) for m in maps])
            return _converted(table.slice(start - files[0].first, stop - start), columns, numpy, list_prefix)
        finally:
            table = None
            for m in maps:
                m.close()

    def _index_rows(self, start: int, stop: int) -> np.ndarray:
        assert self._indices is not None
        return np.asarray(self._indices.slice(start, stop - start).to_numpy(), dtype=np.int64)

    @staticmethod
    def _taken(files: list[_ArrowFile], rows: np.ndarray, columns: list[str]) -> pa.Table:
        """``columns`` of table rows ``rows`` (any order) in memory, one file mapped at a time: a sparse
        selection (the BPE's sample) would otherwise hold a page of every file it touches at once."""
        parts, found = [], []
        for f in _overlapping(files, int(rows.min()), int(rows.max()) + 1):
            mine = np.flatnonzero((rows >= f.first) & (rows < f.first + f.rows))
            if mine.size:
                with pa.memory_map(f.path) as source:  # take() copies the rows out before the map closes
                    parts.append(pa.ipc.open_stream(source).read_all().select(columns).take(rows[mine] - f.first))
                found.append(mine)
        table = pa.concat_tables(parts)
        order = np.concatenate(found)
        return table if (order[1:] > order[:-1]).all() else table.take(np.argsort(order))

    def release(self) -> None:
        """Closes the mappings of reads already dropped (a no-op for a split read in place)."""
        if self._groups:
            release_mappings()

    def chunks(self, columns: list[str], chunk: int, numpy: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
        """(first row, :meth:`rows` of [first, first + chunk)) over the split."""
        for start in range(0, len(self), chunk):
            yield start, self.rows(start, min(start + chunk, len(self)), columns, numpy)


class ChunkedArray:
    """An (N, D) ``.npy`` file read and written with plain positioned reads and writes (``os.pread``,
    ``os.pwrite``), never memory-mapped: ``x[a:b]``, ``x[rows]`` and ``x[rows] = values`` keep nothing
    resident, however sparse the rows. (Through a memory map each row read makes a whole folio of the
    file resident: the 50k rows of a k-means fit sample touch nearly every folio of 9M documents'
    4.6 GB of features.) A read returns a new array in memory."""

    ndim = 2

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            self._offset = f.tell()
        if len(shape) != 2 or fortran:
            raise ValueError(f"{self.path}: expected a C-ordered 2-d array, got shape {shape} (fortran order: {fortran})")
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._row_bytes = int(shape[1]) * self.dtype.itemsize

    @classmethod
    def at(cls, path: str | Path, offset: int, shape: tuple[int, int], dtype: Any) -> ChunkedArray:
        """The C-ordered (rows, dim) array of ``dtype`` that starts ``offset`` bytes into ``path``, a file of
        another layout (a tensor of a safetensors file)."""
        out = cls.__new__(cls)
        out.path, out._offset = Path(path), int(offset)
        out.shape, out.dtype = (int(shape[0]), int(shape[1])), np.dtype(dtype)
        out._row_bytes = out.shape[1] * out.dtype.itemsize
        if out._offset + out.shape[0] * out._row_bytes > out.path.stat().st_size:
            raise EOFError(f"{out.path}: ends before the {out.shape} array at byte {out._offset}")
        return out

    @classmethod
    def create(cls, path: str | Path, rows: int, dim: int, dtype: Any = np.float32) -> ChunkedArray:
        open_memmap(Path(path), mode="w+", dtype=dtype, shape=(rows, dim)).flush()  # header, then a sparse file
        return cls(path)

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, key: Any) -> np.ndarray | slice:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            return slice(start, max(start, stop)) if step == 1 else np.arange(start, stop, step)
        if isinstance(key, (int, np.integer)):
            raise TypeError("ChunkedArray reads rows by slice or index array, not one int")
        rows = np.asarray(key)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        rows = rows.astype(np.int64).reshape(-1)
        if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        return np.where(rows < 0, rows + len(self), rows)

    def _runs(self, rows: np.ndarray) -> Iterator[tuple[np.ndarray, int, int]]:
        """(positions in ``rows`` of first, first + 1, ..., in that order; first; count) of each run of
        consecutive rows."""
        order = np.argsort(rows, kind="stable")
        ranked = rows[order]
        breaks = np.flatnonzero(np.diff(ranked) != 1) + 1
        for part in np.split(np.arange(len(ranked)), breaks):
            if part.size:
                yield order[part], int(ranked[part[0]]), int(part.size)

    def _read(self, fd: int, first: int, count: int) -> bytes:
        want, pos, parts = count * self._row_bytes, self._offset + first * self._row_bytes, []
        while want:  # a read may return less than asked (above 2 GB on Linux)
            got = os.pread(fd, want, pos)
            if not got:
                raise EOFError(f"{self.path}: ends before row {first + count}")
            parts.append(got)
            want, pos = want - len(got), pos + len(got)
        return b"".join(parts)

    def _write(self, fd: int, block: np.ndarray, first: int) -> None:
        data, pos = memoryview(block.tobytes()), self._offset + first * self._row_bytes
        while data:  # a write may take less than given
            done = os.pwrite(fd, data, pos)
            data, pos = data[done:], pos + done

    def __getitem__(self, key: Any) -> np.ndarray:
        rows = self._rows(key)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if isinstance(rows, slice):
                data = self._read(fd, rows.start, rows.stop - rows.start)
                return np.frombuffer(data, dtype=self.dtype).reshape(-1, self.shape[1]).copy()
            out = np.empty((len(rows), self.shape[1]), dtype=self.dtype)
            for where, first, count in self._runs(rows):
                block = np.frombuffer(self._read(fd, first, count), dtype=self.dtype).reshape(count, self.shape[1])
                out[where] = block
            return out
        finally:
            os.close(fd)

    def __setitem__(self, key: Any, value: Any) -> None:
        rows = self._rows(key)
        count = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
        values = np.ascontiguousarray(np.broadcast_to(np.asarray(value, dtype=self.dtype), (count, self.shape[1])))
        fd = os.open(self.path, os.O_WRONLY)
        try:
            if isinstance(rows, slice):
                self._write(fd, values, rows.start)
                return
            for where, first, _ in self._runs(rows):
                self._write(fd, values[where], first)
        finally:
            os.close(fd)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole array in memory (for small inputs and tests)."""
        out = self[:]
        return out if dtype is None else out.astype(dtype)
