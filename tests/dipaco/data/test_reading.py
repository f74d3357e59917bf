"""Chunked passes over memory-mapped splits and feature files: the same rows as reading in place, and the
pages they touch leave the process."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

import dipaco.data.reading as reading
from dipaco.data.packing import DocumentTokens, PackedShard, pack_documents
from dipaco.data.reading import ChunkedArray, SplitReader, release_mappings


def stacked_split(tmp_path: Path, files: int = 3, rows: int = 50, tokens: int = 20) -> datasets.Dataset:
    """A split that is ``files`` Arrow files stacked in order, as ``dipaco prepare`` writes one."""
    rng = np.random.default_rng(0)
    parts = []
    for f in range(files):
        flat = rng.integers(0, 500, rows * tokens)
        table = pa.table({"id": [f"{f}-{i}" for i in range(rows)],
                          "input_ids": pa.ListArray.from_arrays(pa.array(np.arange(0, rows * tokens + 1, tokens,
                                                                                    dtype=np.int32)), pa.array(flat)),
                          "num_tokens": pa.array(np.full(rows, tokens))})
        path = tmp_path / f"part-{f}.arrow"
        datasets.Dataset(table).map(lambda batch: batch, batched=True, cache_file_name=str(path))
        parts.append(datasets.Dataset.from_file(str(path)))
    return datasets.concatenate_datasets(parts)


def test_rows_and_chunks_equal_reading_in_place(tmp_path):
    ds = stacked_split(tmp_path)
    reader = SplitReader(ds, min_bytes=0)
    assert reader.releases and len(reader) == 150
    for start, stop in [(0, 150), (40, 110), (49, 51), (149, 150)]:
        assert reader.rows(start, stop, ["id", "input_ids"]) == ds.select_columns(["id", "input_ids"])[start:stop]
    counts = np.concatenate([b["num_tokens"] for _, b in reader.chunks(["num_tokens"], 64, numpy=True)])
    assert counts.dtype == np.int64 and counts.tolist() == ds["num_tokens"]
    assert [s for s, _ in reader.chunks(["id"], 64)] == [0, 64, 128]


def test_a_selected_split_is_read_through_its_row_mapping(tmp_path):
    ds = stacked_split(tmp_path)
    rows = np.random.default_rng(1).permutation(150)[:70]
    selected = ds.select(rows)
    reader = SplitReader(selected, min_bytes=0)
    assert reader.releases
    assert reader.rows(10, 60, ["id"])["id"] == [ds["id"][r] for r in rows[10:60]]
    assert reader.dataset(5, 9)["input_ids"] == selected.select(range(5, 9))["input_ids"]


def test_other_datasets_are_read_through_themselves(tmp_path):
    in_memory = datasets.Dataset.from_dict({"id": ["a", "b", "c"], "n": [1, 2, 3]})
    reader = SplitReader(in_memory, min_bytes=0)
    assert not reader.releases
    assert reader.rows(1, 3, ["id"]) == {"id": ["b", "c"]}
    assert reader.rows(0, 3, ["n"], numpy=True)["n"].tolist() == [1, 2, 3]
    big = datasets.Dataset(pa.table({"h": pa.array(np.array([2**63 + 5, 3], dtype=np.uint64)),
                                     "k": [[1, 2], [3, 4]]}))
    read = SplitReader(big, min_bytes=0).rows(0, 2, ["h", "k"], numpy=True)  # uint64 kept (a hash), lists as rows
    assert read["h"].dtype == np.uint64 and read["h"][0] == 2**63 + 5 and read["k"].tolist() == [[1, 2], [3, 4]]
    side_by_side = datasets.concatenate_datasets([stacked_split(tmp_path, files=1),
                                                   datasets.Dataset.from_dict({"path": list(range(50))})], axis=1)
    joined = SplitReader(side_by_side, min_bytes=0)  # routing joins its columns so: the file's columns still release
    assert joined.releases and joined.files_with(["id", "input_ids"]) and joined.files_with(["path"]) is None
    assert joined.rows(3, 5, ["id", "path"]) == {"id": ["0-3", "0-4"], "path": [3, 4]}
    assert joined.rows(48, 50, ["num_tokens"], numpy=True)["num_tokens"].tolist() == [20, 20]
    assert not SplitReader(side_by_side.select(range(10, 20)), min_bytes=0).releases  # a slice of the files: read in place
    assert not SplitReader(side_by_side).releases  # a small split is read in place by default


def test_a_split_of_many_files_with_routing_joined_beside_it_releases(tmp_path, monkeypatch):
    """Routing's path column, one file, joined beside a split of several: datasets lists the cache files
    interleaved (part-0, paths, part-1, paths, ...). Before the fix no group stacked, so training's token
    reads (DocumentTokens) went through the dataset's own maps and kept a few MB of every file resident:
    1.1 GB of the 10M-document train split."""
    ds = stacked_split(tmp_path)
    datasets.Dataset.from_dict({"path": [i % 4 for i in range(150)]}).save_to_disk(str(tmp_path / "routing"))
    paths = datasets.load_from_disk(str(tmp_path / "routing"))
    joined = datasets.concatenate_datasets([ds, paths], axis=1)
    assert len(joined.cache_files) > 4  # the interleaving this is about
    reader = SplitReader(joined, min_bytes=0)
    tokens = reader.files_with(["input_ids"])
    assert tokens is not None and [Path(f.path).name for f in tokens] == ["part-0.arrow", "part-1.arrow", "part-2.arrow"]
    assert [f.first for f in tokens] == [0, 50, 100]
    assert reader.files_with(["path"]) is not None and reader.files_with(["input_ids", "path"]) is None
    assert reader.rows(45, 105, ["id", "path"]) == joined.select_columns(["id", "path"])[45:105]
    monkeypatch.setattr(reading, "RELEASE_MIN_BYTES", 0)  # as a split of over 256 MB
    docs = DocumentTokens(joined)
    rows = np.array([0, 49, 50, 149])
    chunk, start, length = docs.spans(rows)
    assert docs._maps  # its own maps, whose pages it gives back
    got = [docs.gather(np.full(n, c), s + np.arange(n)).tolist() for c, s, n in zip(chunk, start, length)]
    assert got == [joined["input_ids"][int(r)] for r in rows]


def _rss_file_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@pytest.mark.skipif(_rss_file_mb() is None, reason="needs Linux's /proc/self/status RssFile")
def test_a_pass_keeps_about_one_chunk_of_pages(tmp_path):
    """The regression this module exists for: a pass through one mapping leaves every page it read
    resident; the reader's pass gives them back."""
    ds = stacked_split(tmp_path, files=4, rows=2000, tokens=2000)  # 4 x 2000 docs x 2000 int64 tokens: 128 MB
    size_mb = sum(Path(f["filename"]).stat().st_size for f in ds.cache_files) / 2**20
    release_mappings()
    before = _rss_file_mb()
    total = sum(len(b["input_ids"]) for _, b in SplitReader(ds, min_bytes=0).chunks(["input_ids"], 1000, numpy=True))
    grown = _rss_file_mb() - before
    assert total == 8000
    assert grown < size_mb / 4, f"RssFile grew {grown:.0f} MB over a {size_mb:.0f} MB pass"


