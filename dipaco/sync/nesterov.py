"""The outer optimizer of every held module: torch SGD with Nesterov momentum, one buffer per module.

DiLoCo (Douillard et al., arXiv 2311.08105) treats the average change of the replicas over a round
as a gradient for an outer SGD-with-Nesterov step (lr 0.7, momentum 0.9; outer Adam and plain
averaging were worse). Guarantees of :class:`ModuleNesterov`:

* every module has its own momentum buffer (torch SGD state is keyed by the module's parameter);
* a module given no gradient is left exactly as it was: parameters *and* momentum (torch SGD skips
  parameters whose ``grad`` is None);
* with ``lr=1, momentum=0`` the step subtracts the gradient: theta_m <- theta_m - Delta_m, which
  replaces a module by the weighted average of its paths;
* a step of some slices of a module (``spans``: Streaming DiLoCo's ``blocks:K`` fragments) changes
  only their elements, parameters and momentum, and changes them exactly as the step of the whole
  module would (the SGD update is elementwise; torch's step runs on the whole module, with a zero
  gradient elsewhere, and the other elements are put back). Momentum elements whose slice has not
  stepped yet are 0; torch's first step, buf = g, is then mu * 0 + g, the same value;
* state covers exactly the modules the bank holds, by module name;
* the embedding and head modules step at ``lr x embedding_head_lr_scale``, the level modules at
  ``lr`` (two SGD parameter groups; with scale 1 one group, the plain DiLoCo step).

It is the one outer-step kernel of both schedulers: the lock-step syncs (:mod:`dipaco.sync.diloco`)
hold one over the bank, and every asynchronous module executor (:mod:`dipaco.sync.async_nesterov`)
holds one over its modules, whose delayed-Nesterov schedule decides when it steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from dipaco.config import OuterConfig
from dipaco.errors import CheckpointError, ConfigError, check_range
from dipaco.model.topology import EMBEDDING, HEAD, Topology


class HeldModules(Protocol):
    """Flat fp32 parameters of some modules, by global module id: a :class:`~dipaco.model.bank.ModuleBank`,
    or an executor's share of one."""

    params: Any  # module id -> torch.nn.Parameter (a list or a mapping)
    held: tuple[int, ...]

    @property
    def topology(self) -> Topology | None: ...

    def holds(self, module_id: int) -> bool: ...

    def module_name(self, module_id: int) -> str: ...


def check_outer_step(outer: OuterConfig) -> None:
    """The outer step's keys of the ``outer`` section."""
    check_range("outer.lr", outer.lr, 0.0, math.inf)
    check_range("outer.momentum", outer.momentum, 0.0, 1.0)
    if not (math.isfinite(outer.embedding_head_lr_scale) and outer.embedding_head_lr_scale > 0):
        raise ConfigError(f"outer.embedding_head_lr_scale: must be a finite number > 0, "
                          f"got {outer.embedding_head_lr_scale}")


class ModuleNesterov:
    def __init__(self, bank: HeldModules, cfg: OuterConfig, lrs: Mapping[int, float] | None = None) -> None:
        """``lrs``: each held module's lr (default: :func:`module_outer_lr` of the bank's topology)."""
        self.bank = bank
        if lrs is None:
            if bank.topology is None:
                raise ValueError("ModuleNesterov needs the modules' lrs or their topology")
            lrs = {m: module_outer_lr(cfg, bank.topology, m) for m in bank.held}
        self.sgd = torch.optim.SGD(_param_groups(bank, lrs), lr=cfg.lr, momentum=cfg.momentum,
                                   nesterov=cfg.nesterov and cfg.momentum > 0)

    @torch.no_grad()
    def step(self, grads: Mapping[int, torch.Tensor | None],
             spans: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> dict[str, float]:
        """One SGD step with each held module's outer gradient (None: untouched); returns their norms.

        ``spans``: for the modules it names, only these [start, stop) ranges step (their gradient is
        the full-size vector, read only there); the others step whole."""
        norms: dict[str, float] = {}
        kept: dict[int, tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor | None]] = {}
        for m in self.bank.held:
            grad = grads.get(m)
            if grad is not None and spans and m in spans:
                param, buf = self.bank.params[m], self.momentum(m)
                kept[m] = (_complement(spans[m], param.numel()), param.detach().clone(),
                           None if buf is None else buf.clone())
                grad = _only(grad, spans[m])
            self.bank.params[m].grad = grad
            if grad is not None:
                norms[self.bank.module_name(m)] = float(grad.norm())
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)
        for m, (outside, param, buf) in kept.items():  # the elements outside the spans, as they were
            mom = self.momentum(m)
            for start, stop in outside:
                self.bank.params[m][start:stop] = param[start:stop]
                if mom is not None:
                    mom[start:stop] = 0.0 if buf is None else buf[start:stop]
        return norms

    def momentum(self, module_id: int) -> torch.Tensor | None:
        return self.sgd.state.get(self.bank.params[module_id], {}).get("momentum_buffer")

    # --- state: one momentum buffer per module, by module name ----------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for m in self.bank.held:
            buf = self.momentum(m)
            if buf is not None:
                out[self.bank.module_name(m)] = buf
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        topology = self.bank.topology
        everyone = [m.id for m in topology.modules] if topology is not None else list(self.bank.held)
        names = {self.bank.module_name(m): m for m in everyone}
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


def module_outer_lr(cfg: OuterConfig, topology: Topology, module_id: int) -> float:
    """A module's outer lr: ``outer.lr``, times ``outer.embedding_head_lr_scale`` for the embedding and
    head modules. The one rule of both drivers (the Ray executors' :class:`AsyncNesterov` takes it too)."""
    kind = topology.modules[module_id].part.kind
    return cfg.lr * (cfg.embedding_head_lr_scale if kind in (EMBEDDING, HEAD) else 1.0)


def _param_groups(bank: HeldModules, lrs: Mapping[int, float]) -> list[dict]:
    """The held modules grouped by their outer lr."""
    by_lr: dict[float, list[torch.nn.Parameter]] = {}
    for m in bank.held:
        by_lr.setdefault(lrs[m], []).append(bank.params[m])
    return [{"params": params, "lr": lr} for lr, params in by_lr.items()]


def _only(grad: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """``grad`` inside ``spans``, 0 elsewhere."""
    out = torch.zeros_like(grad)
    for start, stop in spans:
        out[start:stop] = grad[start:stop]
    return out


def _complement(spans: Sequence[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for start, stop in sorted(spans):
        if start > at:
            out.append((at, start))
        at = max(at, stop)
    return out + ([(at, numel)] if at < numel else [])
