"""Fixtures of the serving tests beyond tests/dipaco/conftest.py's: a run imported from an open checkpoint."""

from __future__ import annotations

import json

import pytest
from open_model import IMPORTED_POSITIONS, build_checkpoint
from tiny import corpus_source_missing, write_corpus_slice

from dipaco.config import Config

IMPORTED = ["data.seq_len=64", "data.prefix_tokens=16", "topology.preset=dense", "pretrain.steps=2",
            "pretrain.optim.batch_size=4", "pretrain.optim.warmup_steps=1", "train.optim.batch_size=4",
            "train.optim.warmup_steps=1", "train.rounds=1", "train.inner_steps=2", "run.progress=false",
            "run.device=cpu", "eval.batch_size=16"]


@pytest.fixture(scope="session")
def imported_run(tmp_path_factory) -> Config:
    """A dense run (one path, no router) imported from a tiny Llama checkpoint of ``IMPORTED_POSITIONS``
    positions (model.init_from), pretrained and trained briefly at data.seq_len=64."""
    missing = corpus_source_missing()
    if missing:
        pytest.skip(missing)
    from dipaco.run import Run, load_config

    root = tmp_path_factory.mktemp("imported_run")
    corpus = write_corpus_slice(root / "corpus.jsonl", per_label=12)
    checkpoint = root / "open_model"
    build_checkpoint(checkpoint, texts=[json.loads(line)["text"] for line in corpus.read_text().splitlines()],
                     max_position_embeddings=IMPORTED_POSITIONS)
    cfg = load_config(None, [f"model.init_from={checkpoint}", f"data.corpus={corpus}", f"run.dir={root / 'run'}",
                             *IMPORTED])
    for job in (Run(cfg).prepare, Run(cfg).pretrain, Run(cfg).train):
        job()
    return cfg
