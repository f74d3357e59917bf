"""PackedShard: the rows pack_documents builds, read from a memory-mapped Arrow column on demand."""

import pickle

import datasets
import numpy as np
import pytest
import torch

from dipaco.data.packing import DocumentTokens, PackedShard, pack_documents
from dipaco.errors import DataError

EOS = 0


def random_docs(n: int, seed: int, max_len: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 4000, size=int(rng.integers(0, max_len))).tolist() for _ in range(n)]


def saved_dataset(tmp_path, docs, dtype="uint16", batch_size=7) -> datasets.Dataset:
    """``docs`` as an ``input_ids`` column written to disk in several Arrow chunks, loaded memory-mapped."""
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype))})
    ds = datasets.Dataset.from_dict({"input_ids": docs}, features=features)
    return ds.map(lambda b: b, batched=True, batch_size=batch_size, writer_batch_size=batch_size,
                  cache_file_name=str(tmp_path / "tokens.arrow"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int64"])  # int64: data prepared before format 2
@pytest.mark.parametrize("seq_len", [1, 5, 16, 64])
def test_rows_equal_pack_documents(tmp_path, dtype, seq_len):
    docs = random_docs(120, seed=seq_len)
    ds = saved_dataset(tmp_path, docs, dtype)
    assert len(ds.data.column("input_ids").chunks) > 1  # rows are found across Arrow chunks
    members = np.array(sorted(np.random.default_rng(1).choice(len(docs), 70, replace=False)))
    shard = PackedShard(DocumentTokens(ds), members, seq_len, EOS)
    expected = pack_documents([docs[i] for i in members], seq_len, EOS)
    assert shard.shape == tuple(expected.shape) and shard.numel() == expected.numel()
    assert torch.equal(shard.materialize(), expected)
    picked = torch.tensor([3, 0, len(expected) - 1, 3])
    assert torch.equal(shard[picked], expected[picked])


def test_selected_dataset_maps_rows_through_its_indices(tmp_path):
    docs = random_docs(60, seed=3)
    ds = saved_dataset(tmp_path, docs)
    kept = np.arange(0, 60, 3)
    selected = ds.select(kept)
    shard = PackedShard(DocumentTokens(selected), np.arange(len(kept)), 8, EOS)
    assert torch.equal(shard.materialize(), pack_documents([docs[i] for i in kept], 8, EOS))


def test_pickles_by_reference_to_the_files(tmp_path):
    docs = random_docs(2000, seed=4, max_len=400)
    ds = saved_dataset(tmp_path, docs, batch_size=500)
    shard = PackedShard(DocumentTokens(ds), np.arange(len(docs)), 32, EOS)
    shard[torch.tensor([0])]  # load the views: they must not travel
    payload = pickle.dumps(shard)
    tokens = sum(len(d) for d in docs)
    assert len(payload) < tokens  # far less than the 2 bytes per token the data holds
    again = pickle.loads(payload)
    assert torch.equal(again.materialize(), shard.materialize())


def test_errors_match_pack_documents(tmp_path):
    ds = saved_dataset(tmp_path, [[5, 6], [7]])
    with pytest.raises(DataError, match="empty shard"):
        PackedShard(DocumentTokens(ds), np.array([], dtype=np.int64), 4, EOS)
    with pytest.raises(DataError, match="fewer than seq_len=9"):
        PackedShard(DocumentTokens(ds), np.array([0, 1]), 9, EOS)
    with pytest.raises(DataError, match="no 'tokens' column"):
        DocumentTokens(ds, column="tokens")
    with pytest.raises(IndexError):
        PackedShard(DocumentTokens(ds), np.array([0, 1]), 2, EOS)[torch.tensor([2])]


def anonymous_mb() -> float:
    """Resident memory that is not file pages: the tokens' pages, which the OS reads ahead and may drop
    at any time, are page cache, not the process's own memory."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_memory_grows_with_what_is_read_not_with_the_shard(tmp_path):
    """A 20M-token shard (40 MB on disk, 160 MB as the LongTensor pack_documents builds): building it and
    drawing 1,000 rows from it grows the process's own memory by a few MB."""
    n_docs, doc_len = 50_000, 400
    rng = np.random.default_rng(0)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("uint16"))})

    def rows():
        for _ in range(n_docs // 1000):
            for row in rng.integers(2, 4000, size=(1000, doc_len), dtype=np.uint16):
                yield {"input_ids": row}

    ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(tmp_path / "cache"))
    before = anonymous_mb()
    shard = PackedShard(DocumentTokens(ds), np.arange(n_docs), 512, EOS)
    order = torch.randperm(shard.shape[0], generator=torch.Generator().manual_seed(0))[:1000]
    total = sum(int(shard[order[i : i + 16]].sum()) for i in range(0, 1000, 16))
    grown = anonymous_mb() - before
    assert total > 0 and shard.numel() >= 19_000_000
    assert grown < 20, f"anonymous resident memory grew {grown:.0f} MB"


def test_the_document_table_is_twelve_bytes_a_document_and_the_offsets_stay_in_the_file(tmp_path):
    """28 bytes a document before (Arrow chunk, start, length, end), and every chunk's offsets copied to
    int64: 360 MB of a 10M-document training run. Now a row number and an end; the rest is read from the
    file's offsets for the rows of a batch. Shards whose rows come in any order read the same rows."""
    docs = random_docs(3000, seed=6, max_len=60)
    ds = saved_dataset(tmp_path, docs, batch_size=50)  # 60 chunks: a document table spanning many
    tokens = DocumentTokens(ds)
    members = np.flatnonzero(np.random.default_rng(2).random(len(docs)) < 0.6)
    shard = PackedShard(tokens, members, 16, EOS)
    table = sum(a.nbytes for a in vars(shard).values() if isinstance(a, np.ndarray))
    assert table == 12 * len(members)
    assert not any(o.flags.owndata for o in tokens._loaded()[1])  # views of the column, not copies
    expected = pack_documents([docs[i] for i in members], 16, EOS)
    assert torch.equal(shard.materialize(), expected)
    shuffled = np.random.default_rng(3).permutation(members)
    assert torch.equal(PackedShard(tokens, shuffled, 16, EOS).materialize(),
                       pack_documents([docs[i] for i in shuffled], 16, EOS))
