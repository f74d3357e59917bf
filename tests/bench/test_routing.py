"""bench/routing.py: the LM-prefix, featurizers, context and doc_topics sections run end to end on a tiny saved model."""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path

import pytest
import routing_testutil
from routing_testutil import WORDS

from bench import routing as bench


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return routing_testutil.tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_llama(tiny_tokenizer):
    return routing_testutil.tiny_llama(tiny_tokenizer)


def fake_20ng(path: Path) -> None:
    """A 20-Newsgroups-shaped file: 3 labels with their own words, Usenet headers on top."""
    groups = {"rec.pets": WORDS[:8], "sci.space": WORDS[8:16], "misc.food": WORDS[16:24]}
    with gzip.open(path, "wt") as f:
        for i in range(48):
            label = list(groups)[i % 3]
            words = groups[label]
            body = " ".join(words[(i * j) % len(words)] for j in range(1, 12))
            doc = {"source": "test", "label": label, "id": f"{label}/{i}", "split": "train" if i < 36 else "test",
                   "text": f"From: someone@example.com\nSubject: post {i}\n\n{body}\n"}
            f.write(json.dumps(doc) + "\n")
        f.write(json.dumps({"source": "test", "label": "misc.food", "id": "x", "split": "train",
                            "text": "From: a@b\n\n   \n"}) + "\n")  # empty body: dropped


def test_strip_headers():
    assert bench.strip_headers("From: a\nSubject: hi\n\nbody\n\nmore") == "body\n\nmore"
    assert bench.strip_headers("no header block") == "no header block"
    assert bench.strip_headers("From: a\nSubject: hi\n\nbody", keep_subject=True) == "Subject: hi\nbody"


def test_lm_section_on_tiny_model(tiny_llama, tiny_tokenizer, tmp_path):
    tiny_llama.save_pretrained(tmp_path / "lm")
    tiny_tokenizer.save_pretrained(tmp_path / "lm")
    fake_20ng(tmp_path / "20ng.jsonl.gz")
    out = tmp_path / "bench.json"
    res = bench.run(["--sections", "", "--data", str(tmp_path / "20ng.jsonl.gz"), "--lm-model", str(tmp_path / "lm"),
                      "--k", "3", "--seeds", "0", "--n-init", "1", "--lm-batch-size", "8", "--out", str(out)])
    lm = res["lm"]
    assert lm["docs"] == {"train": 36, "test": 12} and lm["hidden"] == 32
    assert lm["featurizer_docs_per_s"] > 0 and lm["forward_docs_per_s"] > 0
    assert {r["router"] for r in lm["rows"]} == {"lm_prefix/euclidean", "lm_prefix/cosine"}
    assert all(0.0 <= r["train_nmi"] <= 1.0 for r in lm["rows"])
    written = json.loads(out.read_text())
    assert written["lm"]["docs"]["train"] == 36
    # Paths are recorded relative to the checkout: a committed results file names no machine's folders.
    assert not Path(written["args"]["data"]).is_absolute() and not Path(written["args"]["shared_data"]).is_absolute()
    assert not Path(written["args"]["lm_model"]).is_absolute() and not Path(written["lm"]["model"]).is_absolute()
    # The machine is the harness's record; its threads, torch and cpus stay at the top, as docs/bench_routing_*.json hold them.
    assert written["command"].startswith("python -m bench routing --sections '' --data ")
    assert not any(Path(word).is_absolute() for word in shlex.split(written["command"]))  # its paths are relative too
    env = written["environment"]
    assert (written["torch_threads"], written["torch"], written["cpus"]) == (env["threads"], env["torch"], env["cpus"])


