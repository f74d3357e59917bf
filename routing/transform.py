"""Feature post-processing before k-means: centring, PCA whitening, L2 normalisation.

Mean-pooled hidden states of a small LM are dominated by a few directions every document shares
(the common mean, and high-variance "rogue" dimensions that track position and frequency, not
topic). Euclidean or cosine k-means on them splits the corpus along those directions, which is
why the raw LM-prefix clusters are close to chance. The standard remedy for sentence embeddings
(BERT-whitening, Su et al. 2021, arXiv 2103.15316) is to centre, rotate onto the principal axes
and divide each by its standard deviation, so every direction weighs the same, then put every
document on the unit sphere for cosine k-means.

    z = normalize((x - mean) @ V_r diag(1 / sqrt(lambda_r + eps)))

with V_r the top-r eigenvectors and lambda_r the eigenvalues of the training features'
covariance. ``whiten=False`` keeps the rotation without the scaling (centring + PCA + L2).
The fitted transform is plain arrays, saved inside the router artifact, and the router applies
it to every feature vector it is given, so training, evaluation and serving route alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from routing.validate import Features, as_features

KINDS = ("center_l2", "pca_l2", "whiten_l2")
# Eigenvalues below this fraction of the largest are numerical noise; whitening would blow them up.
RELATIVE_EIGEN_FLOOR = 1e-6


@dataclass
class FeatureTransform:
    """x -> normalize((x - mean) @ projection); projection is the identity for ``center_l2``."""

    kind: str  # one of KINDS
    mean: torch.Tensor  # (D,)
    projection: torch.Tensor | None = None  # (D, r); None for center_l2

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"feature transform kind must be one of {KINDS}, got {self.kind!r}")
        self.mean = torch.as_tensor(self.mean, dtype=torch.float32).cpu()
        if self.mean.dim() != 1:
            raise ValueError(f"transform mean must be 1-D, got shape {tuple(self.mean.shape)}")
        if (self.projection is None) != (self.kind == "center_l2"):
            raise ValueError(f"a {self.kind} transform {'has no' if self.kind == 'center_l2' else 'needs a'} projection")
        if self.projection is not None:
            self.projection = torch.as_tensor(self.projection, dtype=torch.float32).cpu()
            if self.projection.dim() != 2 or self.projection.shape[0] != self.mean.shape[0]:
                raise ValueError(f"projection shape {tuple(self.projection.shape)} does not match the "
                                 f"{self.mean.shape[0]}-dim mean")

    @property
    def in_dim(self) -> int:
        return int(self.mean.shape[0])

    @property
    def out_dim(self) -> int:
        return self.in_dim if self.projection is None else int(self.projection.shape[1])

    def __call__(self, features: Features) -> torch.Tensor:
        x = as_features(features)
        if x.shape[1] != self.in_dim:
            raise ValueError(f"feature transform expects {self.in_dim}-dim features, got {x.shape[1]}")
        z = x - self.mean.to(x.device)
        if self.projection is not None:
            z = z @ self.projection.to(x.device)
        return F.normalize(z, dim=1)

    @classmethod
    def fit(cls, features: Features, kind: str = "whiten_l2", components: int | None = None) -> FeatureTransform:
        """Fit on the training features. ``components`` keeps the top-r principal axes (None: all
        whose eigenvalue is above a numerical floor)."""
        if kind not in KINDS:
            raise ValueError(f"feature transform kind must be one of {KINDS}, got {kind!r}")
        x = as_features(features).double()
        if x.shape[0] < 2:
            raise ValueError(f"fitting a feature transform needs >= 2 documents, got {x.shape[0]}")
        mean = x.mean(dim=0)
        if kind == "center_l2":
            return cls(kind, mean.float())
        centred = x - mean
        # Right singular vectors of the centred data are the covariance's eigenvectors.
        _, s, vt = torch.linalg.svd(centred, full_matrices=False)
        eigen = s**2 / (x.shape[0] - 1)
        keep = int((eigen > RELATIVE_EIGEN_FLOOR * eigen[0]).sum())
        if components is not None:
            if components < 1:
                raise ValueError(f"components must be >= 1, got {components}")
            keep = min(keep, components)
        projection = vt[:keep].T
        if kind == "whiten_l2":
            projection = projection / eigen[:keep].sqrt()
        return cls(kind, mean.float(), projection.float())

    # Persistence (see routing.router): JSON-able state + tensors for safetensors.
    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "in_dim": self.in_dim, "out_dim": self.out_dim}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"mean": self.mean.contiguous()}
        if self.projection is not None:
            out["projection"] = self.projection.contiguous()
        return out

    @classmethod
    def from_parts(cls, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> FeatureTransform:
        return cls(state["kind"], tensors["mean"], tensors.get("projection"))
