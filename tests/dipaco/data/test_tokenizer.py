import json
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
import transformers

import dipaco.data.tokenizer as tokenizer_module
from dipaco.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    TokenizeOptions,
    decode_batch,
    load_tokenizer,
    tokenize_corpus,
    tokenize_to_disk,
    train_tokenizer,
)
from dipaco.errors import ConfigError, DataError

WORDS = "the model routes each document to a path of modules trained with local outer steps".split()


def texts(n: int = 200) -> list[str]:
    # Varied short texts with repeats, so BPE has frequent pairs to merge.
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) + f" #{i}" for i in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(texts(), vocab_size=300, out_dir=out, show_progress=False)
    return out


def test_reloads_offline_with_auto_tokenizer(tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.eos_token_id != tok.pad_token_id
    assert tok.bos_token is None
    assert len(tok) == 300


def test_unicode_round_trip_without_added_special_tokens(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    text = "  Zürich → 東京, naïve café 🙂\n\ttabs\r\nand  spaces "
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids  # no BOS/EOS added by encoding
    assert tok.encode("the model", add_special_tokens=True) == tok.encode("the model", add_special_tokens=False)


def test_special_tokens_are_atomic(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert tok(EOS_TOKEN, add_special_tokens=False)["input_ids"] == [tok.eos_token_id]


def test_training_is_deterministic(tokenizer_dir, tmp_path):
    train_tokenizer(texts(), vocab_size=300, out_dir=tmp_path, show_progress=False)
    first = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    second = json.loads((tmp_path / "tokenizer.json").read_text())
    assert first["model"]["vocab"] == second["model"]["vocab"]
    assert first["model"]["merges"] == second["model"]["merges"]


def test_training_reports_reading_merging_and_the_end(tokenizer_dir, tmp_path, monkeypatch):
    """Issue 34: BPE training printed nothing off a terminal, however large the corpus."""
    import dipaco.data.tokenizer as tok

    lines: list[str] = []
    train_tokenizer(texts(), vocab_size=300, out_dir=tmp_path / "a", show_progress=False, log=lines.append)
    assert lines[0].startswith("BPE: read 200 texts in ") and lines[0].endswith("; computing the merges")
    assert lines[1].startswith("BPE: 300 tokens in ") and len(lines) == 2

    monkeypatch.setattr(tok, "LOG_EVERY_S", 0.0)  # a corpus that takes the whole interval to read
    lines.clear()
    train_tokenizer(texts(), vocab_size=300, out_dir=tmp_path / "b", show_progress=False, log=lines.append)
    assert [line.split(",")[0] for line in lines[:200]] == [f"BPE: read {i} texts" for i in range(1, 201)]
    same = json.loads((tmp_path / "b" / "tokenizer.json").read_text())["model"]
    assert same["merges"] == json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"]


def test_training_learns_merges(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    assert len(tok("the model routes")["input_ids"]) < len("the model routes")


def test_vocab_too_small_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size=100"):
        train_tokenizer(texts(), vocab_size=100, out_dir=tmp_path, show_progress=False)


def test_no_texts_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no texts"):
        train_tokenizer([], vocab_size=300, out_dir=tmp_path, show_progress=False)


def test_load_tokenizer_rejects_other_directories(tmp_path):
    with pytest.raises(DataError, match="not a tokenizer directory"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path)


def test_tokenize_corpus_adds_ids_and_lengths(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    split = {"id": ["a", "b", "c"], "text": ["the model", "", "routes 🙂 each"], "label": ["x", "y", "z"]}
    corpus = datasets.DatasetDict(train=datasets.Dataset.from_dict(split), validation=datasets.Dataset.from_dict(split))
    out = tokenize_corpus(corpus, tok, batch_size=2)
    for name in ("train", "validation"):
        ds = out[name]
        assert ds.column_names == ["id", "text", "label", "input_ids", "num_tokens"]
        for row in ds:
            assert row["input_ids"] == tok(row["text"], add_special_tokens=False)["input_ids"]
            assert row["num_tokens"] == len(row["input_ids"])
        assert ds[1]["num_tokens"] == 0

    single = tokenize_corpus(corpus["train"], tok)  # a bare Dataset works too
    assert isinstance(single, datasets.Dataset) and single["num_tokens"][:] == out["train"]["num_tokens"][:]


def test_decode_batch_is_batch_decode(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    ids = [tok(t, add_special_tokens=False)["input_ids"][:5] for t in texts(40)]
    ids += [[], [tok.eos_token_id, 5, tok.pad_token_id], ids[3] + [tok.eos_token_id]]
    assert decode_batch(tok, ids) == tok.batch_decode(ids)
    tok.clean_up_tokenization_spaces = True  # a clean-up of spaces is transformers' own: decoded through it
    assert decode_batch(tok, ids) == tok.batch_decode(ids)


def test_tokenized_shards_are_written_in_record_batches_of_writer_batch_rows(tokenizer_dir, tmp_path, monkeypatch):
    """The encoder's batches were 1,000 rows whatever the writer's: 10x the headers to read on opening."""
    tok = load_tokenizer(tokenizer_dir)
    ds = datasets.Dataset.from_dict({"id": [str(i) for i in range(2500)], "text": ["a b c"] * 2500})
    monkeypatch.setattr(tokenizer_module, "WRITER_BATCH_ROWS", 2000)
    files = tokenize_to_disk(ds, tok, tmp_path / "tokens", "train", TokenizeOptions(shard_docs=2500))
    with pa.memory_map(str(files[0])) as source:
        assert [b.num_rows for b in pa.ipc.open_stream(source)] == [2000, 500]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_tokenize_to_disk_returns_its_files_and_keeps_none_mapped(tokenizer_dir, tmp_path, monkeypatch):
    """Every open shard held pages of its metadata: at 10M documents, 180 shards held hundreds of MB."""
    tok = load_tokenizer(tokenizer_dir)
    ds = datasets.Dataset.from_dict({"id": [str(i) for i in range(25)], "text": texts(25)})
    monkeypatch.setattr(tokenizer_module, "WRITER_BATCH_ROWS", 4)  # rows per record batch: few headers to map
    files = tokenize_to_disk(ds, tok, tmp_path / "tokens", "train", TokenizeOptions(shard_docs=10))
    with pa.memory_map(str(files[0])) as source:
        assert [b.num_rows for b in pa.ipc.open_stream(source)] == [4, 4, 2]
    assert [f.name for f in files] == ["train-00000.arrow", "train-00001.arrow", "train-00002.arrow"]
    assert not any(str(tmp_path / "tokens") in line for line in Path("/proc/self/maps").read_text().splitlines())
    read = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])
    assert read["input_ids"] == tokenize_corpus(ds, tok)["input_ids"]
