"""routing_report: shard sizes, empty shards, and label agreement matching scikit-learn."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score
from sklearn.metrics.cluster import contingency_matrix

from routing.quality import routing_report


def test_label_scores_match_sklearn():
    assign = np.array([0, 0, 1, 1, 2, 2, 2, 0, 1, 2])
    labels = ["a", "a", "b", "b", "c", "c", "a", "b", "b", "c"]
    r = routing_report(assign, 3, labels=labels)
    assert r["nmi"] == pytest.approx(normalized_mutual_info_score(labels, assign))
    assert r["ari"] == pytest.approx(adjusted_rand_score(labels, assign))
    table = contingency_matrix(labels, assign)
    assert r["purity"] == pytest.approx(table.max(axis=0).sum() / len(assign))
    assert r["purity"] == pytest.approx(0.8)  # by hand: majorities 2 + 3 + 3 of 10


def test_sizes_tokens_and_empty_shards():
    r = routing_report([0, 0, 2, 2, 2], 4, tokens_per_doc=[10, 20, 1, 1, 1], wall_time=2.0)
    assert r["docs_per_path"] == [2, 0, 3, 0]
    assert r["tokens_per_path"] == [30, 0, 3, 0]
    assert r["empty_paths"] == [1, 3] and r["num_empty_paths"] == 2
    assert r["docs_max_min_ratio"] is None and r["tokens_max_min_ratio"] is None
    assert r["docs_per_s"] == pytest.approx(2.5)
    json.dumps(r, allow_nan=False)  # strict JSON: no Infinity anywhere

    full = routing_report([0, 1, 1, 1], 2, inertia=3.5)
    assert full["docs_max_min_ratio"] == pytest.approx(3.0) and full["inertia"] == 3.5


def test_bad_ids():
    with pytest.raises(ValueError):
        routing_report([0, 3], 3)
    with pytest.raises(ValueError):
        routing_report([0, 1], 2, labels=["a"])
