"""dipaco.route.shards: a shard's members, found a chunk at a time."""

from __future__ import annotations

import numpy as np
import pytest

import dipaco.route.shards as shards


@pytest.mark.parametrize("k", [1, 2])
def test_shard_members_in_chunks_are_the_documents_of_the_path(monkeypatch, k):
    monkeypatch.setattr(shards, "MEMBER_CHUNK", 7)
    paths = np.random.default_rng(k).integers(0, 4, (101, k)).astype(np.int32)
    for p in range(5):  # path 4 has no document
        got = shards.shard_members(paths if k > 1 else paths[:, 0], p)
        assert got.dtype == np.int32
        assert got.tolist() == np.flatnonzero((paths == p).any(axis=1)).tolist()
