"""Arranging k-means clusters on a grid: the numbering solver, the divergences, the renumbered router."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from routing_testutil import make_blobs
from scipy.spatial.distance import jensenshannon

from routing.arrange import arrange_clusters, arrangement_cost, js_divergences
from routing.router import Router, fit_router

# Blocks shared by the paths of a 2x2 grid of 2-block levels, path p = (p // 2, p % 2): p and 3 - p share none.
GRID_2X2 = np.array([[4, 2, 2, 0], [2, 4, 0, 2], [2, 0, 4, 2], [0, 2, 2, 4]])


def grid_shared(radices: list[int], blocks: int = 2) -> np.ndarray:
    digits = list(itertools.product(*(range(r) for r in radices)))
    return np.array([[blocks * sum(a == b for a, b in zip(p, q)) for q in digits] for p in digits])


def random_dissimilarity(p: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).random((p, p))
    d = x + x.T
    np.fill_diagonal(d, 0.0)
    return d


def brute_force(shared: np.ndarray, dis: np.ndarray, sign: float) -> float:
    p = len(dis)
    return min(sign * sum(shared[perm[c], perm[d]] * dis[c, d] for c in range(p) for d in range(c + 1, p))
               for perm in itertools.permutations(range(p)))


@pytest.mark.parametrize("radices", [[2, 2], [2, 3], [2, 2, 2]])
@pytest.mark.parametrize("mode,sign", [("similar", 1.0), ("dissimilar", -1.0)])
def test_exact_arrangement_is_the_best_of_every_numbering(radices, mode, sign):
    shared = grid_shared(radices)
    dis = random_dissimilarity(len(shared), seed=len(shared))
    found = arrange_clusters(shared, dis, mode)
    assert found.exact
    assert sorted(found.perm.tolist()) == list(range(len(shared)))
    assert sign * found.cost == pytest.approx(brute_force(shared, dis, sign))
    assert found.cost == pytest.approx(arrangement_cost(found.perm, shared, dis))
    assert found.identity_cost == pytest.approx(arrangement_cost(np.arange(len(shared)), shared, dis))


def test_alike_clusters_share_a_module_and_unlike_ones_sit_diagonally():
    # Clusters 0 and 3 are alike, and 1 and 2: k-means' numbering put each alike pair on a diagonal of the
    # 2x2 grid, paths (0, 3) and (1, 2), which share no block.
    dis = np.array([[0, 1, 1, 0.1], [1, 0, 0.1, 1], [1, 0.1, 0, 1], [0.1, 1, 1, 0]])

    def apart(perm: np.ndarray) -> set[tuple[int, int]]:  # cluster pairs on paths that share no block
        return {(c, d) for c, d in itertools.combinations(range(4), 2) if GRID_2X2[perm[c], perm[d]] == 0}

    assert apart(np.arange(4)) == {(0, 3), (1, 2)}
    similar = arrange_clusters(GRID_2X2, dis, "similar")
    assert similar.cost < similar.identity_cost
    assert not apart(similar.perm) & {(0, 3), (1, 2)}  # each alike pair now shares a module
    dissimilar = arrange_clusters(GRID_2X2, dis, "dissimilar")
    assert apart(dissimilar.perm) == {(0, 3), (1, 2)}  # already the worst: kept apart
    assert dissimilar.perm.tolist() == [0, 1, 2, 3]  # ties keep k-means' numbering
    assert dissimilar.cost > similar.cost


def test_a_flat_mixture_keeps_the_k_means_numbering():
    shared = np.diag([4] * 4)  # no block shared between paths: every numbering costs the same
    for mode in ("similar", "dissimilar"):
        found = arrange_clusters(shared, random_dissimilarity(4, seed=1), mode)
        assert found.perm.tolist() == [0, 1, 2, 3] and found.cost == found.identity_cost == 0.0


def test_local_search_beyond_eight_paths_finds_planted_rows_of_a_4x4_grid():
    # 16 clusters in 4 groups of alike ones: the best numbering puts each group on a row of the grid
    # (one level-0 module). Start from a numbering that scatters every group.
    shared = grid_shared([4, 4])
    group = np.arange(16) % 4
    dis = np.where(group[:, None] == group[None, :], 0.05, 1.0)
    np.fill_diagonal(dis, 0.0)
    found = arrange_clusters(shared, dis, "similar", seed=0)
    assert not found.exact
    planted = np.argsort(group, kind="stable").argsort()  # cluster -> path: group g fills row g
    assert found.cost <= arrangement_cost(planted, shared, dis) + 1e-9
    assert found.cost < found.identity_cost
    rows = found.perm // 4
    assert all(len(set(rows[group == g])) == 1 for g in range(4))  # each group on one row


def test_js_divergences_match_scipy():
    counts = np.random.default_rng(0).integers(0, 20, size=(3, 50))
    counts[0, :10] = 0  # a token one cluster never uses
    got = js_divergences(counts)
    for a, b in itertools.combinations(range(3), 2):
        assert got[a, b] == got[b, a] == pytest.approx(jensenshannon(counts[a], counts[b]) ** 2)
    assert np.allclose(np.diag(got), 0.0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        arrange_clusters(GRID_2X2, random_dissimilarity(4, 0), "closest")
    with pytest.raises(ValueError, match=r"shared must be a \(4, 4\) matrix"):
        arrange_clusters(np.eye(3), random_dissimilarity(4, 0))
    with pytest.raises(ValueError, match="dissimilarity must be symmetric"):
        arrange_clusters(GRID_2X2, np.arange(16.0).reshape(4, 4))
    with pytest.raises(ValueError, match="non-finite"):
        arrange_clusters(GRID_2X2, np.full((4, 4), np.nan))
    with pytest.raises(ValueError, match=r"clusters \[1\] have no tokens"):
        js_divergences(np.array([[1, 2], [0, 0]]))


def test_a_renumbered_router_sends_cluster_c_to_path_perm_c(tmp_path):
    x, _ = make_blobs(n_per=50, k=4, dim=6, spread=0.3, seed=0)
    router, labels = fit_router(x, [4], slack=0.1, seed=0)
    perm = np.array([2, 0, 3, 1])
    renumbered = router.renumbered(perm, arrangement={"perm": perm.tolist()})
    assert renumbered.assign(x).tolist() == perm[router.assign(x).numpy()].tolist()
    assert renumbered.assign_balanced(x).tolist() == perm[labels.numpy()].tolist()
    assert torch.equal(renumbered.scores(x)[:, perm], router.scores(x))
    assert router.meta.get("arrangement") is None  # the original is left as it was
    loaded = Router.load(renumbered.save(tmp_path / "router"))
    assert loaded.meta["arrangement"]["perm"] == [2, 0, 3, 1]
    assert loaded.assign(x).tolist() == renumbered.assign(x).tolist()
    with pytest.raises(ValueError, match="must be a permutation of range"):
        router.renumbered([0, 0, 1, 2])
    product, _ = fit_router(x, [2, 2], seed=0)
    with pytest.raises(ValueError, match="only a kmeans router"):
        product.renumbered([0, 1, 2, 3])
