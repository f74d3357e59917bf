"""Per-module outer gradients: the changes of only the paths that contain each module.

DiPaCo (Douillard et al., arXiv 2403.10616, section 2.3) averages, for module m, the changes of
the paths through m:

    Delta_m = sum_{p contains m} w_p (theta_m - theta_{p,m}) / sum_{p contains m} w_p,

with w_p proportional to the tokens in shard p (or uniform). :func:`local_sums` computes the
numerator, the weight and the path count of every held module from the paths of this rank with
``index_add_`` (one call per part); summed over ranks (:mod:`dipaco.comm`) they give Delta_m.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dipaco.comm.reduce import Payload
from dipaco.config import OuterConfig
from dipaco.errors import ConfigError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Part


def check_deltas(outer: OuterConfig) -> None:
    """``outer.drop_prob`` (``outer.weighting`` and ``outer.rescale`` are choices the schema checks)."""
    if not (math.isfinite(outer.drop_prob) and 0.0 <= outer.drop_prob < 1.0):
        raise ConfigError(f"outer.drop_prob: must be in [0, 1), got {outer.drop_prob}")


@torch.no_grad()
def local_sums(bank: ModuleBank, part: Part, paths: Mapping[int, PreTrainedModel],
               weights: Mapping[int, float]) -> dict[int, Payload]:
    """Module id -> Payload(meta=[sum_p w_p, number of paths], values=sum_p w_p (theta_m - theta_{p,m}))
    for every held module of ``part``, zero where no given path contributes."""
    topo, numel, device = bank.topology, bank.numel(part), bank.device
    rows = [i for i in range(part.num_modules) if bank.holds(part.first_module + i)]
    row_of = {i: r for r, i in enumerate(rows)}
    order = sorted(paths)  # fixed order: the sums are bit-reproducible
    used = [topo.module_index(part, p) for p in order]
    if any(i not in row_of for i in used):
        raise ValueError(f"a path of {order} goes through a module of {part.name} this bank does not hold")
    weighted_delta = torch.zeros(len(rows), numel, device=device)
    weight = torch.zeros(len(rows), device=device)
    count = torch.zeros(len(rows), device=device)
    if order:
        index = torch.tensor([row_of[i] for i in used], dtype=torch.long, device=device)
        w = torch.tensor([float(weights[p]) for p in order], dtype=torch.float32, device=device)
        bank_rows = torch.stack([bank.params[part.first_module + i] for i in used])
        deltas = torch.stack([bank.path_vector(paths[p], part) for p in order])
        deltas.neg_().add_(bank_rows)  # theta_m - theta_{p,m}
        deltas.mul_(w.unsqueeze(1))
        weighted_delta.index_add_(0, index, deltas)
        weight.index_add_(0, index, w)
        count.index_add_(0, index, torch.ones_like(w))
    return {part.first_module + i: Payload(torch.stack((weight[r], count[r])), weighted_delta[r])
            for r, i in enumerate(rows)}


@dataclass(frozen=True)
class PathAgreement:
    """How alike the changes of the paths through one module are (``train.diagnostics``).

    ``cosine``: the mean over pairs of paths p != q of cos(d_p, d_q), d_p = theta_m - theta_{p,m}; None with
    fewer than two paths. 1: the paths moved the module the same way (the average keeps their step);
    near 0: they pulled apart (the average shrinks by about sqrt(paths)). ``delta_norm``: the mean of |d_p|."""

    paths: int
    cosine: float | None
    delta_norm: float


@torch.no_grad()
def path_agreement(bank: ModuleBank, part: Part, paths: Mapping[int, PreTrainedModel]) -> dict[int, PathAgreement]:
    """Module id -> :class:`PathAgreement` of the given paths through each module of ``part`` they use.

    From unit vectors u_p = d_p / |d_p| and their sum U over a module's n paths, the mean pairwise cosine is
    (|U|^2 - n) / (n (n - 1)): one pass over the deltas, no n x n matrix. A path that did not move a module
    (d_p = 0) counts as cosine 0 with every other."""
    topo = bank.topology
    order = sorted(paths)
    out: dict[int, PathAgreement] = {}
    if not order:
        return out
    used = [part.first_module + topo.module_index(part, p) for p in order]
    unit_sum: dict[int, torch.Tensor] = {}
    norms: dict[int, list[float]] = {}
    for p, m in zip(order, used):
        delta = bank.params[m] - bank.path_vector(paths[p], part)
        norm = float(torch.linalg.vector_norm(delta))
        norms.setdefault(m, []).append(norm)
        unit = delta / norm if norm > 0 else delta
        unit_sum[m] = unit_sum[m] + unit if m in unit_sum else unit
    for m, total in unit_sum.items():
        n = len(norms[m])
        cosine = (float(total.dot(total)) - sum(1.0 for v in norms[m] if v > 0)) / (n * (n - 1)) if n > 1 else None
        out[m] = PathAgreement(n, cosine, sum(norms[m]) / n)
    return out


def outer_gradient(total: Payload, rescale: str = "none") -> torch.Tensor | None:
    """Delta_m from a module's summed payload; None when no path contributed.

    ``rescale``: the paper's rescale by sqrt(paths through the module), whose direction it does not
    state: ``sqrt_paths`` multiplies, ``inv_sqrt_paths`` divides.
    """
    weight, count = total.meta[0], total.meta[1]
    if weight <= 0:
        return None
    grad = total.values / weight
    factor = rescale_factor(int(count), rescale)
    return grad if factor == 1.0 else grad * factor


def rescale_factor(num_paths: int, rescale: str) -> float:
    """The factor ``outer.rescale`` puts on the outer gradient of a module that ``num_paths`` paths
    contributed to: sqrt(n) (``sqrt_paths``), 1/sqrt(n) (``inv_sqrt_paths``) or 1 (``none``)."""
    if rescale == "none":
        return 1.0
    root = math.sqrt(float(num_paths))
    return root if rescale == "sqrt_paths" else 1.0 / root


def dropped_paths(seed: int, round_index: int, num_paths: int, prob: float) -> set[int]:
    """Paths whose contribution is lost in round ``round_index`` (``outer.drop_prob``), simulating
    unreliable workers as DiLoCo does (arXiv 2311.08105: dropping 50% of outer gradients at random
    costs ~2% perplexity). Every rank draws the same set from a private generator seeded by
    (seed, round), so the decision is identical everywhere and the global RNG is untouched.
    """
    if prob <= 0:
        return set()
    generator = torch.Generator().manual_seed((seed * 1_000_003 + 7919 * round_index + 17) % 2**63)
    draws = torch.rand(num_paths, generator=generator)
    return {p for p in range(num_paths) if draws[p] < prob}
