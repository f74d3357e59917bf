"""`dipaco eval --corpus SOURCE`: the routed model's perplexity on any corpus ``data.corpus`` can read.

The corpus is read by the reader `dipaco prepare` uses (:mod:`dipaco.data.corpus`), with the run's
``data`` keys (``text_field``, ``id_field``, ``format``, ``strip_headers``, ``empty_docs``,
``csv_columns``, ``hub``), so a bad file gets prepare's error. Every document is scored: the corpus is
not split (a split column or split files are ignored), and ``eval.max_docs`` keeps the first ones.

Each document is then treated as `dipaco eval` treats a validation document:

* tokenized with the run's tokenizer, as prepare tokenizes (:func:`dipaco.data.tokenizer.tokenize_to_disk`);
* routed by the rule the experiment was sharded with. For ``kmeans``, the run's router picks the path
  from the document's routing context, the text of its first ``data.prefix_tokens`` tokens, featurized
  as `dipaco route` featurized the validation documents it assigned (:func:`route_documents`);
* scored by :func:`dipaco.eval.evaluate.score_routed`, the scoring of `dipaco eval` itself: only tokens
  after the routing prefix count, and perplexities are token-weighted per path and overall.

The report goes to ``train/<name>/eval_<corpus name>.json`` (:func:`report_name`), beside ``eval.json``;
`dipaco report` keeps reading ``eval.json`` alone.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from dipaco.checkpoint.experiment import experiment_checkpoint
from dipaco.data.corpus import CorpusSpec, read_checked, without_work_columns
from dipaco.data.packing import DocumentTokens
from dipaco.data.reading import SplitReader
from dipaco.data.tokenizer import TokenizeOptions, decode_batch, tokenize_to_disk
from dipaco.errors import DataError
from dipaco.eval.evaluate import (
    EVAL_CHUNK_DOCS,
    EvalJob,
    RoutedDocs,
    check_eval,
    print_path_table,
    score_routed,
    write_report,
)
from dipaco.metrics import echo
from dipaco.precision import resolve_precision
from dipaco.route.artifact import load_router
from dipaco.route.shards import assign_paths
from dipaco.run_dir import RunDir

_DATA_SUFFIX = re.compile(r"(\.(jsonl|json|csv|parquet|txt))?(\.gz)?$", re.IGNORECASE)


@dataclass(frozen=True)
class CorpusJob:
    """What scoring another corpus reads besides the experiment (:class:`EvalJob`)."""

    spec: CorpusSpec  # the run's data keys, with the corpus to score as the source
    tokenizer: PreTrainedTokenizerBase  # the run's
    featurizer: Callable[[], PreTrainedModel] | None = None  # the LM-prefix router's model (the pretrained one)
    route_precision: str = "auto"  # route.precision
    route_batch_size: int = 64  # route.batch_size


def report_name(source: str) -> str:
    """``eval_<name>.json``: the file name without its data suffixes (``news.jsonl.gz`` -> ``eval_news.json``),
    a directory's name, or a glob with every character that is not ``[A-Za-z0-9._-]`` made ``_``."""
    name = Path(source.rstrip("/\\")).name if not any(c in source for c in "*?[") else source
    name = _DATA_SUFFIX.sub("", name)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-") or "corpus"
    return f"eval_{name}.json"


def read_documents(spec: CorpusSpec, work_dir: Path) -> datasets.Dataset:
    """Every document of the corpus (columns id, text[, label]), read and checked as `dipaco prepare` reads
    ``data.corpus`` (UTF-8, JSON lines, the text column, empty documents, duplicate ids) but not split: the
    steps of :func:`dipaco.data.corpus.load_corpus_with_stats` before its train/validation split."""
    spec = replace(spec, split_field=None)  # every document is scored: no split column
    docs, _, _, keep = read_checked(spec, work_dir)
    if not len(keep):
        raise DataError(f"corpus {spec.source!r} has no document to score")
    docs = without_work_columns(docs)
    return docs if len(keep) == len(docs) else docs.select(keep)


