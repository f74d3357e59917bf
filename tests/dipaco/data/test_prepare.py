"""dipaco prepare: compact token ids, a bounded BPE sample, and a resume after a kill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
from tiny import corpus_source_missing, tiny_config, write_corpus_slice

import dipaco.data.prepare as prepare_module
import dipaco.data.tokenizer as tokenizer_module
from dipaco.data.prepare import load_prepared
from dipaco.errors import DataError
from dipaco.run import Run

pytestmark = pytest.mark.skipif(corpus_source_missing() is not None, reason=str(corpus_source_missing()))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus_slice(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", per_label=24)


def prepared(run_dir: Path) -> tuple[dict[str, datasets.Dataset], dict, dict]:
    info = json.loads((run_dir / "data" / "prepare.json").read_text())
    data = prepare_module._load_splits(run_dir / "data", info)
    vocab = json.loads((run_dir / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    return data, info, vocab


def counting_encoder(monkeypatch) -> dict[str, int]:
    """Counts the texts tokenized, through the encoder prepare's shards use."""
    seen = {"texts": 0}
    make = tokenizer_module._encoder

    def counted(tokenizer, *args, **kwargs):
        encode = make(tokenizer, *args, **kwargs)

        def run(batch):
            seen["texts"] += len(batch["text"])
            return encode(batch)
        return run

    monkeypatch.setattr(tokenizer_module, "_encoder", counted)
    return seen


def test_token_ids_are_uint16_and_the_summary_says_so(tmp_path, corpus):
    cfg = tiny_config(tmp_path / "run", corpus)
    info = Run(cfg).prepare()
    data, saved, _ = prepared(tmp_path / "run")
    assert data["train"].features["input_ids"].feature.dtype == "uint16"
    assert saved["format"] == 3 and saved["token_dtype"] == "uint16" == info["token_dtype"]
    assert not (tmp_path / "run" / "prepare.work").exists()  # removed once prepare succeeded


def test_the_data_is_the_tokenized_shards_not_a_copy(tmp_path, corpus, monkeypatch):
    """Format 3: data/ holds the shard files prepare.work tokenized into (linked, so the corpus is
    written once), listed in prepare.json; data in the older save_to_disk layout is still read."""
    monkeypatch.setattr(prepare_module, "TOKENIZE_SHARD_DOCS", 40)
    cfg = tiny_config(tmp_path / "run", corpus)
    Run(cfg).prepare()
    data_dir = tmp_path / "run" / "data"
    data, info, _ = prepared(tmp_path / "run")
    assert len(info["files"]["train"]) > 1
    assert sorted(p.name for p in data_dir.glob("*.arrow")) == sorted(info["files"]["train"] + info["files"]["validation"])
    assert not (data_dir / "dataset_dict.json").exists()
    assert [len(data[s]) for s in ("train", "validation")] == [info["splits"][s]["docs"] for s in ("train", "validation")]

    old = tmp_path / "old" / "data"  # what format 2 wrote: a DatasetDict saved whole
    datasets.DatasetDict(data).save_to_disk(str(old))
    (old / "prepare.json").write_text(json.dumps({**{k: v for k, v in info.items() if k != "files"}, "format": 2}))
    (old / "config.yaml").write_text((data_dir / "config.yaml").read_text())
    shutil.copytree(tmp_path / "run" / "tokenizer", tmp_path / "old" / "tokenizer")
    then = load_prepared(tmp_path / "old", cfg.data, cfg.tokenizer)
    assert then.train["input_ids"] == data["train"]["input_ids"] and then.validation["id"] == data["validation"]["id"]


def test_without_the_text_the_data_holds_the_same_tokens_in_less_disk(tmp_path, corpus):
    """data.keep_text=false: no text column, the same token ids, other prepared data (hash), and the
    prepared data is smaller; the default still hashes as data prepared before the key existed."""
    kept = tiny_config(tmp_path / "kept", corpus)
    dropped = tiny_config(tmp_path / "dropped", corpus, "data.keep_text=false")
    Run(kept).prepare()
    Run(dropped).prepare()
    (a, info_a, _), (b, info_b, _) = prepared(tmp_path / "kept"), prepared(tmp_path / "dropped")
    for split in ("train", "validation"):
        assert "text" in a[split].column_names and "text" not in b[split].column_names
        assert a[split]["input_ids"] == b[split]["input_ids"] and a[split]["id"] == b[split]["id"]
    assert info_a["prepare_hash"] != info_b["prepare_hash"]
    assert info_a["prepare_hash"] == prepare_module.prepare_hash(
        tiny_config(tmp_path, corpus).data, kept.tokenizer)

    def size(run: str) -> int:
        return sum(f.stat().st_size for f in (tmp_path / run / "data").glob("*.arrow"))
    assert size("dropped") < 0.6 * size("kept")
    with pytest.raises(DataError, match="data.keep_text: False when prepared, now True"):
        load_prepared(tmp_path / "dropped", kept.data, kept.tokenizer)
    # nothing is lost: what reads whole texts (the doc_topics fit) decodes them from the tokens
    from dipaco.route.assign import document_texts

    without = load_prepared(tmp_path / "dropped", dropped.data, dropped.tokenizer)
    assert document_texts(without.train, without, chunk=7) == a["train"]["text"]


