"""The per-module outer optimizer: DiLoCo's Nesterov outer step, applied module by module.

DiLoCo (Douillard et al., arXiv 2311.08105) keeps replicas in sync by treating the average change
of the replicas over a round as a gradient for an outer SGD-with-Nesterov step. DiPaCo
(Douillard et al., arXiv 2403.10616, section 2.3) applies it per module: the outer gradient of
module m averages the changes of only the paths that contain m,

    Delta_m = sum_{p contains m} w_p (theta_m - theta_{p,m}) / sum_{p contains m} w_p,

with w_p proportional to the tokens in shard p (or uniform), and theta_m <- SGD-Nesterov(Delta_m).

Guarantees of :class:`OuterOptimizer`:

* a path contributes only to the modules it contains; paths without a module have no influence on it;
* a module that no contributing path contains is left exactly as it was: parameters *and* momentum
  (torch SGD skips parameters whose ``grad`` is None);
* every module has its own momentum buffer (torch SGD state is keyed by the module's parameter);
* with ``lr=1, momentum=0`` the step replaces each module by the weighted average of its paths, and
  a single path with every part shared is plain continued training;
* the reduction is split into local sums and an apply step (:meth:`local_sums`, :meth:`apply`), so a
  distributed run all-reduces the same sums and every holder of a module applies the identical update
  (:mod:`dipaco.comm`); with a bank that holds only some modules, sums, steps and state cover
  exactly the held ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
from transformers import PreTrainedModel

from dipaco.bank import ModuleBank
from dipaco.config import OuterConfig
from dipaco.errors import CheckpointError
from dipaco.topology import Part


@dataclass
class PartSums:
    """Per-part partial sums, one row per module of the part that the bank holds."""

    modules: list[int]  # index within the part of each row, ascending (all K for a full bank)
    weighted_delta: torch.Tensor  # (rows, numel): sum_p w_p (theta_m - theta_{p,m})
    weight: torch.Tensor  # (rows,): sum_p w_p
    count: torch.Tensor  # (rows,): number of contributing paths

    def row(self, index: int) -> int | None:
        """The row of the part's module ``index``; None when the bank does not hold it."""
        try:
            return self.modules.index(index)
        except ValueError:
            return None


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


class OuterOptimizer:
    def __init__(self, bank: ModuleBank, cfg: OuterConfig) -> None:
        self.bank = bank
        self.cfg = cfg
        self.sgd = torch.optim.SGD(bank.held_params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)

    # --- reduction ------------------------------------------------------------------------------
    @torch.no_grad()
    def local_sums(self, part: Part, paths: Mapping[int, PreTrainedModel], weights: Mapping[int, float]) -> PartSums:
        """Sums of weighted deltas of ``paths`` (path id -> trained path model) into ``part``'s modules.

        One row per held module of the part, zero where no given path contributes.
        """
        bank, topo = self.bank, self.bank.topology
        numel, device = bank.numel(part), bank.device
        rows = [i for i in range(part.num_modules) if bank.holds(part.first_module + i)]
        row_of = {i: r for r, i in enumerate(rows)}
        order = sorted(paths)  # fixed order: the sums are bit-reproducible
        used = [topo.module_index(part, p) for p in order]
        if any(i not in row_of for i in used):
            raise ValueError(f"a path of {order} goes through a module of {part.name} this bank does not hold")
        index = torch.tensor([row_of[i] for i in used], dtype=torch.long, device=device)
        w = torch.tensor([float(weights[p]) for p in order], dtype=torch.float32, device=device)
        sums = PartSums(
            rows,
            torch.zeros(len(rows), numel, device=device),
            torch.zeros(len(rows), device=device),
            torch.zeros(len(rows), device=device),
        )
        if not order:
            return sums
        bank_rows = torch.stack([bank.params[part.first_module + i] for i in used])
        deltas = torch.stack([bank.path_vector(paths[p], part) for p in order])
        deltas.neg_().add_(bank_rows)  # theta_m - theta_{p,m}
        deltas.mul_(w.unsqueeze(1))
        sums.weighted_delta.index_add_(0, index, deltas)
        sums.weight.index_add_(0, index, w)
        sums.count.index_add_(0, index, torch.ones_like(w))
        return sums

    def outer_gradients(self, part: Part, sums: PartSums) -> list[torch.Tensor | None]:
        """Delta_m for each module of ``part``; None for modules no path contributed to (or not held)."""
        grads: list[torch.Tensor | None] = [None] * part.num_modules
        for r, i in enumerate(sums.modules):
            if sums.weight[r] <= 0:
                continue
            grad = sums.weighted_delta[r] / sums.weight[r]
            if self.cfg.rescale != "none":
                factor = math.sqrt(float(sums.count[r]))
                grad = grad * factor if self.cfg.rescale == "sqrt_paths" else grad / factor
            grads[i] = grad
        return grads

    # --- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, sums_by_part: Mapping[str, PartSums]) -> dict[str, float]:
        """Sets each module's outer gradient and takes one SGD step; returns outer-gradient norms."""
        norms: dict[str, float] = {}
        for part in self.bank.topology.parts:
            for i, grad in enumerate(self.outer_gradients(part, sums_by_part[part.name])):
                if not self.bank.holds(part.first_module + i):
                    continue
                param = self.bank.params[part.first_module + i]
                param.grad = grad
                if grad is not None:
                    norms[self.bank.module_name(part.first_module + i)] = float(grad.norm())
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)
        return norms

    def step(self, paths: Mapping[int, PreTrainedModel], weights: Mapping[int, float]) -> dict[str, float]:
        """One outer step from the trained ``paths`` (path id -> model) of this round."""
        sums = {part.name: self.local_sums(part, paths, weights) for part in self.bank.topology.parts}
        return self.apply(sums)

    # --- state: one momentum buffer per module, by module name ----------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for module in (self.bank.topology.modules[m] for m in self.bank.held):
            buf = self.sgd.state.get(self.bank.params[module.id], {}).get("momentum_buffer")
            if buf is not None:
                out[module.name] = buf
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        names = {m.name: m.id for m in self.bank.topology.modules}
        unknown = sorted(set(state) - set(names))
        if unknown:
            raise CheckpointError(f"outer optimizer state names unknown modules: {unknown[:3]}")
        not_held = sorted(n for n in state if not self.bank.holds(names[n]))
        if not_held:
            raise CheckpointError(f"outer optimizer state for modules this bank does not hold: {not_held[:3]}")
        self.sgd.state.clear()
        for name, buf in state.items():
            param = self.bank.params[names[name]]
            if buf.shape != param.shape:
                raise CheckpointError(f"outer momentum for {name}: shape {tuple(buf.shape)}, expected {tuple(param.shape)}")
            self.sgd.state[param]["momentum_buffer"] = buf.clone().to(param.device)
