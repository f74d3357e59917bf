"""How good is a routing: shard sizes (documents and tokens per path) and agreement with labels.

Shard balance matters because a path's compute is proportional to its shard; agreement with
reference labels (NMI, ARI, purity) tells whether routing found the corpus' domains.
The report is a plain JSON-able dict. Ratios that would be infinite (an empty shard) are
reported as None, with the empty paths listed, so `json.dumps` never writes `Infinity`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _shard_stats(sizes: np.ndarray, prefix: str) -> dict[str, Any]:
    smallest, mean = sizes.min(), sizes.mean()
    return {
        f"{prefix}_per_path": sizes.tolist(),
        f"{prefix}_max_min_ratio": None if smallest == 0 else float(sizes.max() / smallest),
        f"{prefix}_max_over_mean": None if mean == 0 else float(sizes.max() / mean),
    }


def purity(assign: Sequence[int] | np.ndarray, labels: Sequence[Any] | np.ndarray) -> float:
    """Fraction of documents whose path's majority label is their own label."""
    from sklearn.metrics.cluster import contingency_matrix

    table = contingency_matrix(np.asarray(labels), np.asarray(assign))  # (labels, paths)
    return float(table.max(axis=0).sum() / table.sum())


def routing_report(
    assign: Sequence[int] | np.ndarray | torch.Tensor,
    num_paths: int,
    tokens_per_doc: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    labels: Sequence[Any] | np.ndarray | None = None,
    inertia: float | None = None,
    wall_time: float | None = None,
    n_docs: int | None = None,
) -> dict[str, Any]:
    """Summary of a routing: sizes per path, empty paths, and NMI/ARI/purity when labels are given.

    `wall_time` (seconds) with `n_docs` (default: number of assigned documents) gives docs/s.
    """
    a = np.asarray(torch.as_tensor(assign).cpu(), dtype=np.int64).ravel()
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
        t = np.asarray(torch.as_tensor(tokens_per_doc).cpu(), dtype=np.int64).ravel()
        if t.shape != a.shape:
            raise ValueError(f"tokens_per_doc has {t.size} entries for {a.size} documents")
        tokens = np.bincount(a, weights=t, minlength=num_paths).astype(np.int64)
        report["num_tokens"] = int(t.sum())
        report.update(_shard_stats(tokens, "tokens"))
    if labels is not None:
        from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

        y = np.asarray(labels)
        if y.shape != a.shape:
            raise ValueError(f"labels has {y.size} entries for {a.size} documents")
        report["nmi"] = float(normalized_mutual_info_score(y, a))
        report["ari"] = float(adjusted_rand_score(y, a))
        report["purity"] = purity(a, y)
    if inertia is not None:
        report["inertia"] = float(inertia)
    if wall_time is not None:
        report["wall_time_s"] = float(wall_time)
        n = a.size if n_docs is None else n_docs
        report["docs_per_s"] = None if wall_time <= 0 else float(n / wall_time)
    return report