def tokenize_documents(docs: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, work_dir: Path) -> datasets.Dataset:
    """``docs`` tokenized as `dipaco prepare` tokenizes a split (token ids only: routing decodes its prefix)."""
    files = tokenize_to_disk(docs, tokenizer, work_dir, "corpus", TokenizeOptions(keep_text=False))
    parts = [datasets.Dataset.from_file(str(f)) for f in files]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def routing_contexts(ds: datasets.Dataset, rows: range, tokenizer: PreTrainedTokenizerBase, prefix_tokens: int) -> list[str]:
    """The text of each document's first ``prefix_tokens`` tokens: what `dipaco route` featurizes."""
    ids = SplitReader(ds).rows(rows.start, rows.stop, ["input_ids"], list_prefix=prefix_tokens)["input_ids"]
    return decode_batch(tokenizer, ids)


def route_documents(job: EvalJob, corpus: CorpusJob, ds: datasets.Dataset) -> np.ndarray:
    """Each document's path under the run's router, featurized as `dipaco route` featurized the validation
    documents it assigned: the router's featurizer on the decoded routing context, then ``Router.assign``
    (the nearest centroid or best logit, never a balanced assignment: it depends on no other document)."""
    router = load_router(RunDir(job.run_dir), job.topology.num_paths)
    kind = router.featurizer.get("kind")
    options: dict[str, Any] = {}
    if kind == "lm_prefix":
        if corpus.featurizer is None:
            raise DataError("the router featurizes with the pretrained model (`dipaco pretrain`), which was not given")
        options = {"model": corpus.featurizer().to(job.device), "tokenizer": corpus.tokenizer,
                   "batch_size": corpus.route_batch_size, "device": job.device, "show_progress": False}
    elif kind == "encoder":
        options = {"batch_size": corpus.route_batch_size, "device": job.device, "show_progress": False}
    paths = np.empty(len(ds), dtype=np.int64)
    # route.precision applies to the LM-prefix featurizer alone, as in `dipaco route`
    precision = resolve_precision(corpus.route_precision if kind == "lm_prefix" else "fp32", job.device,
                                  "route.precision")
    for start in range(0, len(ds), EVAL_CHUNK_DOCS):
        rows = range(start, min(start + EVAL_CHUNK_DOCS, len(ds)))
        texts = routing_contexts(ds, rows, corpus.tokenizer, job.prefix_tokens)
        try:
            with precision.autocast():
                features = router.featurize(texts, **options)
        except ValueError as exc:  # e.g. a featurizer this router cannot run
            raise DataError(f"cannot route the corpus with the run's router: {exc}") from None
        paths[rows.start : rows.stop] = router.assign(features.float()).numpy()
    return paths


def evaluate_corpus(job: EvalJob, corpus: CorpusJob, checkpoint: str | None = None) -> dict:
    """Scores every path of the experiment's newest (or given) checkpoint on the corpus documents routed to
    it; writes ``train/<name>/eval_<corpus name>.json`` and prints the table of `dipaco eval`."""
    check_eval(job.eval)
    exp_dir, ckpt = experiment_checkpoint(job.run_dir, job.name, job.routed, checkpoint)
    echo(f"[eval] reading corpus {corpus.spec.source!r}")
    # The corpus's Arrow files and tokens live beside the experiment (not in a small /tmp) and go with the job.
    with tempfile.TemporaryDirectory(prefix=".eval-corpus-", dir=exp_dir) as scratch:
        work = Path(scratch)
        docs = read_documents(corpus.spec, work / "corpus")
        if job.eval.max_docs is not None and job.eval.max_docs < len(docs):
            docs = docs.select(range(job.eval.max_docs))
        ds = tokenize_documents(docs, corpus.tokenizer, work / "tokens")
        del docs
        if job.routed:
            routes = route_documents(job, corpus, ds)
        else:  # iid (a hash of the id) or a path column: the rule reads the document itself
            routes = assign_paths(ds, job.topology.num_paths, job.sharding, job.seed, job.shard_column)
        report = score_routed(job, ckpt, RoutedDocs(DocumentTokens(ds), routes, corpus.tokenizer.pad_token_id, "corpus"))
        del ds
    report = {"corpus": corpus.spec.source, **report}
    out = exp_dir / report_name(corpus.spec.source)
    write_report(report, out)
    print_path_table(report)
    echo(f"[eval] corpus {corpus.spec.source!r}: ppl {report['overall']['ppl']:.2f} on "
         f"{report['overall']['scored_tokens']:,} tokens of {report['overall']['docs']:,} documents; wrote {out}")
    return report
