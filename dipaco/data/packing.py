"""Token layouts: packed fixed-length training rows, and per-document evaluation windows.

Training packs a shard's documents into one stream, doc0 EOS doc1 EOS ..., cut into rows of
seq_len tokens (the last partial row is dropped).

Evaluation scores each document on its own, so its perplexity does not depend on which other
documents share its path. Token j of a document is a *scored target* iff j >= prefix_tokens and
j >= 1: the first prefix_tokens tokens are the routing context, never scored for any model, and
token 0 has nothing to be predicted from. Labels follow the HF causal-LM convention: the loss at
position i predicts input_ids[i] from the tokens before it, and -100 means "not scored".

A document longer than seq_len is cut into windows of at most seq_len tokens that overlap by one
token (stride seq_len - 1). Every scored token is then a target in exactly one window, with its
preceding token in the same window; the shared first token of a later window is context only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dipaco.errors import ConfigError, DataError

IGNORE_INDEX = -100  # label of a position that is not scored (torch/HF cross-entropy convention)


# ----------------------------------------------------------------------------- training


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate docs with an EOS after each one and cut into rows: a (n_rows, seq_len) LongTensor."""
    if seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be positive")
    if len(docs) == 0:
        raise DataError("cannot pack an empty shard (no documents)")

    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    total = int(lengths.sum()) + len(docs)  # one EOS per document
    if total < seq_len:
        raise DataError(
            f"shard has {total} tokens (with one EOS per document), fewer than seq_len={seq_len}: "
            "use more documents per shard or a shorter seq_len"
        )

    # Fill the EOS slots (each document's end, shifted by the EOS tokens before it), then the tokens.
    stream = np.empty(total, dtype=np.int64)
    eos_positions = np.cumsum(lengths + 1) - 1
    is_token = np.ones(total, dtype=bool)
    is_token[eos_positions] = False
    stream[eos_positions] = eos_id
    non_empty = [np.asarray(d, dtype=np.int64) for d in docs if len(d)]
    if non_empty:
        stream[is_token] = np.concatenate(non_empty)

    n_rows = total // seq_len
    return torch.from_numpy(stream[: n_rows * seq_len].reshape(n_rows, seq_len))


# ----------------------------------------------------------------------------- evaluation


@dataclass
class EvalWindow:
    """One window of one document: tokens doc[start : start + len(input_ids)]."""

    doc_index: int
    start: int
    input_ids: torch.Tensor  # (T,), T <= seq_len
    labels: torch.Tensor  # (T,), IGNORE_INDEX where not scored in this window


@dataclass
class EvalBatch:
    input_ids: torch.Tensor  # (B, T), right-padded with pad_id
    attention_mask: torch.Tensor  # (B, T), 0 on padding
    labels: torch.Tensor  # (B, T), IGNORE_INDEX where not scored and on padding
    doc_index: torch.Tensor  # (B,), the source document of each row


def count_scored_tokens(doc_len: int, prefix_tokens: int) -> int:
    """Number of scored targets in a document: tokens j with max(prefix_tokens, 1) <= j < doc_len."""
    return max(doc_len - max(prefix_tokens, 1), 0)


def unscored_docs(docs: Sequence[Sequence[int]], prefix_tokens: int) -> list[int]:
    """Indices of documents too short to have any scored token (they get no eval windows)."""
    return [i for i, doc in enumerate(docs) if count_scored_tokens(len(doc), prefix_tokens) == 0]


def eval_windows(docs: Sequence[Sequence[int]], seq_len: int, prefix_tokens: int) -> list[EvalWindow]:
    """Cut every document into windows that score each of its scored tokens exactly once.

    Documents without scored tokens (doc_len <= max(prefix_tokens, 1)) produce no window; count
    them with `unscored_docs`. Windows that would hold only routing context are skipped too.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len={seq_len} must be at least 2 to score a token from its predecessor")
    if prefix_tokens < 0:
        raise ConfigError(f"prefix_tokens={prefix_tokens} must be >= 0")

    windows = []
    first_scored = max(prefix_tokens, 1)
    for doc_index, doc in enumerate(docs):
        if count_scored_tokens(len(doc), prefix_tokens) == 0:
            continue
        tokens = torch.as_tensor(doc, dtype=torch.long)
        for start in _window_starts(len(tokens), seq_len):
            window = tokens[start : start + seq_len]
            labels = window.clone()
            # Position 0 of a window has no context inside it: the first window's token 0 is never
            # scored, and a later window's token 0 was scored as the last target of the previous one.
            labels[: max(first_scored - start, 1)] = IGNORE_INDEX
            if (labels != IGNORE_INDEX).any():
                windows.append(EvalWindow(doc_index=doc_index, start=start, input_ids=window, labels=labels))
    return windows


def _window_starts(doc_len: int, seq_len: int) -> range:
    # Windows [s, s + seq_len) with s = 0, seq_len-1, 2(seq_len-1), ... until one reaches the end.
    stride = seq_len - 1
    n_windows = max(-(-(doc_len - 1) // stride), 1)  # ceil((doc_len - 1) / stride)
    return range(0, n_windows * stride, stride)


def batch_eval_windows(windows: Sequence[EvalWindow], batch_size: int, pad_id: int) -> Iterator[EvalBatch]:
    """Group windows, in order, into batches right-padded to the longest window of each batch.

    Sorting windows by length first (e.g. sorted(windows, key=lambda w: len(w.input_ids))) wastes
    less compute on padding; the scores do not change.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be positive")
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        width = max(len(w.input_ids) for w in group)
        input_ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(group), width), dtype=torch.long)
        labels = torch.full((len(group), width), IGNORE_INDEX, dtype=torch.long)
        for row, w in enumerate(group):
            n = len(w.input_ids)
            input_ids[row, :n] = w.input_ids
            attention_mask[row, :n] = 1
            labels[row, :n] = w.labels
        doc_index = torch.tensor([w.doc_index for w in group], dtype=torch.long)
        yield EvalBatch(input_ids=input_ids, attention_mask=attention_mask, labels=labels, doc_index=doc_index)
