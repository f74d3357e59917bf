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


@pytest.mark.parametrize("seed", range(6))
def test_chunked_label_scores_equal_sklearn_on_random_labelings(seed, monkeypatch):
    import routing.quality as quality

    monkeypatch.setattr(quality, "REPORT_CHUNK", 7)  # many chunks, the last one short
    rng = np.random.default_rng(seed)
    n, paths = int(rng.integers(1, 200)), int(rng.integers(1, 6))
    assign = rng.integers(0, paths, n).astype(np.int32)
    labels = rng.integers(0, int(rng.integers(1, 5)), n)
    tokens = rng.integers(1, 1000, n).astype(np.int32)
    r = routing_report(assign, paths, tokens_per_doc=tokens, labels=labels)
    assert r["nmi"] == pytest.approx(normalized_mutual_info_score(labels, assign), abs=1e-12)
    assert r["ari"] == pytest.approx(adjusted_rand_score(labels, assign), abs=1e-12)
    assert r["purity"] == pytest.approx(contingency_matrix(labels, assign).max(axis=0).sum() / n)
    assert r["tokens_per_path"] == np.bincount(assign, weights=tokens, minlength=paths).astype(int).tolist()


@pytest.mark.parametrize("labels, assign", [
    ([3, 3, 3], [1, 1, 1]),  # one cluster each: a perfect match
    ([0, 1, 2, 3], [0, 1, 2, 3]),  # identical
    ([0, 0, 1, 1], [0, 1, 0, 1]),  # independent: no mutual information
    ([-1, 5, 5, -1], [1, 0, 0, 1]),  # negative label ids are codes, not offsets
    (["x", "y", "x", "z"], [0, 0, 1, 1]),
])
def test_label_scores_in_sklearns_limit_cases(labels, assign):
    r = routing_report(np.array(assign), 4, labels=labels)
    assert r["nmi"] == pytest.approx(normalized_mutual_info_score(labels, assign))
    assert r["ari"] == pytest.approx(adjusted_rand_score(labels, assign))


def test_label_scores_do_not_copy_the_corpus():
    """Before, scikit-learn's contingency held several (N,) int64 arrays: 548 MB more at 10M documents.
    Counted in chunks, scoring 4M documents allocates no more than a few chunks."""
    import tracemalloc

    n = 4_000_000
    assign = np.arange(n, dtype=np.int32) % 4
    labels = (np.arange(n, dtype=np.int32) // 3) % 6
    tokens = np.full(n, 7, dtype=np.int32)
    tracemalloc.start()
    r = routing_report(assign, 4, tokens_per_doc=tokens, labels=labels)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert r["num_tokens"] == 7 * n
    assert peak < 4 * 8 * (1 << 20) + (1 << 20), peak  # a few chunk-sized int64 temporaries, never (N,) ones
