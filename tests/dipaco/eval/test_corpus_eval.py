"""`dipaco eval --corpus`: any corpus `data.corpus` can read, routed and scored as `dipaco eval` scores the
validation split, and bad files refused with prepare's own errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tiny import SLICE_LABELS

from dipaco.checkpoint.experiment import read_bank
from dipaco.checkpoint.store import CheckpointManager
from dipaco.cli import main
from dipaco.config import Config, to_yaml
from dipaco.data.corpus import load_corpus
from dipaco.data.prepare import corpus_spec
from dipaco.errors import DataError
from dipaco.eval.corpus_eval import report_name
from dipaco.model.llama import build_model
from dipaco.model.scoring import Scoring, score_documents
from dipaco.precision import resolve_precision
from dipaco.run import Run
from dipaco.run_dir import RunDir
from routing.router import Router


def _config_file(cfg: Config, tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    return path


def _other_bbc_articles(out: Path, per_label: int = 3) -> Path:
    """BBC articles the tiny run never saw: the slice takes the first 72 of each topic, these come after."""
    from dipaco.data.corpus import CorpusSpec

    corpus = load_corpus(CorpusSpec(source="bbc"))
    docs = [d for split in ("train", "validation") for d in corpus[split]]
    rows = []
    for label in SLICE_LABELS:
        mine = sorted((d for d in docs if d["label"] == label), key=lambda d: d["id"])
        rows += [{"doc": f"other/{d['id']}", "body": d["text"][:1500]} for d in mine[200 : 200 + per_label]]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def _by_hand(cfg: Config, texts: list[str]) -> dict[int, tuple[int, int, float]]:
    """path -> (docs, scored tokens, NLL): each text tokenized, routed one at a time by the run's router on the
    text of its first prefix tokens, and scored by its path composed from the newest checkpoint."""
    run = Run(cfg)
    prepared = run.prepared(routed=False)
    tokenizer, spec = prepared.tokenizer, run.trained_spec()
    router = Router.load(RunDir(cfg.run.dir).routing / "router")
    featurizer = run.pretrained(prepared)
    bank = read_bank(CheckpointManager(RunDir(cfg.run.dir).experiment(cfg.train.name) / "checkpoints").latest(),
                     spec.build_topology(), spec.llama_config())
    scoring = Scoring(spec.seq_len, spec.prefix_tokens, cfg.eval.batch_size, tokenizer.pad_token_id,
                      resolve_precision("fp32", "cpu", "eval.precision"))
    out: dict[int, tuple[int, int, float]] = {}
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        context = tokenizer.decode(ids[: spec.prefix_tokens])
        features = router.featurize([context], model=featurizer, tokenizer=tokenizer, show_progress=False)
        path = int(router.assign(features.float())[0])
        scores = score_documents(bank.compose(path, build_model(spec.llama_config())), [ids], scoring)
        docs, tokens, nll = out.get(path, (0, 0, 0.0))
        out[path] = (docs + 1, tokens + int(scores.tokens.sum()), nll + float(scores.nll.sum()))
    return out


def test_a_corpus_the_run_never_saw_scores_as_its_documents_scored_by_hand(served_run, tmp_path, capsys):
    # Another format's field names too: the run's data keys name them, as for data.corpus.
    cfg = replace(served_run, data=replace(served_run.data, text_field="body", id_field="doc"))
    corpus = _other_bbc_articles(tmp_path / "other news.jsonl")
    texts = [json.loads(line)["body"] for line in corpus.read_text().splitlines()]
    prepared = Run(served_run).prepared(routed=False)
    seen = set(prepared.train["text"]) | set(prepared.validation["text"])
    assert not seen & set(texts)  # not the run's corpus

    assert main(["eval", "--config", str(_config_file(cfg, tmp_path)), "--corpus", str(corpus)]) == 0
    table = capsys.readouterr().out
    out = RunDir(cfg.run.dir).experiment(cfg.train.name) / "eval_other_news.json"
    assert out.name == report_name(str(corpus)) and str(out) in table
    report = json.loads(out.read_text())
    assert report["corpus"] == str(corpus) and report["overall"]["docs"] == len(texts)

    hand = _by_hand(served_run, texts)
    assert len(hand) > 1  # the router spreads them: more than one path is compared
    for row in report["paths"]:
        docs, tokens, nll = hand.get(row["path"], (0, 0, 0.0))
        assert (row["docs"], row["scored_tokens"]) == (docs, tokens)
        assert np.isclose(row["nll"], nll, rtol=1e-5)
    total_nll, total_tokens = sum(h[2] for h in hand.values()), sum(h[1] for h in hand.values())
    assert np.isclose(report["overall"]["ppl"], np.exp(total_nll / total_tokens), rtol=1e-5)
    assert f"{report['overall']['ppl']:.2f}" in table


def test_the_validation_split_as_a_corpus_gives_eval_json(served_run, tmp_path):
    """Routed as `dipaco route` routed the validation documents, scored as `dipaco eval` scored them."""
    val = Run(served_run).prepared(routed=False).validation
    corpus = tmp_path / "validation.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(val["id"], val["text"])))
    report = Run(served_run).evaluate_corpus(str(corpus))
    whole = json.loads((RunDir(served_run.run.dir).experiment(served_run.train.name) / "eval.json").read_text())
    assert [(r["docs"], r["scored_tokens"]) for r in report["paths"]] == [(r["docs"], r["scored_tokens"]) for r in whole["paths"]]
    for a, b in zip(report["paths"], whole["paths"]):
        assert np.isclose(a["nll"], b["nll"], rtol=1e-5)
    assert np.isclose(report["overall"]["ppl"], whole["overall"]["ppl"], rtol=1e-5)


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    empty_doc = tmp_path / "empty_doc.jsonl"
    empty_doc.write_text('{"id": "a", "text": "some words"}\n{"id": "b", "text": "   "}\n')
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"id": "a", "body": "some words"}\n')
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"id": "a", "text": "fine"}\n{"id": "b", "text": \n')
    return {"latin1": latin1, "empty_doc": empty_doc, "no_text": no_text, "not_json": not_json,
            "missing": tmp_path / "nowhere.jsonl"}


@pytest.mark.parametrize("case", ["latin1", "empty_doc", "no_text", "not_json", "missing"])
def test_a_bad_file_is_one_error_line_with_prepares_message(served_run, tmp_path, capsys, case):
    bad = _bad_files(tmp_path)[case]
    with pytest.raises(DataError) as prepare_error:  # what `dipaco prepare` says of the same file
        load_corpus(corpus_spec(replace(served_run.data, corpus=str(bad))))
    assert main(["eval", "--config", str(_config_file(served_run, tmp_path)), "--corpus", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {prepare_error.value}"]
    exp_dir = RunDir(served_run.run.dir).experiment(served_run.train.name)
    assert not (exp_dir / report_name(str(bad))).exists()
    assert not list(exp_dir.glob(".eval-corpus-*"))  # the scratch goes with a failed job too


def test_report_names():
    assert report_name("corpus/news.jsonl.gz") == "eval_news.json"
    assert report_name("data/brown/") == "eval_brown.json"
    assert report_name("corpus/*.jsonl") == "eval_corpus.json"
    assert report_name("a b.csv") == "eval_a_b.json"
