"""`dipaco eval --reroute-every W[,W...]`: test-time re-routing (DiPaCo section 2.5, Table 3).

Once-per-sequence routing scores a whole validation document with the path its first
``data.prefix_tokens`` tokens chose. Re-routing every W tokens lets the path follow the document:

* Scored tokens are exactly evaluate.py's (token j with ``j >= max(prefix_tokens, 1)``), cut
  into re-routing windows of W scored tokens starting at the first scored token:
  window k holds targets ``[first + k*W, first + (k+1)*W)``.
* Window 0 uses the document's own route (the ``path`` column ``dipaco route`` wrote), as
  ``dipaco eval`` does. The path of window k >= 1 (starting at token s) is chosen by the
  experiment's router from text before the window only, so no target of window k is seen: the
  router's featurizer applied to the most recent ``prefix_tokens`` tokens before the window,
  ``doc[s - prefix_tokens : s]``. This is the kind of input the router was fitted on (``dipaco
  route`` featurizes each document's first ``prefix_tokens`` tokens, for LM-prefix and TF-IDF
  features alike), so centroid distances and classifier biases keep their meaning; it follows
  topic drift, which is what re-routing is for; and each decision costs the same however long
  the document. Window 0's route is the same rule at ``s = prefix_tokens``. An LM-prefix
  featurizer gets the token ids as they are (no decode and re-encode, which could tokenize a cut
  differently); a TF-IDF one gets their decoded text.
* Each target is scored by its window's path with exactly the context evaluate.py gives it: the
  same evaluation windows of at most ``seq_len`` tokens, overlapping by one token. Only the path
  that scores each token changes, so the perplexities are comparable with ``dipaco eval``, and with
  W at least the document length re-routing *is* once-per-sequence routing.

Each (evaluation window, path) pair that any setting needs is run once and shared by all settings.
The report goes to ``train/<name>/reroute_eval.json``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dipaco import json_text
from dipaco.atomic import write_text
from dipaco.checkpoint.experiment import experiment_checkpoint, read_bank
from dipaco.data.packing import IGNORE_INDEX, DocumentTokens, EvalWindow, count_scored_tokens, eval_windows
from dipaco.data.prepare import Prepared
from dipaco.errors import ConfigError, DipacoError
from dipaco.eval.evaluate import EvalJob, check_eval, load_eval_path, validation_split
from dipaco.metrics import echo
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.scoring import window_nll
from dipaco.precision import Precision, resolve_precision
from dipaco.route.artifact import load_router
from dipaco.route.shards import assign_paths
from dipaco.run_dir import RunDir

REPORT = "reroute_eval.json"
DEFAULT_EVERY = (128, 64, 32)


class PretokenizedIds:
    """Tokenizer stand-in for the router's LM-prefix featurizer when the token ids are already known.

    The featurizer calls ``tokenizer(texts, add_special_tokens=False, truncation=True,
    max_length=prefix_tokens)["input_ids"]`` and keeps the first ``prefix_tokens`` ids; given id
    lists as "texts", this returns them unchanged, so features come from exactly these tokens
    (decoding and re-encoding a slice of a document could tokenize its edges differently).
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, texts: Sequence[Sequence[int]], **_: Any) -> dict[str, list[list[int]]]:
        return {"input_ids": [list(t) for t in texts]}


def featurize_ids(router, model, id_lists: Sequence[Sequence[int]], pad_token_id: int,
                  device: torch.device | str = "cpu", batch_size: int = 64) -> torch.Tensor:
    """LM-prefix router features of token-id sequences (the featurizer keeps their first prefix_tokens)."""
    return router.featurize(list(id_lists), model=model, tokenizer=PretokenizedIds(pad_token_id),
                            batch_size=batch_size, device=device, show_progress=False).float().cpu()


