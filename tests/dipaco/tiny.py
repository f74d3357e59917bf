"""A tiny run for trainer tests: a 2-layer d=32 Llama, 2x2 grid, on a slice of real multi-domain text."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from dipaco.config import Config, load_config

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2",
    "data.seq_len=64", "data.prefix_tokens=16", "tokenizer.vocab_size=512",
    "topology.preset=grid:2x2", "pretrain.steps=30", "pretrain.optim.batch_size=8",
    "pretrain.optim.warmup_steps=5", "train.optim.batch_size=8", "train.optim.warmup_steps=5",
    "train.rounds=2", "train.inner_steps=5", "run.progress=false", "run.device=cpu", "eval.batch_size=32",
]


def write_corpus_slice(out: Path, per_source: int = 120) -> Path:
    """Documents from each of the three shared corpora, 20 Newsgroups without its Usenet headers."""
    from dipaco.data.corpus import strip_header

    rows = []
    for name in ("20news_bydate.jsonl.gz", "bbc_news.jsonl.gz", "brown_genres.jsonl.gz"):
        with gzip.open(SHARED_DATA / name, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= per_source:
                    break
                doc = json.loads(line)
                text = strip_header(doc["text"]) if name.startswith("20news") else doc["text"]
                if text.strip():
                    rows.append({"id": f"{doc['source']}/{doc['id']}", "label": doc["label"], "text": text[:3000]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def tiny_config(run_dir: Path, corpus: Path, *extra: str) -> Config:
    return load_config(None, [*TINY, f"run.dir={run_dir}", f"data.corpus={corpus}", *extra])
