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
from typing import Any

import datasets
from transformers import PreTrainedTokenizerFast

from dipaco.atomic import replacing
from dipaco.config import Config, DataConfig, TokenizerConfig, config_diff, merge_config
from dipaco.data.corpus import CorpusSpec, load_corpus_with_stats
from dipaco.data.tokenizer import load_tokenizer, tokenize_corpus, train_tokenizer
from dipaco.errors import ConfigError, DataError, DipacoError
from dipaco.metrics import echo
from dipaco.run_dir import RunDir

PREPARE_INFO = "prepare.json"
_NOT_PREPARE_KEYS = ("seq_len", "prefix_tokens")  # used by later jobs, not by tokenization


def corpus_spec(data: DataConfig) -> CorpusSpec:
    fields = {k: v for k, v in asdict(data).items() if k not in _NOT_PREPARE_KEYS}
    fields["source"] = fields.pop("corpus")
    return CorpusSpec(**fields)


def check_data(data: DataConfig) -> None:
    """The ``data`` section's values (the corpus reader checks the rest when it loads)."""
    if data.seq_len <= 0:
        raise ConfigError(f"data.seq_len: must be > 0, got {data.seq_len}")
    if not 0.0 < data.validation_fraction < 1.0:
        raise ConfigError(f"data.validation_fraction: must be in (0, 1), got {data.validation_fraction}")
    if not 0 <= data.prefix_tokens < data.seq_len:
        raise ConfigError(f"data.prefix_tokens: must be in [0, data.seq_len={data.seq_len}), got {data.prefix_tokens}")


def check_tokenizer(tokenizer: TokenizerConfig) -> None:
    if tokenizer.vocab_size <= 0:
        raise ConfigError(f"tokenizer.vocab_size: must be > 0, got {tokenizer.vocab_size}")


def prepare_hash(data: DataConfig, tokenizer: TokenizerConfig) -> str:
    corpus = asdict(corpus_spec(data))
    corpus.pop("hub")  # permission to use the hub, not a property of the data
    if corpus["csv_columns"] is None:  # keys added later hash as before while unset
        corpus.pop("csv_columns")
    payload = {"corpus": corpus, "tokenizer": asdict(tokenizer)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Prepared:
    tokenizer: PreTrainedTokenizerFast
    train: datasets.Dataset
    validation: datasets.Dataset
    info: dict


def prepare(run_dir: str | Path, data: DataConfig, tokenizer_cfg: TokenizerConfig, config_yaml: str,
            progress: bool = True) -> dict:
    """Builds ``data/`` and ``tokenizer/`` in the run directory; returns the summary it writes.
    ``config_yaml``: the run's resolved config, kept next to the data it shaped."""
    check_data(data)
    check_tokenizer(tokenizer_cfg)
    run = RunDir(run_dir)
    echo(f"[prepare] loading corpus {data.corpus!r}")
    corpus, stats = load_corpus_with_stats(corpus_spec(data))  # before the run directory: a bad corpus leaves none
    echo(f"[prepare] {len(corpus['train'])} train / {len(corpus['validation'])} validation documents")
    run.root.mkdir(parents=True, exist_ok=True)

    # Written next to the old tokenizer and data and swapped at the end: a failure never destroys a good prepare.
    with replacing(run.tokenizer) as tmp_tok, replacing(run.data) as tmp_data:
        if tokenizer_cfg.path:
            tokenizer = load_tokenizer(tokenizer_cfg.path)
            tokenizer.save_pretrained(tmp_tok)
        else:
            echo(f"[prepare] training a byte-level BPE tokenizer, vocab {tokenizer_cfg.vocab_size}")
            tokenizer = train_tokenizer(corpus["train"]["text"], tokenizer_cfg.vocab_size, tmp_tok, show_progress=progress,
                                        log=lambda line: echo(f"[prepare] {line}"))

        tokenized = tokenize_corpus(corpus, tokenizer)
        short = sum(n <= data.prefix_tokens for n in tokenized["validation"]["num_tokens"])
        info: dict[str, Any] = {
            "prepare_hash": prepare_hash(data, tokenizer_cfg),
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
        (tmp_data / "config.yaml").write_text(config_yaml)
    for split, s in info["splits"].items():
        echo(f"[prepare] {split}: {s['docs']} docs, {s['tokens']:,} tokens")
    if short:
        echo(f"[prepare] note: {short} validation docs have <= {data.prefix_tokens} tokens (all routing prefix) "
             f"and score no tokens")
    echo(f"[prepare] wrote {run.data} and {run.tokenizer}")
    return info


def _prepared_diff(data: DataConfig, tokenizer: TokenizerConfig, saved: Path) -> str:
    """`` (key: prepared value vs this config's value; ...)`` over the keys that shape the prepared data."""
    try:
        prepared_cfg = merge_config(saved)
    except DipacoError:
        return f" (see {saved})"
    then = Config(data=prepared_cfg.data, tokenizer=prepared_cfg.tokenizer)
    diff = [
        line for line in config_diff(then, Config(data=data, tokenizer=tokenizer), ignore=())
        if line.startswith(("data.", "tokenizer."))
        and line.split(":", 1)[0] not in {f"data.{k}" for k in (*_NOT_PREPARE_KEYS, "hub")}
    ]
    if not diff:
        return f" (see {saved})"
    return " (" + "; ".join(d.replace(" -> ", " when prepared, now ", 1) for d in diff) + f"; see {saved})"


def load_prepared(run_dir: str | Path, data: DataConfig, tokenizer: TokenizerConfig) -> Prepared:
    """The prepared data of ``run_dir``, checked to come from these ``data``/``tokenizer`` settings.
    The routed copies of the splits (with a ``path`` column) come from :func:`dipaco.route.shards.with_routing`."""
    run = RunDir(run_dir)
    info_path = run.data / PREPARE_INFO
    if not info_path.is_file():
        raise DataError(f"{run.data}: no prepared data; run `dipaco prepare` with this config first")
    info = json.loads(info_path.read_text())
    if info["prepare_hash"] != prepare_hash(data, tokenizer):
        raise DataError(
            f"{run.data} was prepared with different data/tokenizer settings than this config"
            f"{_prepared_diff(data, tokenizer, run.data / 'config.yaml')}; rerun `dipaco prepare` or use the same config"
        )
    splits = datasets.load_from_disk(str(run.data))
    return Prepared(load_tokenizer(run.tokenizer), splits["train"], splits["validation"], info)