def parse_every(text: str) -> list[int]:
    """``"128,64,32"`` -> [128, 64, 32]; each W must be a positive integer."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"--reroute-every: expected positive integers like 128,64,32, got {text!r}")
    return values


def decision_points(doc_len: int, first: int, every: int) -> list[int]:
    """Starts ``s`` of re-routing windows 1, 2, ... (window 0 keeps the document's route)."""
    return list(range(first + every, doc_len, every))


def window_paths(doc_len: int, first: int, every: int | None, doc_route: int, decided: dict[int, int]) -> np.ndarray:
    """Path of every token position 0..doc_len-1 under one setting (positions < first are never scored)."""
    paths = np.full(doc_len, doc_route, dtype=np.int64)
    if every is not None:
        for s in decision_points(doc_len, first, every):
            paths[s : s + every] = decided[s]
    return paths


def _token_nll(model, windows: Sequence[EvalWindow], batch_size: int, pad_id: int,
               precision: Precision) -> list[torch.Tensor]:
    """NLL of every position of each window under ``model``: entry i is target input_ids[i] (0 if unscored)."""
    out: list[torch.Tensor | None] = [None] * len(windows)
    for idx, _, token_nll in window_nll(model, windows, batch_size, pad_id, precision):
        token_nll = token_nll.double().cpu()
        for row, i in enumerate(idx):
            n = len(windows[i].input_ids)
            out[i] = torch.cat([torch.zeros(1, dtype=torch.float64), token_nll[row, : n - 1]])
    return out  # type: ignore[return-value]


REROUTE_CHUNK_DOCS = 2_000  # documents decided, run and summed at a time: memory follows the chunk, not the split


@dataclass
class _Setting:
    """One setting's sums over the documents read so far."""

    doc_nll: np.ndarray  # per validation document, each summed in window order: the same float sums in any chunking
    off_route: int = 0
    decisions: int = 0
    changed: int = 0


@dataclass
class _Chunk:
    """What the four passes share: the experiment, its router and the models they load."""

    job: EvalJob
    bank: ModuleBank
    router: Any
    model: PreTrainedModel
    pad_token_id: int
    tokenizer: Any
    featurizer: Callable[[], PreTrainedModel] | None
    route_precision: str
    route_batch_size: int
    lm: PreTrainedModel | None = None  # the LM-prefix router's model, loaded at its first decision

    def decide(self, docs: Sequence[list[int]], points: list[tuple[int, int]]) -> dict[int, dict[int, int]]:
        """The router's path for each (document, window start) of ``points``, from the tokens before it."""
        decided: dict[int, dict[int, int]] = defaultdict(dict)
        if not points:
            return decided
        kind = self.router.featurizer.get("kind")
        context_tokens = int(self.router.featurizer.get("prefix_tokens", self.job.prefix_tokens))
        contexts = [docs[d][max(0, s - context_tokens) : s] for d, s in points]
        if kind == "lm_prefix":
            if self.featurizer is None:
                raise DipacoError("the router featurizes with the pretrained model, which was not given")
            if self.lm is None:
                self.lm = self.featurizer().to(self.job.device)
            with resolve_precision(self.route_precision, self.job.device, "route.precision").autocast():
                features = featurize_ids(self.router, self.lm, contexts, self.pad_token_id, device=self.job.device,
                                         batch_size=self.route_batch_size)
        elif kind in ("tfidf_svd", "doc_topics", "encoder"):  # text featurizers (the encoder is loaded by its recorded name)
            features = self.router.featurize(self.tokenizer.batch_decode(contexts))
        else:
            raise DipacoError(f"re-routing does not know the router's featurizer {self.router.featurizer!r}")
        for (d, s), p in zip(points, self.router.assign(features).tolist()):
            decided[d][s] = int(p)
        return decided

    def add(self, docs: Sequence[list[int]], doc_routes: np.ndarray, first_row: int,
            settings: list[int | None], sums: dict[int | None, _Setting]) -> None:
        """Adds the documents ``docs`` (rows ``first_row``... of the split, routed ``doc_routes``) to ``sums``."""
        job, first = self.job, max(self.job.prefix_tokens, 1)
        # 1. Routing decisions at the start of every re-routing window, shared by settings that coincide.
        points = sorted({(d, s) for w in settings if w is not None for d, doc in enumerate(docs)
                         for s in decision_points(len(doc), first, w)})
        decided = self.decide(docs, points)

        # 2. The path of every target under every setting, and which (window, path) pairs to run.
        windows = eval_windows(docs, job.seq_len, job.prefix_tokens)
        per_setting = {w: {d: window_paths(len(doc), first, w, int(doc_routes[d]), decided[d])
                           for d, doc in enumerate(docs)} for w in settings}
        # path -> {window: length of the window prefix it must run}: a causal LM's logits at a position do
        # not depend on later tokens, so a path runs a window only up to the last target it scores there.
        needed: dict[int, dict[int, int]] = defaultdict(dict)
        for i, win in enumerate(windows):
            scored = np.flatnonzero(win.labels.numpy() != IGNORE_INDEX)
            for w in settings:
                paths = per_setting[w][win.doc_index][scored + win.start]
                for p in np.unique(paths).tolist():
                    last = int(scored[paths == p].max()) + 1
                    needed[p][i] = max(needed[p].get(i, 0), last)

        # 3. One forward pass per (window, path) pair.
        precision = resolve_precision(job.eval.precision, job.device, "eval.precision")
        nll_of: dict[tuple[int, int], torch.Tensor] = {}
        for p in sorted(needed):
            ids = list(needed[p])
            cut = [replace(windows[i], input_ids=windows[i].input_ids[: needed[p][i]],
                           labels=windows[i].labels[: needed[p][i]]) for i in ids]
            for i, nll in zip(ids, _token_nll(load_eval_path(job, self.bank, p, self.model), cut, job.eval.batch_size,
                                                self.pad_token_id, precision)):
                nll_of[(i, p)] = F.pad(nll, (0, len(windows[i].input_ids) - len(nll)))

        # 4. Sum each setting's choice of path per target.
        for w in settings:
            total = sums[w]
            for i, win in enumerate(windows):
                mask = win.labels.numpy() != IGNORE_INDEX
                paths = per_setting[w][win.doc_index][win.start : win.start + len(win.labels)]
                for p in np.unique(paths[mask]).tolist():
                    sel = torch.from_numpy(mask & (paths == p))
                    total.doc_nll[first_row + win.doc_index] += float(nll_of[(i, p)][sel].sum())
                    if p != doc_routes[win.doc_index]:
                        total.off_route += int(sel.sum())
            if w is not None:
                for d, doc in enumerate(docs):
                    previous = int(doc_routes[d])
                    for s in decision_points(len(doc), first, w):
                        total.decisions += 1
                        total.changed += decided[d][s] != previous
                        previous = decided[d][s]


def reroute_evaluate(job: EvalJob, load_prepared: Callable[[], Prepared], every: Sequence[int] = DEFAULT_EVERY,
                     checkpoint: str | None = None, featurizer: Callable[[], PreTrainedModel] | None = None,
                     route_precision: str = "auto", route_batch_size: int = 64) -> dict:
    """Validation perplexity with once-per-sequence routing and with re-routing every W tokens.
    ``featurizer``: the LM-prefix router's model (the pretrained one), loaded when the router needs it;
    ``route_precision``, ``route_batch_size``: ``route.precision`` and ``route.batch_size``. The documents
    are read from the token files ``REROUTE_CHUNK_DOCS`` at a time (the same report in any chunking)."""
    if not job.routed:
        raise ConfigError(
            f"re-routing needs the experiment's router, but {job.name} was trained with "
            f"train.sharding={job.sharding}; route (`dipaco route`) and train with train.sharding=kmeans"
        )
    check_eval(job.eval)
    settings: list[int | None] = [None, *sorted({int(w) for w in every}, reverse=True)]
    if any(w is not None and w < 1 for w in settings):
        raise ConfigError(f"--reroute-every: every W must be >= 1, got {list(every)}")
    prepared = load_prepared()
    exp_dir, ckpt = experiment_checkpoint(job.run_dir, job.name, job.routed, checkpoint)
    topology = job.topology
    router = load_router(RunDir(job.run_dir), topology.num_paths)
    val = validation_split(job.eval, prepared)
    tokens = DocumentTokens(val)
    doc_routes = assign_paths(val, topology.num_paths, job.sharding, job.seed, job.shard_column)
    chunk = _Chunk(job, read_bank(ckpt, topology, job.llama), router, build_model(job.llama, device=job.device),
                   prepared.tokenizer.pad_token_id, prepared.tokenizer, featurizer, route_precision, route_batch_size)
    sums = {w: _Setting(np.zeros(len(val))) for w in settings}
    total_tokens = 0
    for start in range(0, len(val), REROUTE_CHUNK_DOCS):
        rows = np.arange(start, min(start + REROUTE_CHUNK_DOCS, len(val)))
        docs = [doc.tolist() for doc in tokens.documents(rows)]
        chunk.add(docs, doc_routes[rows], start, settings, sums)
        total_tokens += sum(count_scored_tokens(len(d), job.prefix_tokens) for d in docs)

    results = []
    for w in settings:
        total, total_nll = sums[w], float(sums[w].doc_nll.sum())
        results.append({
            "reroute_every": w,
            "ppl": math.exp(total_nll / total_tokens) if total_tokens else float("nan"),
            "nll": total_nll,
            "scored_tokens": total_tokens,
            "decisions": total.decisions,
            "changed_path_fraction": total.changed / total.decisions if total.decisions else 0.0,
            "tokens_off_document_route": total.off_route / total_tokens if total_tokens else 0.0,
        })
    kind = router.featurizer.get("kind")
    context_tokens = int(router.featurizer.get("prefix_tokens", job.prefix_tokens))
    report = {
        "experiment": job.name,
        "checkpoint": ckpt.name + (" (early-stopped paths)" if job.eval.early_stopping else ""),
        "topology": topology.describe(),
        "router": router.kind,
        "featurizer": kind,
        "routing_context": f"the last {context_tokens} tokens before each window",
        "prefix_tokens": job.prefix_tokens,
        "seq_len": job.seq_len,
        "docs": len(val),
        "results": results,
    }
    write_text(exp_dir / REPORT, json_text.dumps(report, indent=2))
    print_reroute_table(report)
    return report


def print_reroute_table(report: dict) -> None:
    echo(f"[eval] {report['experiment']} re-routing ({report['router']} router, {report['featurizer']} on "
         f"{report['routing_context']}), checkpoint {report['checkpoint']}")
    echo(f"{'routing':<16} {'ppl':>9} {'tokens':>9} {'decisions':>9} {'changed':>8} {'off route':>9}")
    for r in report["results"]:
        name = "once per doc" if r["reroute_every"] is None else f"every {r['reroute_every']}"
        echo(f"{name:<16} {r['ppl']:>9.2f} {r['scored_tokens']:>9} {r['decisions']:>9} "
             f"{r['changed_path_fraction']:>8.1%} {r['tokens_off_document_route']:>9.1%}")