def test_chunked_array_reads_and_writes_like_the_array(tmp_path):
    want = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    x = ChunkedArray.create(tmp_path / "x.npy", 40, 3)
    assert x.shape == (40, 3) and len(x) == 40 and not np.asarray(x).any()
    x[0:25] = want[0:25]
    rows = np.array([25, 30, 31, 39, 26, 27, 28, 29, 32, 33, 34, 35, 36, 37, 38])
    x[rows] = want[rows]
    assert np.array_equal(np.asarray(x), want)
    assert np.array_equal(x[5:9], want[5:9]) and np.array_equal(x[np.array([3, 1])], want[[3, 1]])
    assert np.array_equal(np.load(tmp_path / "x.npy"), want)  # an ordinary .npy file
    assert ChunkedArray(tmp_path / "x.npy").shape == (40, 3)


def test_chunked_array_reads_any_rows_without_a_memory_map(tmp_path, monkeypatch):
    """Sparse rows through a memory map make a folio of the file resident for each: the k-means sample of
    9M documents' features touches nearly all 4.6 GB. Reads and writes are positioned file calls instead."""
    want = np.random.default_rng(1).normal(size=(300, 4)).astype(np.float32)
    x = ChunkedArray.create(tmp_path / "x.npy", 300, 4)

    def no_map(*args, **kwargs):
        raise AssertionError("ChunkedArray mapped its file")

    monkeypatch.setattr(reading, "open_memmap", no_map)
    x[np.arange(299, -1, -1)] = want[::-1]  # rows in any order
    rows = np.array([7, 3, 3, 250, 8, 9, 10, 0, 299, -1])
    assert np.array_equal(x[rows], want[rows]) and np.array_equal(x[2:5], want[2:5])
    assert np.array_equal(x[want[:, 0] > 0], want[want[:, 0] > 0]) and x[5:5].shape == (0, 4)
    assert np.array_equal(x[::7], want[::7]) and np.array_equal(np.asarray(x), want)
    x[10:12] = 0.0
    assert not x[10:12].any() and np.array_equal(np.load(tmp_path / "x.npy")[12:], want[12:])
    with pytest.raises(IndexError):
        x[np.array([300])]


