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
  distributed run all-reduces the same sums and every holder of a module applies the identical update.
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
    """Per-part partial sums, one row per module of the part."""

    weighted_delta: torch.Tensor  # (K, numel): sum_p w_p (theta_m - theta_{p,m})
    weight: torch.Tensor  # (K,): sum_p w_p
    count: torch.Tensor  # (K,): number of contributing paths


class OuterOptimizer:
    def __init__(self, bank: ModuleBank, cfg: OuterConfig) -> None:
        self.bank = bank
        self.cfg = cfg
        self.sgd = torch.optim.SGD(bank.params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)

    # --- reduction ------------------------------------------------------------------------------
    @torch.no_grad()
    def local_sums(self, part: Part, paths: Mapping[int, PreTrainedModel], weights: Mapping[int, float]) -> PartSums:
        """Sums of weighted deltas of ``paths`` (path id -> trained path model) into ``part``'s modules."""
        bank, topo = self.bank, self.bank.topology
        k, numel, device = part.num_modules, bank.numel(part), bank.device
        order = sorted(paths)  # fixed order: the sums are bit-reproducible
        index = torch.tensor([topo.module_index(part, p) for p in order], dtype=torch.long, device=device)
        w = torch.tensor([float(weights[p]) for p in order], dtype=torch.float32, device=device)
        sums = PartSums(
            torch.zeros(k, numel, device=device),
            torch.zeros(k, device=device),
            torch.zeros(k, device=device),
        )
        if not order:
            return sums
        bank_rows = torch.stack([bank.params[part.first_module + i] for i in range(k)])
        deltas = torch.stack([bank.path_vector(paths[p], part) for p in order])
        deltas.neg_().add_(bank_rows.index_select(0, index))  # theta_m - theta_{p,m}
        deltas.mul_(w.unsqueeze(1))
        sums.weighted_delta.index_add_(0, index, deltas)
        sums.weight.index_add_(0, index, w)
        sums.count.index_add_(0, index, torch.ones_like(w))
        return sums

    def outer_gradients(self, part: Part, sums: PartSums) -> list[torch.Tensor | None]:
        """Delta_m for each module of ``part``; None for modules no path contributed to."""
        grads: list[torch.Tensor | None] = []
        for i in range(part.num_modules):
            if sums.weight[i] <= 0:
                grads.append(None)
                continue
            grad = sums.weighted_delta[i] / sums.weight[i]
            if self.cfg.rescale != "none":
                factor = math.sqrt(float(sums.count[i]))
                grad = grad * factor if self.cfg.rescale == "sqrt_paths" else grad / factor
            grads.append(grad)
        return grads

    # --- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, sums_by_part: Mapping[str, PartSums]) -> dict[str, float]:
        """Sets each module's outer gradient and takes one SGD step; returns outer-gradient norms."""
        norms: dict[str, float] = {}
        for part in self.bank.topology.parts:
            for i, grad in enumerate(self.outer_gradients(part, sums_by_part[part.name])):
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
        for module in self.bank.topology.modules:
            buf = self.sgd.state.get(self.bank.params[module.id], {}).get("momentum_buffer")
            if buf is not None:
                out[module.name] = buf
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        names = {m.name: m.id for m in self.bank.topology.modules}
        unknown = sorted(set(state) - set(names))
        if unknown:
            raise CheckpointError(f"outer optimizer state names unknown modules: {unknown[:3]}")
        self.sgd.state.clear()
        for name, buf in state.items():
            param = self.bank.params[names[name]]
            if buf.shape != param.shape:
                raise CheckpointError(f"outer momentum for {name}: shape {tuple(buf.shape)}, expected {tuple(param.shape)}")
            self.sgd.state[param]["momentum_buffer"] = buf.clone().to(param.device)
