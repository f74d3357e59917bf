"""Product k-means and the mixed-radix path numbering shared with the trainer's topology."""

from __future__ import annotations

import itertools

import pytest
import torch

from routing.kmeans import mixed_radix_decode, mixed_radix_encode, product_kmeans, split_dims


def test_encode_decode_are_inverse():
    radices = [3, 4, 2]
    digits = list(itertools.product(*(range(r) for r in radices)))
    # Level 0 is the most significant digit: enumeration order is the path order.
    assert [mixed_radix_encode(d, radices) for d in digits] == list(range(24))
    assert [tuple(mixed_radix_decode(i, radices)) for i in range(24)] == digits
    t = torch.tensor(digits)
    assert torch.equal(mixed_radix_decode(mixed_radix_encode(t, radices), radices), t)


def test_hand_example():
    assert mixed_radix_encode([1, 2], [2, 3]) == 5  # 1*3 + 2
    assert mixed_radix_encode([2, 0, 1], [3, 4, 2]) == (2 * 4 + 0) * 2 + 1
    assert mixed_radix_decode(17, [3, 4, 2]) == [2, 0, 1]


def test_out_of_range():
    with pytest.raises(ValueError):
        mixed_radix_encode([2, 0], [2, 3])
    with pytest.raises(ValueError):
        mixed_radix_decode(6, [2, 3])
    with pytest.raises(ValueError):
        mixed_radix_encode([1], [2, 3])


def test_split_dims():
    assert split_dims(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_dims(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError):
        split_dims(2, 3)


def test_product_kmeans_paths_follow_mixed_radix():
    # Planted grid: the first 3 dims pick one of 2 clusters, the last 3 one of 3 clusters.
    g = torch.Generator().manual_seed(0)
    a = torch.tensor([[0.0, 0, 0], [9, 9, 9]])
    b = torch.tensor([[0.0, 0, 0], [9, 0, 0], [0, 9, 0]])
    ia, ib = torch.randint(2, (600,), generator=g), torch.randint(3, (600,), generator=g)
    x = torch.cat([a[ia], b[ib]], dim=1) + 0.1 * torch.randn(600, 6, generator=g)
    res = product_kmeans(x, [2, 3], seed=0)
    assert res.digits.shape == (600, 2) and res.radices == [2, 3]
    assert torch.equal(res.paths, mixed_radix_encode(res.digits, [2, 3]))
    assert torch.equal(res.paths, res.digits[:, 0] * 3 + res.digits[:, 1])
    # Each level recovers its planted factor (up to renaming the clusters).
    for level, truth in ((0, ia), (1, ib)):
        pairs = set(zip(res.digits[:, level].tolist(), truth.tolist()))
        assert len(pairs) == (2, 3)[level]
    assert len(set(res.paths.tolist())) == 6