def test_packed_rows_are_the_same_from_the_token_files_own_maps(tmp_path, monkeypatch):
    """Training's document table maps a big split's token files itself (to release their pages) or reads
    the dataset in place (a small one): the packed rows are the rows of pack_documents either way."""
    ds = stacked_split(tmp_path, files=3, rows=40, tokens=7)
    want = pack_documents(ds["input_ids"], 16, eos_id=999)
    in_place = DocumentTokens(ds)
    in_place._loaded()
    assert not in_place._maps  # small: read in place
    monkeypatch.setattr(reading, "RELEASE_MIN_BYTES", 0)
    mapped = DocumentTokens(ds)
    mapped._loaded()
    assert len(mapped._maps) == 3
    for tokens in (in_place, mapped):
        assert torch.equal(PackedShard(tokens, np.arange(len(ds)), 16, 999).materialize(), want)
    some = np.array([3, 50, 51, 119])
    assert torch.equal(PackedShard(mapped, some, 16, 999).materialize(),
                       pack_documents([ds["input_ids"][i] for i in some], 16, eos_id=999))
    selected = ds.select([5, 2, 90])  # a select()ed split maps its rows onto the files'
    assert torch.equal(PackedShard(DocumentTokens(selected), np.arange(3), 8, 999).materialize(),
                       pack_documents(selected["input_ids"], 8, eos_id=999))


@pytest.mark.skipif(_rss_file_mb() is None, reason="needs Linux's /proc/self/status RssFile")
def test_random_training_reads_give_their_pages_back(tmp_path, monkeypatch):
    """Random rows over a big split leave a page resident per read unless released: the regression this
    guards is a trainer that grows with its steps until it holds the corpus."""
    monkeypatch.setattr(reading, "RELEASE_MIN_BYTES", 0)
    monkeypatch.setattr(DocumentTokens, "RELEASE_TOKENS", 2048)
    ds = stacked_split(tmp_path, files=4, rows=2000, tokens=2000)  # 128 MB of int64 tokens
    size_mb = sum(Path(f["filename"]).stat().st_size for f in ds.cache_files) / 2**20
    shard = PackedShard(DocumentTokens(ds), np.arange(len(ds)), 128, 0)
    release_mappings()
    before = _rss_file_mb()
    rng = np.random.default_rng(0)
    for _ in range(200):
        shard[rng.integers(0, len(shard), 16)]
    grown = _rss_file_mb() - before
    assert grown < size_mb / 2, f"RssFile grew {grown:.0f} MB over random reads of a {size_mb:.0f} MB split"


def test_rows_cut_list_columns_to_a_prefix(tmp_path):
    ds = stacked_split(tmp_path, rows=30, tokens=9)
    want = [ids[:4] for ids in ds["input_ids"]]
    for reader in (SplitReader(ds, min_bytes=0), SplitReader(ds)):  # through the files, and in place
        assert reader.rows(0, 90, ["input_ids", "id"], list_prefix=4) == {"input_ids": want, "id": list(ds["id"])}
        assert reader.rows(5, 7, ["input_ids"], numpy=True, list_prefix=2)["input_ids"].tolist() == [w[:2] for w in want[5:7]]


def test_a_selected_split_maps_only_the_files_its_rows_lie_in(tmp_path, monkeypatch):
    """A split of a corpus selects sorted rows: a chunk of it lies in one or two of the corpus's files,
    and opening all of them (as before) cost 50 maps per chunk at 10M documents."""
    ds = stacked_split(tmp_path, files=4, rows=50)
    selected = ds.select(np.arange(60, 140, 2))
    opened: list[str] = []
    real_map, real_open = pa.memory_map, reading._open
    monkeypatch.setattr(reading.pa, "memory_map", lambda path, *a: opened.append(Path(path).name) or real_map(path, *a))
    monkeypatch.setattr(reading, "_open", lambda paths: opened.extend(Path(p).name for p in paths) or real_open(paths))
    reader = SplitReader(selected, min_bytes=0)
    opened.clear()
    assert reader.rows(0, 10, ["id"])["id"] == [f"1-{i}" for i in range(10, 30, 2)]
    assert opened == ["part-1.arrow"]
    opened.clear()
    assert reader.dataset(15, 30)["id"] == [ds["id"][r] for r in range(90, 120, 2)]
    assert set(opened) == {"part-1.arrow", "part-2.arrow"}


