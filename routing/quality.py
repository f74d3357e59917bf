"""How good is a routing: shard sizes (documents and tokens per path) and agreement with labels.

Shard balance matters because a path's compute is proportional to its shard; agreement with
reference labels (NMI, ARI, purity) tells whether routing found the corpus' domains.
The report is a plain JSON-able dict. Ratios that would be infinite (an empty shard) are
reported as None, with the empty paths listed, so `json.dumps` never writes `Infinity`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

REPORT_CHUNK = 1 << 20  # documents per bincount: the report's memory does not grow with the corpus


def _shard_stats(sizes: np.ndarray, prefix: str) -> dict[str, Any]:
    smallest, mean = sizes.min(), sizes.mean()
    return {
        f"{prefix}_per_path": sizes.tolist(),
        f"{prefix}_max_min_ratio": None if smallest == 0 else float(sizes.max() / smallest),
        f"{prefix}_max_over_mean": None if mean == 0 else float(sizes.max() / mean),
    }


def _as_numpy(x: Sequence[Any] | np.ndarray | torch.Tensor) -> np.ndarray:
    """A flat array without a copy where one can be avoided (an int32 column stays int32)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().ravel()
    return np.asarray(x).ravel()


def _label_codes(labels: np.ndarray) -> np.ndarray:
    """Non-negative integer labels as they are; any others (strings, negative ids) as codes."""
    if labels.dtype.kind in "iu" and (labels.size == 0 or labels.min() >= 0):
        return labels
    return np.unique(labels, return_inverse=True)[1].ravel()


def contingency(labels: np.ndarray, assign: np.ndarray, num_paths: int, chunk: int = REPORT_CHUNK) -> np.ndarray:
    """(label codes, paths) int64 table of document counts, counted ``chunk`` documents at a time.

    scikit-learn's own contingency (np.unique of both labelings, then a sparse COO -> CSR matrix) holds
    several (N,) int64 arrays at once: 548 MB for 10M documents, where the rest of `dipaco route` needed
    less than that."""
    codes = _label_codes(labels)
    width = int(codes.max(initial=-1)) + 1
    table = np.zeros(width * num_paths, dtype=np.int64)
    for a in range(0, codes.size, chunk):
        cell = codes[a : a + chunk].astype(np.int64) * num_paths + assign[a : a + chunk]
        table += np.bincount(cell, minlength=width * num_paths)
    return table.reshape(width, num_paths)


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0].astype(np.float64)
    if p.size <= 1:
        return 0.0
    return float(-np.sum((p / p.sum()) * (np.log(p) - math.log(p.sum()))))


def nmi_from_table(table: np.ndarray) -> float:
    """scikit-learn's `normalized_mutual_info_score` (arithmetic mean of the entropies), from the table."""
    from sklearn.metrics import mutual_info_score

    rows, cols = table.sum(axis=1), table.sum(axis=0)
    if (rows > 0).sum() == (cols > 0).sum() <= 1:  # one cluster each (or nothing): a perfect match
        return 1.0
    mi = mutual_info_score(None, None, contingency=table[rows > 0][:, cols > 0].astype(np.float64))
    if mi == 0:
        return 0.0
    return float(mi / ((_entropy(rows) + _entropy(cols)) / 2))


def ari_from_table(table: np.ndarray) -> float:
    """scikit-learn's `adjusted_rand_score`, from the pair counts of the table (Python integers: no overflow)."""
    n = int(table.sum())
    rows, cols = table.sum(axis=1), table.sum(axis=0)
    sum_squares = int((table.astype(object) ** 2).sum())
    fp = int((table.astype(object) @ cols.astype(object)).sum()) - sum_squares
    fn = int((table.T.astype(object) @ rows.astype(object)).sum()) - sum_squares
    tp = sum_squares - n
    tn = n * n - fp - fn - sum_squares
    if fn == 0 and fp == 0:
        return 1.0
    return 2.0 * (tp * tn - fn * fp) / ((tp + fn) * (fn + tn) + (tp + fp) * (fp + tn))


def purity_from_table(table: np.ndarray) -> float:
    """Fraction of documents whose path's majority label is their own label."""
    return float(table.max(axis=0).sum() / max(int(table.sum()), 1))


def routing_report(
    assign: Sequence[int] | np.ndarray | torch.Tensor,
    num_paths: int,
    tokens_per_doc: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    labels: Sequence[Any] | np.ndarray | None = None,
    inertia: float | None = None,
    wall_time: float | None = None,
    n_docs: int | None = None,
) -> dict[str, Any]:
    """Summary of a routing: sizes per path, empty paths, and NMI/ARI/purity when labels are given
    (scikit-learn's definitions, counted in chunks: memory does not grow with N beyond the inputs).

    `wall_time` (seconds) with `n_docs` (default: number of assigned documents) gives docs/s.
    """
    a = _as_numpy(assign)
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"path ids must be integers, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= num_paths):
        raise ValueError(f"path ids must be in [0, {num_paths}), got range [{a.min()}, {a.max()}]")
    docs = np.bincount(a, minlength=num_paths)
    empty = np.flatnonzero(docs == 0).tolist()
    report: dict[str, Any] = {
        "num_docs": int(a.size),
        "num_paths": int(num_paths),
        "empty_paths": empty,
        "num_empty_paths": len(empty),
        **_shard_stats(docs, "docs"),
    }
    if tokens_per_doc is not None:
        t = _as_numpy(tokens_per_doc)
        if t.shape != a.shape:
            raise ValueError(f"tokens_per_doc has {t.size} entries for {a.size} documents")
        tokens = np.zeros(num_paths, dtype=np.int64)
        for i in range(0, a.size, REPORT_CHUNK):
            part = np.bincount(a[i : i + REPORT_CHUNK], weights=t[i : i + REPORT_CHUNK], minlength=num_paths)
            tokens += part.astype(np.int64)  # exact: a chunk's sums stay far below 2**53
        report["num_tokens"] = int(tokens.sum())
        report.update(_shard_stats(tokens, "tokens"))
    if labels is not None:
        y = _as_numpy(labels)
        if y.shape != a.shape:
            raise ValueError(f"labels has {y.size} entries for {a.size} documents")
        table = contingency(y, a, num_paths)
        report["nmi"] = nmi_from_table(table)
        report["ari"] = ari_from_table(table)
        report["purity"] = purity_from_table(table)
    if inertia is not None:
        report["inertia"] = float(inertia)
    if wall_time is not None:
        report["wall_time_s"] = float(wall_time)
        n = a.size if n_docs is None else n_docs
        report["docs_per_s"] = None if wall_time <= 0 else float(n / wall_time)
    return report
