"""Overlapping training shards (route.topk > 1): which documents each path trains, and the outer weights."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from dipaco.data.packing import pack_documents
from dipaco.errors import DataError
from dipaco.route.shards import (
    build_shards,
    overlap_token_shares,
    overlapping_paths,
    path_weights,
    shard_members,
)


def routed_docs(paths, topk, lengths) -> datasets.Dataset:
    return datasets.Dataset.from_dict({
        "id": [f"d{i}" for i in range(len(paths))], "path": paths, "paths_topk": topk,
        "input_ids": [list(range(1, n + 1)) for n in lengths], "num_tokens": lengths,
    })


def test_each_document_trains_its_routed_path_then_its_best_other():
    # Doc 1 was moved by balancing away from its best path (2); doc 3's best two exclude its own path.
    ds = routed_docs([0, 1, 2, 1], [[0, 2, 1], [2, 1, 0], [2, 0, 1], [0, 2, 1]], [5, 6, 7, 8])
    two = overlapping_paths(ds, np.asarray(ds["path"]), 2)
    assert two.tolist() == [[0, 2], [1, 2], [2, 0], [1, 0]]
    assert overlapping_paths(ds, np.asarray(ds["path"]), 1).tolist() == [[0], [1], [2], [1]]
    members = [shard_members(two, p) for p in range(3)]
    assert [m.tolist() for m in members] == [[0, 2, 3], [1, 3], [0, 1, 2]]
    with pytest.raises(DataError, match="holds 3 best paths per document"):
        overlapping_paths(ds, np.asarray(ds["path"]), 4)
    with pytest.raises(DataError, match="needs the `paths_topk` column"):
        overlapping_paths(ds.remove_columns("paths_topk"), np.asarray(ds["path"]), 2)


def test_shards_hold_every_member_and_weights_count_each_document_once():
    lengths = [30, 10, 20, 40]
    ds = routed_docs([0, 1, 2, 1], [[0, 2, 1], [2, 1, 0], [2, 0, 1], [0, 2, 1]], lengths)
    two = overlapping_paths(ds, np.asarray(ds["path"]), 2)
    shards = build_shards(ds, two, 3, seq_len=8, eos_id=0)
    single = build_shards(ds, np.asarray(ds["path"]), 3, seq_len=8, eos_id=0)
    # Packed tokens (documents + one EOS each, cut to whole sequences) of the members of each shard.
    assert [s.numel() for s in shards] == [(31 + 21 + 41) // 8 * 8, (11 + 41) // 8 * 8, (31 + 11 + 21) // 8 * 8]
    assert [a.numel() > b.numel() for a, b in zip(shards, single)] == [True, False, True]  # path 1 gains nobody
    shares = overlap_token_shares(two, 3, lengths)
    assert shares == pytest.approx([0.5, 0.5, 0.5])  # every document trains two paths
    weights = path_weights(shards, "tokens", shares)
    assert weights == {p: s.numel() * 0.5 for p, s in enumerate(shards)}
    # Sum of weights = the tokens of the corpus counted once, not twice (up to packing remainders).
    assert sum(weights.values()) == pytest.approx(sum(s.numel() for s in single), rel=0.15)
    assert path_weights(single, "tokens") == {p: float(s.numel()) for p, s in enumerate(single)}
    assert overlap_token_shares(np.asarray(ds["path"]), 3, lengths) == [1.0, 1.0, 1.0]
    assert path_weights(shards, "uniform", shares) == {0: 1.0, 1: 1.0, 2: 1.0}


def test_shares_follow_each_documents_own_multiplicity():
    # Document 0 trains two paths, document 1 only one (its row repeats the same path).
    shares = overlap_token_shares(np.array([[0, 1], [1, 1]]), 2, [10, 30])
    assert shares == pytest.approx([0.5, (5 + 30) / 40])
    shard = build_shards(routed_docs([0, 1], [[0, 1], [1, 0]], [9, 9]), np.array([[0, 1], [1, 1]]), 2, 4, 0)[1]
    assert torch.equal(shard.materialize(), pack_documents([list(range(1, 10))] * 2, 4, 0))  # each document once
