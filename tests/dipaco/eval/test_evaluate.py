"""`dipaco eval` reads the validation documents from the token files a chunk at a time: the same report
as scoring them all at once, whatever the chunk."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np

import dipaco.eval.evaluate as evaluate
from dipaco.data.packing import DocumentTokens
from dipaco.run import Run
from dipaco.run_dir import RunDir


def test_eval_in_chunks_of_three_documents_gives_the_report_of_one_chunk(served_run, tmp_path, monkeypatch):
    """It held every validation document as Python lists (about 36 bytes a token: tens of GB for the
    validation split of a 10M-document corpus)."""
    cfg = replace(served_run, run=replace(served_run.run, dir=str(shutil.copytree(served_run.run.dir, tmp_path / "run"))))
    whole = json.loads((RunDir(cfg.run.dir).experiment(cfg.train.name) / "eval.json").read_text())
    monkeypatch.setattr(evaluate, "EVAL_CHUNK_DOCS", 3)
    chunked = Run(cfg).evaluate()
    assert chunked["overall"]["docs"] == whole["overall"]["docs"]
    assert chunked["overall"]["scored_tokens"] == whole["overall"]["scored_tokens"]
    # each document is scored on its own; only which windows share a padded batch changes
    assert np.isclose(chunked["overall"]["nll"], whole["overall"]["nll"], rtol=1e-5)
    for a, b in zip(chunked["paths"], whole["paths"]):
        assert a["docs"] == b["docs"] and a["scored_tokens"] == b["scored_tokens"]
        assert np.isclose(a["nll"], b["nll"], rtol=1e-5)


def test_documents_are_the_column_rows(served_run):
    val = Run(served_run).prepared().validation
    rows = np.array([5, 0, 3, len(val) - 1])
    docs = DocumentTokens(val).documents(rows, np.int32)
    assert all(d.dtype == np.int32 for d in docs)
    assert [d.tolist() for d in docs] == [val["input_ids"][int(r)] for r in rows]


def test_a_path_without_validation_documents_is_null_with_the_reason_in_eval_json():
    # Issue 48: its perplexity was written as NaN, which no strict JSON parser reads.
    from dipaco import json_text
    from dipaco.eval.evaluate import _summary
    from dipaco.model.scoring import Scores

    empty = json.loads(json_text.dumps(_summary(Scores(np.zeros(0), np.zeros(0, dtype=np.int64)), 0)))
    assert empty["ppl"] is None and empty["ppl_null_reason"] == "no validation document is routed to this path"
    short = json.loads(json_text.dumps(_summary(Scores(np.zeros(2), np.zeros(2, dtype=np.int64)), 2)))
    assert short["ppl"] is None and "the 2 validation documents routed here end within" in short["ppl_null_reason"]
