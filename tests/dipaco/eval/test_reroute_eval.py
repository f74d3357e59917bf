"""Test-time re-routing eval: same scored tokens as `dipaco eval`, and W >= the document is once-per-sequence."""

import json
from dataclasses import replace

import numpy as np
import pytest
from tiny import TINY

from dipaco.cli import main
from dipaco.errors import ConfigError
from dipaco.eval import reroute_eval
from dipaco.eval.evaluate import validation_split
from dipaco.eval.reroute_eval import REPORT, decision_points, parse_every, window_paths
from dipaco.run import Run
from dipaco.run_dir import RunDir


def test_window_paths_follow_the_decisions():
    # first scored token 4, W=3: windows [4,7) keep the doc route, [7,10) and [10,12) use the decisions.
    assert decision_points(12, 4, 3) == [7, 10]
    paths = window_paths(12, 4, 3, doc_route=1, decided={7: 2, 10: 0})
    assert paths[4:].tolist() == [1, 1, 1, 2, 2, 2, 0, 0]
    assert (window_paths(12, 4, None, 3, {}) == 3).all()


def test_reroute_eval_matches_eval_and_is_once_per_sequence_for_long_windows(served_run):
    evaluated = json.loads((RunDir(served_run.run.dir).experiment(served_run.train.name) / "eval.json").read_text())
    longest = max(validation_split(served_run.eval, Run(served_run).prepared())["num_tokens"])
    report = Run(served_run).reroute_evaluate([longest, 48])
    once, long_w, short_w = report["results"]
    assert once["reroute_every"] is None and long_w["reroute_every"] == longest and short_w["reroute_every"] == 48
    for r in report["results"]:  # exactly evaluate.py's scored tokens
        assert r["scored_tokens"] == evaluated["overall"]["scored_tokens"]
    assert np.isclose(once["nll"], evaluated["overall"]["nll"], rtol=1e-6)
    assert np.isclose(long_w["nll"], once["nll"], rtol=1e-9) and long_w["decisions"] == 0
    assert short_w["decisions"] > 0 and np.isfinite(short_w["ppl"])
    assert 0.0 < short_w["tokens_off_document_route"] < 1.0  # the router does move some windows
    saved = json.loads((RunDir(served_run.run.dir).experiment(served_run.train.name) / REPORT).read_text())
    assert saved["results"] == report["results"]


def test_reroute_eval_reads_the_documents_in_chunks_with_the_same_report(served_run, monkeypatch):
    """It held every validation document's tokens as Python lists (about 36 bytes a token); it now reads
    them from the token files a chunk at a time, and the report does not depend on the chunking."""
    few = replace(served_run, eval=replace(served_run.eval, max_docs=8))
    whole = Run(few).reroute_evaluate([48])
    read = []
    real = reroute_eval.DocumentTokens.documents

    def documents(self, rows, *args, **kwargs):
        read.append(len(rows))
        return real(self, rows, *args, **kwargs)

    monkeypatch.setattr(reroute_eval, "REROUTE_CHUNK_DOCS", 3)
    monkeypatch.setattr(reroute_eval.DocumentTokens, "documents", documents)
    chunked = Run(few).reroute_evaluate([48])
    assert read == [3, 3, 2] and chunked["docs"] == whole["docs"] == 8
    for a, b in zip(whole["results"], chunked["results"]):
        assert {k: v for k, v in a.items() if k not in ("nll", "ppl")} == {k: v for k, v in b.items() if k not in ("nll", "ppl")}
        assert np.isclose(a["nll"], b["nll"], rtol=1e-9)


def test_eval_command_with_reroute_every(served_run, capsys):
    args = ["eval", *TINY, f"run.dir={served_run.run.dir}", f"data.corpus={served_run.data.corpus}",
            "train.sharding=kmeans", "eval.max_docs=4", "--reroute-every", "64,32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "once per doc" in out and "every 64" in out and "every 32" in out
    assert main(args[:-1] + ["0,x"]) == 2
    assert "--reroute-every" in capsys.readouterr().err


def test_reroute_needs_a_router(served_run):
    with pytest.raises(ConfigError, match="sharding=kmeans"):
        Run(replace(served_run, train=replace(served_run.train, sharding="iid"))).reroute_evaluate([64])
    with pytest.raises(ConfigError):
        parse_every("0")
    assert parse_every("128, 64,32") == [128, 64, 32]


def test_eval_shows_its_progress(served_run, capsys, tmp_path):
    """Issue 34: `dipaco eval` was silent for over a minute; with run.progress it draws a bar over its windows."""
    import shutil

    from tiny import TINY

    from dipaco.cli import main

    run_dir = shutil.copytree(served_run.run.dir, tmp_path / "run")  # its eval.json is the session's
    args = [*TINY, f"run.dir={run_dir}", f"data.corpus={served_run.data.corpus}", "train.sharding=kmeans",
            "route.featurizer=lm_prefix", "route.n_init=1", "run.progress=true", "eval.max_docs=4"]
    assert main(["eval", *args]) == 0
    err = capsys.readouterr().err
    assert f"eval {served_run.train.name}" in err and "window" in err
