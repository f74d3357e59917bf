"""`dipaco prepare`: corpus -> train/validation split -> tokenizer -> tokenized Arrow datasets.

Everything later jobs need from the raw text is computed once here and stored in the run
directory. Later jobs check, through a hash of the config keys that shaped it, that the prepared
data matches their own config, so a changed corpus or tokenizer setting is never silently ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerFast

from dipaco.atomic import replacing
from dipaco.config import Config, config_diff, load_config, save_config
from dipaco.data.corpus import CorpusSpec, load_corpus_with_stats
from dipaco.errors import DataError, DipacoError
from dipaco.metrics import echo
from dipaco.run_dir import RunDir
from dipaco.data.tokenizer import load_tokenizer, tokenize_corpus, train_tokenizer

PREPARE_INFO = "prepare.json"
_NOT_PREPARE_KEYS = ("seq_len", "prefix_tokens")  # used by later jobs, not by tokenization


def corpus_spec(cfg: Config) -> CorpusSpec:
    fields = {k: v for k, v in asdict(cfg.data).items() if k not in _NOT_PREPARE_KEYS}
    fields["source"] = fields.pop("corpus")
    return CorpusSpec(**fields)


def prepare_hash(cfg: Config) -> str:
    corpus = asdict(corpus_spec(cfg))
    corpus.pop("hub")  # permission to use the hub, not a property of the data
    if corpus["csv_columns"] is None:  # keys added later hash as before while unset
        corpus.pop("csv_columns")
    payload = {"corpus": corpus, "tokenizer": asdict(cfg.tokenizer)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Prepared:
    tokenizer: PreTrainedTokenizerFast
    train: datasets.Dataset
    validation: datasets.Dataset
    info: dict


def prepare(cfg: Config) -> dict:
    """Builds ``data/`` and ``tokenizer/`` in the run directory; returns the summary it writes."""
    run = RunDir(cfg.run.dir)
    run.root.mkdir(parents=True, exist_ok=True)
    echo(f"[prepare] loading corpus {cfg.data.corpus!r}")
    corpus, stats = load_corpus_with_stats(corpus_spec(cfg))
    echo(f"[prepare] {len(corpus['train'])} train / {len(corpus['validation'])} validation documents")

    # Written next to the old tokenizer and data and swapped at the end: a failure never destroys a good prepare.
    with replacing(run.tokenizer) as tmp_tok, replacing(run.data) as tmp_data:
        if cfg.tokenizer.path:
            tokenizer = load_tokenizer(cfg.tokenizer.path)
            tokenizer.save_pretrained(tmp_tok)
        else:
            echo(f"[prepare] training a byte-level BPE tokenizer, vocab {cfg.tokenizer.vocab_size}")
            tokenizer = train_tokenizer(corpus["train"]["text"], cfg.tokenizer.vocab_size, tmp_tok, show_progress=cfg.run.progress)

        tokenized = tokenize_corpus(corpus, tokenizer)
        short = sum(n <= cfg.data.prefix_tokens for n in tokenized["validation"]["num_tokens"])
        info = {
            "prepare_hash": prepare_hash(cfg),
            "vocab_size": len(tokenizer),
            "splits": {
                split: {"docs": len(ds), "tokens": int(sum(ds["num_tokens"]))} for split, ds in tokenized.items()
            },
            "skipped_empty_docs": stats.n_skipped_empty,
            "validation_docs_within_prefix": int(short),
            "has_labels": "label" in tokenized["train"].column_names,
        }
        tokenized.save_to_disk(str(tmp_data))
        (tmp_data / PREPARE_INFO).write_text(json.dumps(info, indent=2))
        save_config(cfg, tmp_data / "config.yaml")
    for split, s in info["splits"].items():
        echo(f"[prepare] {split}: {s['docs']} docs, {s['tokens']:,} tokens")
    if short:
        echo(f"[prepare] note: {short} validation docs have <= {cfg.data.prefix_tokens} tokens (all routing prefix) and score no tokens")
    echo(f"[prepare] wrote {run.data} and {run.tokenizer}")
    return info


def _prepared_diff(cfg: Config, saved: Path) -> str:
    """`` (key: prepared value vs this config's value; ...)`` over the keys that shape the prepared data."""
    try:
        prepared_cfg = load_config(saved)
    except DipacoError:
        return f" (see {saved})"
    diff = [
        line for line in config_diff(prepared_cfg, cfg, ignore=())
        if line.startswith(("data.", "tokenizer."))
        and line.split(":", 1)[0] not in {f"data.{k}" for k in (*_NOT_PREPARE_KEYS, "hub")}
    ]
    if not diff:
        return f" (see {saved})"
    return " (" + "; ".join(d.replace(" -> ", " when prepared, now ", 1) for d in diff) + f"; see {saved})"


def load_prepared(cfg: Config, routed: bool | None = None) -> Prepared:
    """The prepared data of ``cfg.run.dir``, checked against ``cfg``.

    ``routed`` (default: whether ``train.sharding`` is kmeans) loads the copies of the splits that
    ``dipaco route`` wrote with a ``path`` column.
    """
    run = RunDir(cfg.run.dir)
    info_path = run.data / PREPARE_INFO
    if not info_path.is_file():
        raise DataError(f"{run.data}: no prepared data; run `dipaco prepare` with this config first")
    info = json.loads(info_path.read_text())
    if info["prepare_hash"] != prepare_hash(cfg):
        raise DataError(
            f"{run.data} was prepared with different data/tokenizer settings than this config"
            f"{_prepared_diff(cfg, run.data / 'config.yaml')}; rerun `dipaco prepare` or use the same config"
        )
    if cfg.train.sharding == "kmeans" if routed is None else routed:
        from dipaco.route.shards import routed_splits  # routed copies of the same splits, plus a `path` column

        splits = routed_splits(run, info["prepare_hash"])
    else:
        splits = datasets.load_from_disk(str(run.data))
    return Prepared(load_tokenizer(run.tokenizer), splits["train"], splits["validation"], info)