@pytest.mark.skipif(_rss_file_mb() is None, reason="needs Linux's /proc/self/status RssFile")
def test_reading_rows_needs_no_garbage_collection(tmp_path, monkeypatch):
    """Rows are read with pyarrow alone, whose maps close when the rows are copied out: a full garbage
    collection per chunk (what closing a ``datasets`` object's map takes) cost 31 s of a 1M-document route."""
    ds = stacked_split(tmp_path, files=4, rows=2000, tokens=2000)  # 128 MB of int64 tokens
    size_mb = sum(Path(f["filename"]).stat().st_size for f in ds.cache_files) / 2**20
    reader = SplitReader(ds, min_bytes=0)
    release_mappings()
    before = _rss_file_mb()

    def no_collection(*args):
        raise AssertionError("rows() ran a garbage collection")

    monkeypatch.setattr(reading.gc, "collect", no_collection)
    total = sum(len(b["input_ids"]) for _, b in reader.chunks(["input_ids"], 1000, numpy=True))
    grown = _rss_file_mb() - before
    assert total == 8000 and grown < size_mb / 4, f"RssFile grew {grown:.0f} MB over a {size_mb:.0f} MB pass"


def test_a_sparse_selection_maps_one_file_at_a_time(tmp_path, monkeypatch):
    """The BPE's sample is a few rows of every file: reading them with every file mapped at once held a
    page of each resident together (665 MB of file pages at 10M documents)."""
    ds = stacked_split(tmp_path, files=4, rows=50)
    rows = np.array([197, 3, 120, 51, 8, 160, 77])  # every file, out of order
    reader = SplitReader(ds.select(rows), min_bytes=0)
    maps, open_at_read = [], []
    real_map, real_open = pa.memory_map, pa.ipc.open_stream
    monkeypatch.setattr(reading.pa, "memory_map", lambda path, *a: maps.append(real_map(path, *a)) or maps[-1])
    monkeypatch.setattr(reading.pa.ipc, "open_stream",
                        lambda source, *a: open_at_read.append(sum(not m.closed for m in maps)) or real_open(source, *a))
    assert reader.rows(0, 7, ["id", "input_ids"]) == {"id": [ds["id"][r] for r in rows],
                                                      "input_ids": [ds["input_ids"][r] for r in rows]}
    assert len(open_at_read) == 4 and max(open_at_read) == 1


def test_the_token_files_are_released_one_by_one_while_their_offsets_load(tmp_path, monkeypatch):
    """Loading reads every record batch's offsets: at 10M documents, a folio of each of 900 batches. Each
    file's pages are given back before the next file is mapped, not all at the end."""
    import mmap as mmap_module

    monkeypatch.setattr(reading, "RELEASE_MIN_BYTES", 0)
    ds = stacked_split(tmp_path, files=3, rows=40, tokens=7)
    events: list[str] = []

    class Recorded(mmap_module.mmap):
        def __new__(cls, *args, **kwargs):
            events.append("map")
            return super().__new__(cls, *args, **kwargs)

        def madvise(self, *args):
            events.append("release")
            return super().madvise(*args)

    monkeypatch.setattr(mmap_module, "mmap", Recorded)
    DocumentTokens(ds)._loaded()
    assert events[:6] == ["map", "release"] * 3


def test_an_in_memory_dataset_is_not_hashed(monkeypatch):
    """datasets.Dataset(table) pickles and hashes the whole table for its fingerprint: for 10M path ids,
    a 300 MB spike in `dipaco route` and 80 MB that stayed resident."""
    import tracemalloc

    ids = np.arange(4_000_000, dtype=np.int64)
    tracemalloc.start()
    ds = reading.in_memory_dataset(pa.table({"path": ids}))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # the ids are 32 MB
    assert ds["path"][:3] == [0, 1, 2] and ds._fingerprint != reading.in_memory_dataset(pa.table({"path": ids}))._fingerprint

    def hashed(*args, **kwargs):
        raise AssertionError("hashed")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", hashed)
    reading.in_memory_dataset(pa.table({"path": ids[:10]}))


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile")


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc")
def test_dropping_the_pages_of_a_loaded_split_keeps_its_data(tmp_path):
    """Opening a prepared split leaves pages of every file resident through datasets' own maps
    (71 MB of the 10M train split); drop_mapped_pages gives them back, and reads still work."""
    data = tmp_path / "data"
    data.mkdir()
    tokens = [np.arange(i % 500 + 1, dtype=np.uint16) for i in range(20_000)]
    table = pa.table({"input_ids": pa.array(tokens, type=pa.list_(pa.uint16()))})
    with pa.OSFile(str(data / "train-00000.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)
    ds = datasets.Dataset.from_file(str(data / "train-00000.arrow"))
    touched = sum(int(c.values.to_numpy().sum()) for c in ds.data.column("input_ids").chunks)  # every page
    before = _rss_file_kb()
    assert reading.drop_mapped_pages(data) >= (data / "train-00000.arrow").stat().st_size
    assert before - _rss_file_kb() > 4_000  # most of the 9.6 MB file's pages left the process
    assert sum(int(c.values.to_numpy().sum()) for c in ds.data.column("input_ids").chunks) == touched
    assert reading.drop_mapped_pages(tmp_path / "elsewhere") == 0
