"""Choices made by hashing document ids: stable across runs, machines and the order of the corpus.

Every salted choice (train/validation split, iid shards, early-stopping and re-routing holdouts)
hashes ``f"{salt}:{id}"`` with :func:`dipaco.data.corpus.stable_hash`, so choices with different salts
are independent of each other.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dipaco.data.corpus import stable_hash


def holdout_mask(ids: Iterable[str], fraction: float, salt: str) -> np.ndarray:
    """True for about ``fraction`` of the documents, chosen by a hash of ``salt`` and the id."""
    return np.fromiter((stable_hash(f"{salt}:{i}") % 10_000 < fraction * 10_000 for i in ids), dtype=bool)
