"""Scoring documents with a causal LM: summed NLL of each document's tokens after the routing prefix.

Shared by evaluation, per-path early stopping and discriminative re-routing, so that all three
count exactly the same tokens (see :mod:`dipaco.data.packing` for which tokens are scored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dipaco.data.packing import (
    IGNORE_INDEX,
    EvalBatch,
    EvalWindow,
    batch_eval_windows,
    count_scored_tokens,
    eval_windows,
)
from dipaco.precision import Precision


@dataclass
class Scores:
    nll: np.ndarray  # (n_docs,) summed NLL of each document's scored tokens
    tokens: np.ndarray  # (n_docs,) scored tokens per document

    @property
    def perplexity(self) -> float:
        total = int(self.tokens.sum())
        return math.exp(float(self.nll.sum()) / total) if total else float("nan")


@torch.no_grad()
def window_nll(model: PreTrainedModel, windows: Sequence[EvalWindow], batch_size: int, pad_id: int,
               precision: Precision | None = None) -> Iterator[tuple[list[int], EvalBatch, torch.Tensor]]:
    """The per-token NLL of ``windows`` under ``model``, shortest windows first (less padding), in
    batches of ``batch_size``: yields (indices into ``windows``, the batch, fp32 NLL of each target
    position 1..width-1 on the model's device, 0 where unscored). ``precision``: the forward pass's
    autocast (fp32 when None); the NLL itself is always computed from fp32 logits."""
    model.eval()
    device = next(model.parameters()).device
    precision = precision or Precision("fp32", device)
    order = sorted(range(len(windows)), key=lambda i: len(windows[i].input_ids))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = next(batch_eval_windows([windows[i] for i in idx], len(idx), pad_id))
        with precision.autocast():
            logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)).logits
        token_nll = F.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), batch.labels[:, 1:].to(device), ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        yield idx, batch, token_nll


@dataclass(frozen=True)
class Scoring:
    """How documents are scored: the evaluation windows and their batches."""

    seq_len: int
    prefix_tokens: int  # the routing prefix: its tokens are context, never scored
    batch_size: int
    pad_id: int
    precision: Precision | None = None


def score_documents(model: PreTrainedModel, docs: Sequence[Sequence[int] | np.ndarray], scoring: Scoring,
                    on_batch: Callable[[int], object] | None = None) -> Scores:
    """Summed NLL over each document's scored tokens (after the prefix) under ``model``; ``on_batch`` is
    called with the number of evaluation windows of each batch done (a progress bar's ``update``)."""
    seq_len, prefix_tokens = scoring.seq_len, scoring.prefix_tokens
    nll = torch.zeros(len(docs), dtype=torch.float64)
    windows = eval_windows(docs, seq_len, prefix_tokens)
    for idx, batch, token_nll in window_nll(model, windows, scoring.batch_size, scoring.pad_id, scoring.precision):
        nll.index_add_(0, batch.doc_index, token_nll.sum(dim=1).double().cpu())
        if on_batch is not None:
            on_batch(len(idx))
    tokens = np.array([count_scored_tokens(len(d), prefix_tokens) for d in docs], dtype=np.int64)
    return Scores(nll.numpy(), tokens)
