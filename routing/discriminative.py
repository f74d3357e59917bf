"""Discriminative re-routing (DiPaCo §2.4.2), the part that needs no trainer.

The trainer scores every path on a small held-out set of documents (sum of token
log-likelihoods). Here we turn those scores into a linear router:

1. label(doc) = the path with the highest log-likelihood;
2. fit a multinomial logistic regression features -> label;
3. shift the per-path biases until the predicted shard sizes on these features match the
   wanted sizes, because otherwise paths that rarely win starve and get ever smaller.

A path that wins no document would have no class to learn (and several such paths, all
with zero weights, could never be told apart). Each such path therefore borrows a few
documents: those it comes closest to winning (smallest log-likelihood gap to the winner),
`borrow` x its target share, at least one. The bias adjustment then sets its real size.

The result plugs into `routing.router.Router(kind="linear", weight=..., bias=...)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from routing.validate import Features, as_features, check_finite


def _targets(target_sizes: Sequence[float] | str, p: int) -> torch.Tensor:
    """Wanted fraction of documents per path (sums to 1)."""
    if isinstance(target_sizes, str):
        if target_sizes != "uniform":
            raise ValueError(f"target_sizes must be 'uniform' or a sequence, got {target_sizes!r}")
        return torch.full((p,), 1.0 / p, dtype=torch.float64)
    t = torch.as_tensor(list(target_sizes), dtype=torch.float64)
    if t.shape != (p,) or bool((t < 0).any()) or float(t.sum()) <= 0:
        raise ValueError(f"target_sizes must be {p} non-negative numbers with a positive sum")
    return t / t.sum()


def shard_fractions(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Fraction of documents each path wins under argmax(logits + bias)."""
    wins = (logits + bias).argmax(dim=1)
    return torch.bincount(wins, minlength=logits.shape[1]).double() / logits.shape[0]


def adjust_bias(
    logits: torch.Tensor,
    target: torch.Tensor,
    tol: float = 0.02,
    max_iter: int = 500,
    lr: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """Bias shift so argmax shares match `target` within total-variation distance `tol`.

    Multiplicative update on the implied shares: bias_c += lr * log(target_c / predicted_c).
    Predicted shares are smoothed by half a document so a path that wins nothing still gets
    a finite push; the step shrinks whenever the fit stops improving (hard argmax shares
    are piecewise constant, so a fixed step can oscillate). Returns (bias, achieved TV).
    """
    logits = logits.double()
    n, p = logits.shape
    bias = torch.zeros(p, dtype=torch.float64)
    smooth = 0.5 / n
    best_bias, best_tv = bias.clone(), math.inf
    for _ in range(max_iter):
        frac = shard_fractions(logits, bias)
        tv = 0.5 * float((frac - target).abs().sum())
        if tv < best_tv:
            best_bias, best_tv = bias.clone(), tv
        else:
            lr *= 0.8
        if best_tv <= tol:
            break
        bias += lr * (torch.log(target + smooth) - torch.log(frac + smooth))
    return best_bias, best_tv


def best_path_labels(path_loglik: torch.Tensor, target: torch.Tensor, borrow: float = 0.1) -> torch.Tensor:
    """argmax of each document's log-likelihoods, plus borrowed documents for paths that never win."""
    labels = path_loglik.argmax(dim=1)
    n, p = path_loglik.shape
    gap = path_loglik - path_loglik.max(dim=1, keepdim=True).values  # 0 for the winner, < 0 otherwise
    taken = torch.zeros(n, dtype=torch.bool)
    absent = torch.bincount(labels, minlength=p) == 0
    for c in sorted(torch.nonzero(absent & (target > 0)).flatten().tolist(), key=lambda c: -float(target[c])):
        m = min(max(1, math.ceil(borrow * float(target[c]) * n)), int((~taken).sum()))
        docs = gap[:, c].masked_fill(taken, -math.inf).topk(m).indices
        labels[docs] = c
        taken[docs] = True
    return labels


def fit_discriminative_router(
    features: Features,
    path_loglik: torch.Tensor | np.ndarray,
    target_sizes: Sequence[float] | str = "uniform",
    tol: float = 0.02,
    max_iter: int = 500,
    C: float = 1.0,
    borrow: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear router (weight (P, D), bias (P,)) trained to predict each document's best path.

    `tol` bounds the total-variation distance between the predicted shard sizes on
    `features` and `target_sizes` ("uniform" or P non-negative weights): the fraction of
    documents that would have to move. Paths that are never the best borrow the documents
    they come closest to winning (see the module docstring); should a class still end up
    without documents, it keeps zero weights and only its bias decides its share.
    """
    from sklearn.linear_model import LogisticRegression

    x = as_features(features)
    ll = torch.as_tensor(path_loglik, dtype=torch.float64)
    if ll.dim() != 2 or ll.shape[0] != x.shape[0]:
        raise ValueError(f"path_loglik must be (N={x.shape[0]}, P), got {tuple(ll.shape)}")
    check_finite(ll, "path_loglik")
    p, d = ll.shape[1], x.shape[1]
    target = _targets(target_sizes, p)
    labels = best_path_labels(ll, target, borrow).numpy()
    present = np.unique(labels)

    weight = torch.zeros(p, d, dtype=torch.float64)
    bias = torch.zeros(p, dtype=torch.float64)
    if present.size >= 2:
        clf = LogisticRegression(C=C, max_iter=1000).fit(x.numpy(), labels)
        coef = torch.from_numpy(clf.coef_).double()
        icpt = torch.from_numpy(clf.intercept_).double()
        cls = torch.from_numpy(clf.classes_).long()
        if coef.shape[0] == 1:  # binary: sklearn keeps one logit (class 1 vs 0); split it symmetrically
            coef, icpt = torch.cat([-coef / 2, coef / 2]), torch.cat([-icpt / 2, icpt / 2])
        weight[cls], bias[cls] = coef, icpt
        # Absent paths start just below every present one; the size adjustment lifts them.
        absent = torch.ones(p, dtype=torch.bool)
        absent[cls] = False
        if absent.any():
            bias[absent] = float(icpt.min()) - 1.0
    else:  # one path wins everything: no classifier to fit, only the biases
        bias[int(present[0])] = 1.0

    logits = x.double() @ weight.T + bias
    shift, _ = adjust_bias(logits, target, tol=tol, max_iter=max_iter)
    return weight.float(), (bias + shift).float()
