"""The outer optimizer: torch SGD with Nesterov momentum, one buffer per module.

DiLoCo (Douillard et al., arXiv 2311.08105) treats the average change of the replicas over a round
as a gradient for an outer SGD-with-Nesterov step (lr 0.7, momentum 0.9; outer Adam and plain
averaging were worse). :class:`NesterovKernel` is the numeric step, from plain numbers (each
module's lr, the momentum); :class:`ModuleNesterov` is the kernel over a bank's held modules, by
module name, at the lrs of :class:`OuterStep`. Guarantees of the kernel:

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
* state covers exactly the modules it steps (:class:`ModuleNesterov`: the modules the bank holds, by
  module name);
* modules step at their own lr, one SGD parameter group per distinct lr: :class:`ModuleNesterov`
  steps the embedding and head modules at ``lr x embedding_head_lr_scale``, the level modules at
  ``lr`` (with scale 1 one group, the plain DiLoCo step).

It is the one outer-step kernel of both schedulers: the lock-step syncs (:mod:`dipaco.sync.diloco`)
hold a :class:`ModuleNesterov` over the bank, and every asynchronous module executor
(:mod:`dipaco.sync.async_nesterov`) holds a :class:`NesterovKernel` over its modules' anchors, whose
delayed-Nesterov schedule decides when it steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dipaco.config import OuterConfig
from dipaco.errors import CheckpointError, ConfigError, check_range
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import EMBEDDING, HEAD, Topology


def check_outer_step(outer: OuterConfig) -> None:
    """The outer step's keys of the ``outer`` section."""
    check_range("outer.lr", outer.lr, 0.0, math.inf)
    check_range("outer.momentum", outer.momentum, 0.0, 1.0)
    if not (math.isfinite(outer.embedding_head_lr_scale) and outer.embedding_head_lr_scale > 0):
        raise ConfigError(f"outer.embedding_head_lr_scale: must be a finite number > 0, "
                          f"got {outer.embedding_head_lr_scale}")


class OuterStepNumbers(Protocol):
    """The numbers of an outer step: an :class:`OuterStep`, or the ``outer`` section itself."""

    @property
    def lr(self) -> float: ...

    @property
    def momentum(self) -> float: ...

    @property
    def nesterov(self) -> bool: ...

    @property
    def embedding_head_lr_scale(self) -> float: ...


@dataclass(frozen=True)
class OuterStep:
    """The outer SGD step of a sync, as numbers (``outer.lr``, ``outer.momentum``, ``outer.nesterov``,
    ``outer.embedding_head_lr_scale``, unless a sync takes its own)."""

    lr: float
    momentum: float
    nesterov: bool = True
    embedding_head_lr_scale: float = 1.0

    @classmethod
    def of(cls, outer: OuterConfig) -> OuterStep:
        return cls(outer.lr, outer.momentum, outer.nesterov, outer.embedding_head_lr_scale)


