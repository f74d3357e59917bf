"""The Router artifact: routing rules, save/load round trips, topology checks, bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from routing_testutil import make_blobs

from routing.discriminative import fit_discriminative_router
from routing.featurize import tfidf_svd_features
from routing.kmeans import mixed_radix_encode
from routing.router import Router, RouterFileError, fit_router


@pytest.fixture(scope="module")
def blobs():
    x, y = make_blobs(n_per=100, k=6, dim=8, spread=0.5, seed=0)
    return x, y


def linear_router(x, y, p):
    loglik = torch.nn.functional.one_hot(y, p).double() * 5.0
    w, b = fit_discriminative_router(x, loglik)
    return Router("linear", [p], weight=w, bias=b, featurizer={"kind": "lm_prefix", "prefix_tokens": 32})


def all_routers(x, y):
    plain, _ = fit_router(x, [6], featurizer={"kind": "lm_prefix", "prefix_tokens": 32}, topology={"levels": [6]})
    balanced, _ = fit_router(x, [6], slack=0.1)
    product, _ = fit_router(x, [2, 3], metric="cosine")
    return {"plain": plain, "balanced": balanced, "product": product, "linear": linear_router(x, y, 6)}


@pytest.mark.parametrize("name", ["plain", "balanced", "product", "linear"])
def test_save_load_assign_identical(blobs, tmp_path, name):
    x, y = blobs
    router = all_routers(x, y)[name]
    new = torch.randn(50, 8) * 3
    before, scores = router.assign(new), router.scores(new)
    router.save(tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["router.json", "router.safetensors"]
    loaded = Router.load(tmp_path / "r")
    assert torch.equal(loaded.assign(new), before)
    torch.testing.assert_close(loaded.scores(new), scores)
    assert (loaded.kind, loaded.radices, loaded.metric, loaded.balance_slack) == (
        router.kind, router.radices, router.metric, router.balance_slack)
    assert loaded.featurizer == router.featurizer and loaded.topology == router.topology
    # The unconstrained rule is the argmax of the scores, for every kind.
    assert torch.equal(scores.argmax(dim=1), before)


def test_fit_router_shards(blobs):
    x, y = blobs
    router, labels = fit_router(x, [6], slack=0.0)
    assert np.bincount(labels.numpy()).tolist() == [100] * 6
    assert router.kind == "kmeans" and router.num_paths == 6 and router.balance_slack == 0.0
    assert "inertia" in router.meta and "unbalanced_inertia" in router.meta
    torch.testing.assert_close(router.assign_balanced(x).bincount(), torch.full((6,), 100))
    product, paths = fit_router(x, [2, 3])
    assert product.kind == "product_kmeans" and product.num_paths == 6
    assert torch.equal(paths, product.assign(x))
    capped, paths = fit_router(x, [2, 3], slack=0.0)
    assert np.bincount(paths.numpy(), minlength=6).tolist() == [100] * 6


def test_product_scores_are_sums_of_level_distances():
    c0 = torch.tensor([[0.0], [4.0]])
    c1 = torch.tensor([[0.0], [1.0], [3.0]])
    router = Router("product_kmeans", [2, 3], centroids=[c0, c1])
    x = torch.tensor([[3.0, 2.9], [0.5, -1.0]])
    s = router.scores(x)
    d0 = (x[:, :1] - c0.T) ** 2  # (N, 2)
    d1 = (x[:, 1:] - c1.T) ** 2  # (N, 3)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(s[:, mixed_radix_encode([i, j], [2, 3])], -d0[:, i] - d1[:, j])
    assert router.assign(x).tolist() == [1 * 3 + 2, 0 * 3 + 0]
    assert router.assign_topk(x, 2)[:, 0].tolist() == router.assign(x).tolist()


def test_check_fits(blobs):
    x, y = blobs
    routers = all_routers(x, y)
    routers["plain"].check_fits(6)
    routers["plain"].check_fits(6, [2, 3])  # plain path ids are indices: any 6-path grid
    routers["product"].check_fits(6, [2, 3])
    with pytest.raises(ValueError, match=r"6 paths.*8 paths"):
        routers["plain"].check_fits(8)
    with pytest.raises(ValueError, match=r"\[2, 3\].*\[3, 2\]"):
        routers["product"].check_fits(6, [3, 2])


def test_topology_mismatch_after_load(blobs, tmp_path):
    x, _ = blobs
    router, _ = fit_router(x, [6])
    router.save(tmp_path)
    with pytest.raises(ValueError, match="fitted for 6 paths"):
        Router.load(tmp_path).check_fits(4)


def test_bad_files(blobs, tmp_path):
    x, _ = blobs
    router, _ = fit_router(x, [6])
    with pytest.raises(RouterFileError, match="does not exist"):
        Router.load(tmp_path / "missing")
    d = router.save(tmp_path / "r")
    (d / "router.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RouterFileError, match="corrupt"):
        Router.load(d)
    router.save(d)
    (d / "router.json").write_text("{ truncated")
    with pytest.raises(RouterFileError, match="not valid JSON"):
        Router.load(d)
    router.save(d)
    doc = json.loads((d / "router.json").read_text())
    doc["format_version"] = 99
    (d / "router.json").write_text(json.dumps(doc))
    with pytest.raises(RouterFileError, match="format_version 99"):
        Router.load(d)
    router.save(d)
    (d / "router.json").unlink()
    with pytest.raises(RouterFileError, match="no router.json"):
        Router.load(d)
    assert issubclass(RouterFileError, ValueError)


def test_invalid_routers():
    with pytest.raises(ValueError, match="kind"):
        Router("tree", [2])
    with pytest.raises(ValueError, match="radix"):
        Router("kmeans", [3], centroids=[torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="classes"):
        Router("linear", [4], weight=torch.zeros(3, 2), bias=torch.zeros(3))
    router = Router("kmeans", [2], centroids=[torch.zeros(2, 4)])
    with pytest.raises(ValueError, match="4-dim"):
        router.assign(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="NaN"):
        router.assign(torch.full((3, 4), float("nan")))


def test_tfidf_router_featurizes_new_text_after_reload(tmp_path):
    texts = ["cats and dogs play", "dogs chase cats", "stocks and bonds fall", "bonds and stocks rise",
             "the team scores a goal", "a late goal wins the match"] * 4
    feats, fitted = tfidf_svd_features(texts, n_components=3, min_df=1, max_df=1.0)
    router, labels = fit_router(feats, [3], text_model=fitted, metric="cosine")
    assert router.featurizer["kind"] == "tfidf_svd"
    router.save(tmp_path)
    loaded = Router.load(tmp_path)
    new = ["dogs and cats", "bonds fall", "goal!"]
    assert torch.equal(loaded.assign(loaded.featurize(new)), router.assign(router.featurize(new)))
    assert torch.equal(loaded.assign(loaded.featurize(texts)), labels)


def test_lm_router_featurize_needs_model(tiny_llama, tiny_tokenizer):
    router = Router("kmeans", [2], centroids=[torch.randn(2, 32)], featurizer={"kind": "lm_prefix", "prefix_tokens": 4})
    with pytest.raises(ValueError, match="model and tokenizer"):
        router.featurize(["the cat"])
    f = router.featurize(["the cat sat on a mat", "dog"], model=tiny_llama, tokenizer=tiny_tokenizer,
                         show_progress=False)
    assert f.shape == (2, 32) and router.assign(f).shape == (2,)
