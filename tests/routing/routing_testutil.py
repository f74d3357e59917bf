"""Helpers shared by the routing tests (imported directly; fixtures live in conftest.py)."""

from __future__ import annotations

import torch


def make_blobs(
    n_per: int, k: int, dim: int, spread: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """k well-separated Gaussian blobs of n_per points each, shuffled; returns (x, labels)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(k, dim, generator=g) * 3.0
    labels = torch.arange(k).repeat_interleave(n_per)
    x = centers[labels] + spread * torch.randn(k * n_per, dim, generator=g)
    perm = torch.randperm(k * n_per, generator=g)
    return x[perm], labels[perm]


WORDS = (
    "the cat sat on a mat dog ran in park red blue green sun moon star river tree "
    "house car road city music song dance food bread milk water fire stone"
).split()
