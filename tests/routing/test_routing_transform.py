"""Feature transforms (centring, PCA whitening, L2) and routers that keep one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from routing_testutil import make_blobs

from routing.router import Router, fit_router
from routing.transform import FeatureTransform


def correlated(n: int = 400, d: int = 6, seed: int = 0) -> torch.Tensor:
    """Gaussian data with a non-zero mean and a strongly non-isotropic covariance."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(d, d, generator=g) * torch.tensor([10.0, 5.0, 2.0, 1.0, 0.5, 0.1])
    return torch.randn(n, d, generator=g) @ mixing + torch.arange(d, dtype=torch.float32) * 3


def covariance(z: torch.Tensor) -> torch.Tensor:
    zc = z.double() - z.double().mean(dim=0)
    return zc.T @ zc / (z.shape[0] - 1)


def test_whitening_gives_identity_covariance_before_normalisation():
    x = correlated()
    t = FeatureTransform.fit(x, "whiten_l2")
    z = (x.double() - t.mean.double()) @ t.projection.double()  # the transform without its final L2
    torch.testing.assert_close(covariance(z), torch.eye(6, dtype=torch.float64), atol=1e-4, rtol=0)
    out = t(x)
    torch.testing.assert_close(out, F.normalize(z.float(), dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(len(x)), atol=1e-5, rtol=0)


def test_pca_keeps_distances_of_centred_data_and_truncates_to_the_top_axes():
    x = correlated()
    full = FeatureTransform.fit(x, "pca_l2")
    z = (x - full.mean) @ full.projection
    # A rotation: the projection is orthonormal, so norms of centred rows are kept.
    torch.testing.assert_close(z.norm(dim=1), (x - x.mean(dim=0)).norm(dim=1), atol=1e-3, rtol=1e-4)
    top2 = FeatureTransform.fit(x, "whiten_l2", components=2)
    assert top2.out_dim == 2 and top2.in_dim == 6
    variances = torch.diagonal(covariance((x - full.mean) @ full.projection))
    assert torch.all(variances[:-1] >= variances[1:])  # axes in order of decreasing variance


def test_center_l2_and_rank_deficient_features():
    x = correlated()
    t = FeatureTransform.fit(x, "center_l2")
    torch.testing.assert_close(t(x), F.normalize(x - x.mean(dim=0), dim=1))
    # A duplicated column adds a zero-variance direction: whitening drops it instead of dividing by 0.
    dup = torch.cat([x, x[:, :1]], dim=1)
    w = FeatureTransform.fit(dup, "whiten_l2")
    assert w.out_dim == 6 and torch.isfinite(w(dup)).all()


def test_bad_transform_input_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        FeatureTransform.fit(correlated(), "zca")
    with pytest.raises(ValueError, match=">= 2 documents"):
        FeatureTransform.fit(torch.ones(1, 3), "whiten_l2")
    with pytest.raises(ValueError, match="expects 6-dim"):
        FeatureTransform.fit(correlated(), "whiten_l2")(torch.ones(2, 5))


def test_router_with_transform_routes_raw_features_and_round_trips(tmp_path):
    # Blobs hidden under a huge shared offset along one axis and a large nuisance dimension.
    x, labels = make_blobs(60, 3, 8, spread=0.3, seed=1)
    noise = torch.randn(len(x), generator=torch.Generator().manual_seed(2)) * 50.0
    raw = torch.cat([x + 100.0, noise[:, None]], dim=1)
    t = FeatureTransform.fit(raw, "whiten_l2")
    router, paths = fit_router(raw, [3], metric="cosine", slack=0.1, seed=0, n_init=2, transform=t)
    assert router.dim == 9 and router.transform is t
    plain, plain_paths = fit_router(t(raw), [3], metric="cosine", slack=0.1, seed=0, n_init=2)
    assert torch.equal(paths, plain_paths)  # k-means ran on the transformed features
    assert torch.equal(router.assign(raw), plain.assign(t(raw)))
    torch.testing.assert_close(router.scores(raw), plain.scores(t(raw)))
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r")
    assert loaded.transform is not None and loaded.transform.kind == "whiten_l2"
    assert torch.equal(loaded.assign(raw), router.assign(raw))
    with pytest.raises(ValueError, match="expects 9-dim"):
        loaded.assign(t(raw)[:, :4])


def test_router_refuses_a_transform_of_the_wrong_width():
    x, _ = make_blobs(20, 2, 4)
    with pytest.raises(ValueError, match="gives 4-dim features but the kmeans router routes 3-dim"):
        Router("kmeans", [2], centroids=[torch.zeros(2, 3)], transform=FeatureTransform.fit(x, "pca_l2"))
