"""Fixtures for trainer tests: a tiny prepared + pretrained run, shared by the session."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import corpus_source_missing, tiny_config, write_corpus_slice

from dipaco.config import Config


@pytest.fixture(scope="session")
def prepared_run(tmp_path_factory) -> Config:
    """prepare + pretrain once per session; tests copy the run directory before training in it."""
    missing = corpus_source_missing()
    if missing:
        pytest.skip(missing)
    from dipaco.run import Run

    root = tmp_path_factory.mktemp("tiny_run")
    corpus = write_corpus_slice(root / "corpus.jsonl")
    cfg = tiny_config(root / "run", corpus)
    Run(cfg).prepare()
    Run(cfg).pretrain()
    return cfg


@pytest.fixture
def run_cfg(prepared_run: Config, tmp_path: Path) -> Config:
    """A private copy of the prepared run, so each test can train without touching the others."""
    dst = tmp_path / "run"
    shutil.copytree(prepared_run.run.dir, dst)
    return replace(prepared_run, run=replace(prepared_run.run, dir=str(dst)))


@pytest.fixture(scope="session")
def served_run(prepared_run: Config, tmp_path_factory) -> Config:
    """A routed (LM-prefix k-means), trained and evaluated copy of the tiny run, for the inference tests.

    Shared by the session: tests only read it or add report files (reroute_eval.json); a test that
    changes it works on its own copy.
    """
    from dipaco.run import Run

    dst = tmp_path_factory.mktemp("served_run") / "run"
    shutil.copytree(prepared_run.run.dir, dst)
    cfg = replace(prepared_run, run=replace(prepared_run.run, dir=str(dst)),
                  train=replace(prepared_run.train, sharding="kmeans"),
                  route=replace(prepared_run.route, featurizer="lm_prefix", n_init=1))
    Run(cfg).route()
    Run(cfg).train()
    Run(cfg).evaluate()
    return cfg