def test_a_section_without_its_tokenizer_ends_the_run_before_any_section(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:  # the 20NG file is absent: loading it first would raise otherwise
        bench.run(["--sections", "kmeans,context", "--data", str(tmp_path / "absent.jsonl.gz")])
    assert ended.value.code == 2
    assert "--sections context needs --lm-tokenizer" in capsys.readouterr().err


def test_featurizers_section_scores_every_variant_on_a_shared_corpus(tiny_llama, tiny_tokenizer, tmp_path):
    import copy

    from tokenizers import decoders

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.backend_tokenizer.decoder = decoders.WordPiece()  # decoded prefixes keep their spaces (for TF-IDF)
    tiny_llama.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    fake_20ng(tmp_path / "20ng.jsonl.gz")
    with gzip.open(tmp_path / "20ng.jsonl.gz", "rt") as f, gzip.open(tmp_path / "bbc_news.jsonl.gz", "wt") as out:
        for line in f:  # BBC-shaped: one source, labelled documents, no Usenet headers
            doc = json.loads(line)
            out.write(json.dumps({**doc, "source": "bbc", "text": bench.strip_headers(doc["text"])}) + "\n")
    res = bench.run(["--sections", "featurizers", "--shared-data", str(tmp_path), "--corpora", "bbc",
                      "--lm-model", str(tmp_path / "lm"), "--featurizer-k", "3", "--seeds", "0", "--n-init", "1",
                      "--prefix-tokens", "8", "--lm-batch-size", "8", "--tfidf-components", "4,8"])
    bbc = res["featurizers"]["corpora"]["bbc"]
    assert bbc["docs"] == 48 and bbc["labels"] == 3
    names = [r["featurizer"] for r in bbc["rows"]]
    assert names[0] == "lm raw last (default)" and "lm all layers, whiten+l2" in names and "tfidf prefix, svd 8" in names
    assert all(0.0 <= r["nmi"] <= 1.0 and r["max_min_docs"] <= 2 for r in bbc["rows"])
    assert {r["dim"] for r in bbc["rows"] if r["featurizer"].startswith("lm last")} == {32}
    raw = bbc["raw_diagnostics"]["L"]
    assert -1.0 <= raw["mean_pair_cosine"] <= 1.0 and 0.0 < raw["top1_variance"] <= raw["top5_variance"] <= 1.0


def test_context_section_shows_topic_that_only_a_longer_context_holds(tiny_tokenizer, tmp_path):
    import copy

    from tokenizers import decoders

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.backend_tokenizer.decoder = decoders.WordPiece()
    tokenizer.save_pretrained(tmp_path / "tok")
    fake_20ng(tmp_path / "20ng.jsonl.gz")
    with gzip.open(tmp_path / "20ng.jsonl.gz", "rt") as f, gzip.open(tmp_path / "bbc_news.jsonl.gz", "wt") as out:
        for i, line in enumerate(f):  # the first words say nothing of the topic: a greeting, 7 variants
            doc = json.loads(line)
            greeting = " ".join([WORDS[24 + i % 7]] * 3)
            out.write(json.dumps({**doc, "source": "bbc", "text": f"{greeting} {bench.strip_headers(doc['text'])}"}) + "\n")
    res = bench.run(["--sections", "context", "--shared-data", str(tmp_path), "--corpora", "bbc",
                      "--lm-tokenizer", str(tmp_path / "tok"), "--featurizer-k", "3", "--seeds", "0",
                      "--n-init", "2", "--tfidf-components", "4", "--context-tokens", "3,0"])
    short, whole = res["context"]["corpora"]["bbc"]["rows"]
    assert short["context_tokens"] == 3 and whole["context_tokens"] is None
    assert whole["nmi"] > 0.6 and short["nmi"] < 0.2  # purity 0.92 vs chance


def test_doc_topics_section_reads_whole_document_topics_from_a_prefix_that_barely_names_them(tiny_tokenizer, tmp_path):
    """Each prefix is three topic-free words and one topic word; the rest of the document is its topic's words.
    The prefix's own TF-IDF mostly sees the topic-free words; the word model learned on whole documents reads
    the one topic word, on the fitted shards and on held-out documents."""
    import copy

    import numpy as np
    from tokenizers import decoders

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.backend_tokenizer.decoder = decoders.WordPiece()
    tokenizer.save_pretrained(tmp_path / "tok")
    topics = {"pets": "cat mat dog park red blue".split(), "sky": "sun moon star river tree house".split(),
              "food": "music song dance food bread milk".split()}
    neutral = "car road city water fire stone".split()
    rng = np.random.default_rng(0)
    with gzip.open(tmp_path / "bbc_news.jsonl.gz", "wt") as out:
        for i in range(150):
            label = list(topics)[i % 3]
            words = topics[label]
            text = " ".join([*rng.choice(neutral, 3), rng.choice(words),
                             *[w for _ in range(15) for w in (rng.choice(words), rng.choice(neutral))]])
            out.write(json.dumps({"source": "bbc", "label": label, "id": str(i), "text": text}) + "\n")
    res = bench.run(["--sections", "doc_topics", "--shared-data", str(tmp_path), "--corpora", "bbc",
                      "--lm-tokenizer", str(tmp_path / "tok"), "--featurizer-k", "3", "--seeds", "0,1",
                      "--n-init", "2", "--tfidf-components", "4", "--prefix-tokens", "4"])
    bbc = res["doc_topics"]["corpora"]["bbc"]
    assert bbc["docs"] == 150 and 0 < bbc["held_out_docs"] < 30
    prefix, centroids, doc_topics, whole = bbc["rows"]
    assert prefix["featurizer"].startswith("tfidf prefix") and doc_topics["featurizer"].startswith("doc_topics")
    print({r["featurizer"]: (round(r["train_nmi"], 3), round(r["test_nmi"], 3)) for r in bbc["rows"]})
    assert whole["train_nmi"] > 0.9
    assert doc_topics["train_nmi"] > 0.9 and doc_topics["test_nmi"] > 0.9
    assert prefix["train_nmi"] < 0.5
