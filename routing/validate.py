"""Input checks shared by every routing component.

Routing runs once, before training, on features that came out of a model or a
TF-IDF pipeline. A single NaN row would silently poison k-means (every distance
to it is NaN and argmin picks cluster 0), so we refuse such input loudly and say
where the bad rows are.
"""

from __future__ import annotations

import numpy as np
import torch

Features = torch.Tensor | np.ndarray


def as_features(features: Features, name: str = "features") -> torch.Tensor:
    """Return `features` as a 2-D float32 tensor, raising ValueError if it is not finite."""
    x = torch.as_tensor(features)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (N, D), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        x = x.float()
    x = x.float()  # float32 everywhere: matmul-based distances are fast and precise enough
    check_finite(x, name)
    return x


def check_finite(x: torch.Tensor, name: str = "features", show: int = 10) -> None:
    """Raise ValueError naming the number of rows holding NaN/inf and the first few indices."""
    bad = ~torch.isfinite(x)
    if x.dim() > 1:
        bad = bad.flatten(1).any(dim=1)
    if bad.any():
        rows = torch.nonzero(bad).flatten()
        first = rows[:show].tolist()
        raise ValueError(
            f"{name}: {rows.numel()} row(s) contain NaN or inf; first indices: {first}"
        )