def test_unreadable_prepared_data_is_one_clear_error(tmp_path, corpus):
    cfg = tiny_config(tmp_path / "run", corpus)
    Run(cfg).prepare()
    info_path = tmp_path / "run" / "data" / "prepare.json"
    info = json.loads(info_path.read_text())
    info_path.write_text(json.dumps({**info, "format": 99}))
    with pytest.raises(DataError, match="format 99, newer than this dipaco reads"):
        load_prepared(tmp_path / "run", cfg.data, cfg.tokenizer)
    info_path.write_text(json.dumps(info))
    (tmp_path / "run" / "data" / info["files"]["validation"][0]).write_bytes(b"not arrow")
    with pytest.raises(DataError, match="cannot read the prepared validation split"):
        load_prepared(tmp_path / "run", cfg.data, cfg.tokenizer)


def test_a_killed_prepare_resumes_from_its_finished_shards(tmp_path, corpus, monkeypatch, capsys):
    monkeypatch.setattr(prepare_module, "TOKENIZE_SHARD_DOCS", 40)
    uninterrupted = tmp_path / "whole"
    Run(tiny_config(uninterrupted, corpus)).prepare()
    assert "[prepare] tokenized train shard 1/" in capsys.readouterr().out  # a line a shard, bars or not

    real = prepare_module.tokenize_to_disk

    def killed_at_validation(ds, tokenizer, work_dir, name, **kwargs):
        if name == "validation":
            raise KeyboardInterrupt  # as a Ctrl-C or a kill between the splits
        return real(ds, tokenizer, work_dir, name, **kwargs)

    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, corpus)
    monkeypatch.setattr(prepare_module, "tokenize_to_disk", killed_at_validation)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).prepare()
    assert not (run_dir / "data").exists() and (run_dir / "prepare.work").is_dir()

    monkeypatch.setattr(prepare_module, "tokenize_to_disk", real)
    trained = []
    monkeypatch.setattr(prepare_module, "train_tokenizer", lambda *a, **k: trained.append(1))
    seen = counting_encoder(monkeypatch)
    Run(cfg).prepare()
    data, info, vocab = prepared(run_dir)
    assert not trained  # the BPE trained before the kill was reused
    assert seen["texts"] == len(data["validation"])  # only the split that had not finished was tokenized
    want, want_info, want_vocab = prepared(uninterrupted)
    assert vocab == want_vocab and info == want_info
    for split in ("train", "validation"):
        assert data[split]["id"] == want[split]["id"]
        assert data[split]["input_ids"] == want[split]["input_ids"]
    assert not (run_dir / "prepare.work").exists()


def test_a_prepare_killed_before_its_clean_up_writes_the_same_tokenizer_files_when_run_again(tmp_path, corpus,
                                                                                            monkeypatch):
    # Issue 48 (tests/dipaco/test_crash_recovery.py): a prepare killed before prepare.work's removal, run again, reused the
    # tokenizer trained there and saved it as reloaded: tokenizer_config.json gained the options it was loaded
    # with (local_files_only, is_local), so tokenizer/ differed from an uninterrupted prepare's.
    whole = tmp_path / "whole"
    Run(tiny_config(whole, corpus)).prepare()
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, corpus)
    with monkeypatch.context() as patched:
        patched.setattr(prepare_module, "remove_tree", lambda path: None)  # killed before the removal
        Run(cfg).prepare()
    assert (run_dir / "prepare.work").is_dir()
    trained = []
    monkeypatch.setattr(prepare_module, "train_tokenizer", lambda *a, **k: trained.append(1))
    Run(cfg).prepare()
    assert not trained  # the tokenizer in prepare.work was reused
    files = {p.name: p.read_bytes() for p in sorted((run_dir / "tokenizer").iterdir())}
    assert files == {p.name: p.read_bytes() for p in sorted((whole / "tokenizer").iterdir())}
    assert not (run_dir / "prepare.work").exists()


def test_a_tokenizer_marked_done_without_its_file_is_trained_again(tmp_path, corpus, monkeypatch):
    # Issue 48: prepare.work's `done` marker could outlive tokenizer.json (a removal killed midway), and the next
    # prepare failed on the missing file instead of training the tokenizer again.
    real = prepare_module.tokenize_to_disk

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    cfg = tiny_config(tmp_path / "run", corpus)
    monkeypatch.setattr(prepare_module, "tokenize_to_disk", killed)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).prepare()
    (marker,) = (tmp_path / "run" / "prepare.work").glob("*/*/done")
    (marker.parent / "tokenizer.json").unlink()
    monkeypatch.setattr(prepare_module, "tokenize_to_disk", real)
    Run(cfg).prepare()
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    assert not (tmp_path / "run" / "prepare.work").exists()


def test_the_scratch_a_killed_prepare_left_goes_with_the_next_one(tmp_path, corpus):
    """A kill -9 runs no clean-up: the scratch copy of the corpus (11 GB at 10M documents) has one fixed
    name beside the run directory, so the next prepare removes it instead of leaving it forever."""
    left = tmp_path / ".run.prepare-scratch"
    (left / "source").mkdir(parents=True)
    (left / "source" / "old.arrow").write_bytes(b"x" * 1000)
    Run(tiny_config(tmp_path / "run", corpus)).prepare()
    assert not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_bpe_trains_on_at_most_train_docs_documents(tmp_path, corpus, monkeypatch):
    counts = []
    real = prepare_module.train_tokenizer

    def counted(texts, *args, **kwargs):
        texts = list(texts)
        counts.append(len(texts))
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "train_tokenizer", counted)
    Run(tiny_config(tmp_path / "run", corpus, "tokenizer.train_docs=30")).prepare()
    Run(tiny_config(tmp_path / "all", corpus, "tokenizer.train_docs=null")).prepare()
    n_train = len(prepared(tmp_path / "all")[0]["train"])
    assert counts == [30, n_train] and n_train > 30