class NesterovKernel:
    """torch SGD with Nesterov momentum over flat fp32 module parameters, by module id."""

    def __init__(self, params: Mapping[int, torch.nn.Parameter], lrs: Mapping[int, float], momentum: float,
                 nesterov: bool = True) -> None:
        """``params``: module id -> its parameter, stepped in place (in this order); ``lrs``: each one's lr."""
        self.params = dict(params)
        self.sgd = torch.optim.SGD(_param_groups(self.params, lrs), momentum=momentum,
                                   nesterov=nesterov and momentum > 0)

    @torch.no_grad()
    def step(self, grads: Mapping[int, torch.Tensor | None],
             spans: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> dict[int, float]:
        """One SGD step with each module's outer gradient (None or absent: untouched); returns their norms.

        ``spans``: for the modules it names, only these [start, stop) ranges step (their gradient is
        the full-size vector, read only there); the others step whole."""
        norms: dict[int, float] = {}
        kept: dict[int, tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor | None]] = {}
        for m, param in self.params.items():
            grad = grads.get(m)
            if grad is not None and spans and m in spans:
                buf = self.momentum(m)
                kept[m] = (_complement(spans[m], param.numel()), param.detach().clone(),
                           None if buf is None else buf.clone())
                grad = _only(grad, spans[m])
            param.grad = grad
            if grad is not None:
                norms[m] = float(grad.norm())
        self.sgd.step()
        self.sgd.zero_grad(set_to_none=True)
        for m, (outside, before, buf) in kept.items():  # the elements outside the spans, as they were
            mom = self.momentum(m)
            for start, stop in outside:
                self.params[m][start:stop] = before[start:stop]
                if mom is not None:
                    mom[start:stop] = 0.0 if buf is None else buf[start:stop]
        return norms

    def momentum(self, module_id: int) -> torch.Tensor | None:
        """The module's buffer; None before its first step (or when it is not stepped here)."""
        param = self.params.get(module_id)
        return None if param is None else self.sgd.state.get(param, {}).get("momentum_buffer")

    # --- state: one momentum buffer per module that has stepped, by module id --------------------
    def state_dict(self) -> dict[int, torch.Tensor]:
        return {m: buf for m in self.params if (buf := self.momentum(m)) is not None}

    def load_state_dict(self, buffers: Mapping[int, torch.Tensor], names: Mapping[int, str] | None = None) -> None:
        """``names``: how errors name the modules (default: their ids)."""
        unknown = sorted(m for m in buffers if m not in self.params)
        if unknown:
            raise CheckpointError(f"outer optimizer state for modules not stepped here: {unknown[:3]}")
        self.sgd.state.clear()
        for m, buf in buffers.items():
            param = self.params[m]
            if buf.shape != param.shape:
                name = names[m] if names is not None else str(m)
                raise CheckpointError(f"outer momentum for {name}: shape {tuple(buf.shape)}, "
                                      f"expected {tuple(param.shape)}")
            self.sgd.state[param]["momentum_buffer"] = buf.clone().to(param.device)


class ModuleNesterov:
    """The kernel over the modules a bank holds, each at its :func:`module_outer_lr`; state by module name."""

    def __init__(self, bank: ModuleBank, step: OuterStepNumbers) -> None:
        self.bank = bank
        lrs = {m: module_outer_lr(step, bank.topology, m) for m in bank.held}
        self.kernel = NesterovKernel({m: bank.params[m] for m in bank.held}, lrs, step.momentum, step.nesterov)

    @property
    def sgd(self) -> torch.optim.SGD:
        return self.kernel.sgd

    def step(self, grads: Mapping[int, torch.Tensor | None],
             spans: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> dict[str, float]:
        """:meth:`NesterovKernel.step`; the norms by module name."""
        return {self.bank.module_name(m): norm for m, norm in self.kernel.step(grads, spans).items()}

    def momentum(self, module_id: int) -> torch.Tensor | None:
        return self.kernel.momentum(module_id)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.bank.module_name(m): buf for m, buf in self.kernel.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        names = {self.bank.module_name(m.id): m.id for m in self.bank.topology.modules}
        unknown = sorted(set(state) - set(names))
        if unknown:
            raise CheckpointError(f"outer optimizer state names unknown modules: {unknown[:3]}")
        not_held = sorted(n for n in state if not self.bank.holds(names[n]))
        if not_held:
            raise CheckpointError(f"outer optimizer state for modules this bank does not hold: {not_held[:3]}")
        self.kernel.load_state_dict({names[n]: buf for n, buf in state.items()},
                                    {m: self.bank.module_name(m) for m in self.bank.held})


def module_outer_lr(step: OuterStepNumbers, topology: Topology, module_id: int) -> float:
    """A module's outer lr: ``outer.lr``, times ``outer.embedding_head_lr_scale`` for the embedding and
    head modules. The one rule of both drivers (the Ray executors' :class:`AsyncNesterov` takes it too)."""
    kind = topology.modules[module_id].part.kind
    return step.lr * (step.embedding_head_lr_scale if kind in (EMBEDDING, HEAD) else 1.0)


def _param_groups(params: Mapping[int, torch.nn.Parameter], lrs: Mapping[int, float]) -> list[dict]:
    """The parameters grouped by their lr."""
    by_lr: dict[float, list[torch.nn.Parameter]] = {}
    for m, param in params.items():
        by_lr.setdefault(lrs[m], []).append(param)
    return [{"params": group, "lr": lr} for lr, group in by_lr.items()]


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
