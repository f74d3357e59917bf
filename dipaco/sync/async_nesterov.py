"""Asynchronous per-module outer steps with delayed Nesterov momentum.

Asynchronous Local-SGD (Liu et al., arXiv 2401.09135) lets every worker push its outer gradient as
soon as its inner steps are done. Applying a full Nesterov step per arrival over-shoots: the
momentum, built for one averaged gradient per round, is applied once per *worker*. Their fix,
**delayed Nesterov**, buffers the arriving gradients and updates the momentum once every N
arrivals, with plain gradient steps in between. DiPaCo (Douillard et al., arXiv 2403.10616,
section 2.3 and its infrastructure section) runs one such outer executor per module, fed by the
paths through that module.

For module m with N arrivals per momentum update (``outer.nesterov_delay``; default: the number of
paths through m), learning rate eta (per module: ``outer.lr``, times ``outer.embedding_head_lr_scale``
for the embedding and head, times ``outer.rescale``'s factor for N paths, as the lock-step step
scales them) and momentum beta, arrival t of path p, computed from the module
at version v (the number of arrivals applied before the task started), brings

    g_t = (w_p / mean_{q through m} w_q) * (theta_m(v) - theta_{p,m})      token-weighted change
    buffer += g_t
    every arrival but the N-th:  theta_m -= eta * g_t / N                   plain step
    the N-th arrival:            mom = beta * mom + buffer / N;  buffer = 0
                                 theta_m -= eta * (g_t / N + beta * mom)     momentum step

Over N arrivals the module moves by eta * (G + beta * mom) with G = buffer / N: exactly torch's
SGD-Nesterov step on the averaged gradient, i.e. per-module DiLoCo (:mod:`dipaco.sync.diloco`) when
the N arrivals are the N paths of one round. ``nesterov_delay=1`` is plain asynchronous Nesterov (a
full step per arrival), the baseline the paper shows to be worse.

:class:`AsyncNesterov` is plain torch; the Ray driver (:mod:`dipaco.train.ray_driver`) runs one per
module executor. It does not implement the lock-step :class:`~dipaco.sync.base.OuterSync` protocol:
there are no rounds and no collective ``at()`` call, each arrival is applied on its own by
:meth:`AsyncNesterov.apply`.

Guarantees:

* every task's change is applied at most once per module: an arrival whose task id is already in
  the update log is refused (a re-sent update after a lost acknowledgement changes nothing);
* each applied update is logged with its path, the version it started from and its staleness (the
  number of updates applied to the module between the task's start and its arrival);
* the state (parameters, momentum, buffer, counters, log) round-trips through :meth:`state_dict`;
* N arrivals from one common start version reproduce torch SGD-Nesterov on their weighted mean.

Asynchronous runs are not bit-reproducible: the order of arrivals depends on timing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import torch

from dipaco.errors import CheckpointError


@dataclass(frozen=True)
class Update:
    """One applied arrival, as the executor's update log keeps it."""

    task: str  # unique id of the path task, e.g. "p003-t0007"
    path: int
    module: int
    start_version: int  # the module version the task's inner steps started from
    version: int  # the module version after this update (1 = the first update)
    staleness: int  # updates applied to the module between the task's start and this one
    momentum_step: bool  # whether this arrival completed a group of N and moved the momentum


class AsyncNesterov:
    name = "async_nesterov"

    def __init__(self, params: Mapping[int, torch.Tensor], path_weights: Mapping[int, Mapping[int, float]],
                 lr: float | Mapping[int, float], momentum: float, delay: Mapping[int, int]) -> None:
        """``params``: module id -> flat fp32 parameters (copied); ``path_weights``: module id -> the
        outer weight w_p of every path through it; ``lr``: one outer lr, or module id -> its own;
        ``delay``: module id -> N (arrivals per momentum step)."""
        self.beta = float(momentum)
        self.params = {m: p.detach().to(torch.float32).clone() for m, p in params.items()}
        self.lr = {m: float(lr[m] if isinstance(lr, Mapping) else lr) for m in self.params}
        self.mean_weight = {m: sum(ws.values()) / len(ws) for m, ws in path_weights.items()}
        self.path_weights = {m: dict(ws) for m, ws in path_weights.items()}
        self.delay = {m: int(delay[m]) for m in self.params}
        bad = {m: n for m, n in self.delay.items() if n < 1}
        if bad:
            raise ValueError(f"nesterov delay must be >= 1, got {bad}")
        self.momentum = {m: torch.zeros_like(p) for m, p in self.params.items()}
        self.buffer = {m: torch.zeros_like(p) for m, p in self.params.items()}
        self.pending = {m: 0 for m in self.params}  # arrivals in the buffer
        self.log: list[Update] = []
        self._applied: set[tuple[str, int]] = set()
        self._versions = {m: 0 for m in self.params}

    def version(self, module: int) -> int:
        """Updates applied to ``module`` so far."""
        return self._versions[module]

    def weighted_gradient(self, module: int, path: int, delta: torch.Tensor) -> torch.Tensor:
        """g = (w_p / mean w) * delta: the arrivals of one round then average to DiLoCo's Delta_m."""
        weights = self.path_weights[module]
        if path not in weights:
            raise ValueError(f"path {path} does not go through module {module}")
        return delta.to(torch.float32) * (weights[path] / self.mean_weight[module])

    @torch.no_grad()
    def apply(self, task: str, path: int, module: int, start_version: int, delta: torch.Tensor) -> Update | None:
        """Applies one arrival: ``delta`` = theta_m(start_version) - theta_{p,m} after the task's
        inner steps. Returns the logged update, or None when this task was already applied here."""
        if (task, module) in self._applied:
            return None
        theta = self.params[module]
        if delta.shape != theta.shape:
            raise ValueError(f"delta for module {module}: shape {tuple(delta.shape)}, expected {tuple(theta.shape)}")
        version = self._versions[module]
        if not 0 <= start_version <= version:
            raise ValueError(f"task {task}: start version {start_version} of module {module} is not in [0, {version}]")
        g = self.weighted_gradient(module, path, delta)
        n, lr = self.delay[module], self.lr[module]
        self.buffer[module].add_(g)
        self.pending[module] += 1
        momentum_step = self.pending[module] == n
        if momentum_step:
            self.momentum[module].mul_(self.beta).add_(self.buffer[module], alpha=1.0 / n)
            theta.add_(g, alpha=-lr / n).add_(self.momentum[module], alpha=-lr * self.beta)
            self.buffer[module].zero_()
            self.pending[module] = 0
        else:
            theta.add_(g, alpha=-lr / n)
        update = Update(task=task, path=path, module=module, start_version=start_version, version=version + 1,
                        staleness=version - start_version, momentum_step=momentum_step)
        self.log.append(update)
        self._applied.add((task, module))
        self._versions[module] = version + 1
        return update

    # --- state ---------------------------------------------------------------------------------
    def tensors(self, names: Mapping[int, str]) -> dict[str, dict[str, torch.Tensor]]:
        """file stem -> tensors by module name: ``bank`` (parameters), ``outer`` (momentum, the file
        DiLoCo uses), ``async_outer`` (the delayed-Nesterov buffers)."""
        return {"bank": {names[m]: p for m, p in self.params.items()},
                "outer": {names[m]: v for m, v in self.momentum.items()},
                "async_outer": {names[m]: v for m, v in self.buffer.items()}}

    def counters(self) -> dict:
        """What is not a tensor: arrivals pending in each buffer, and the update log."""
        return {"pending": dict(self.pending), "log": [asdict(u) for u in self.log]}

    @torch.no_grad()
    def load(self, tensors: Mapping[str, Mapping[str, torch.Tensor]], counters: Mapping, names: Mapping[int, str]) -> None:
        """Restores what :meth:`tensors` and :meth:`counters` saved."""
        for stem, target in (("bank", self.params), ("outer", self.momentum), ("async_outer", self.buffer)):
            saved = tensors.get(stem, {})
            for m, value in target.items():
                if names[m] not in saved:
                    raise CheckpointError(f"{stem}.safetensors: no tensor for module {names[m]}")
                if saved[names[m]].shape != value.shape:
                    raise CheckpointError(f"{stem}.safetensors: {names[m]} has shape {tuple(saved[names[m]].shape)}, "
                                          f"expected {tuple(value.shape)}")
                value.copy_(saved[names[m]])
        self.pending = {m: int(counters["pending"][m]) for m in self.params}
        self.log = [Update(**u) for u in counters["log"]]
        self._applied = {(u.task, u.module) for u in self.log}
        self._versions = {m: 0 for m in self.params}
        for u in self.log:
            self._versions[u.module] += 1


def default_delay(num_paths_through: int, configured: int | None) -> int:
    """N for a module: ``outer.nesterov_delay`` when set, else the number of paths through it."""
    return int(configured) if configured is not None else max(1, int(num_paths_through))


def dynamic_local_steps(speed: float, max_speed: float, inner_steps: int) -> int:
    """Inner steps for a worker of measured ``speed`` (tokens/s): floor(v / v_max * H), at least 1
    (Liu et al., arXiv 2401.09135, dynamic local updates), so every worker takes about as long."""
    if not (math.isfinite(speed) and math.isfinite(max_speed)) or speed <= 0 or max_speed <= 0:
        return inner_steps
    return max(1, math.floor(min(speed / max_speed, 1.0) * inner_steps))


def staleness_summary(staleness: Sequence[int]) -> dict[str, float]:
    """Mean, median, max and the 90th percentile of the staleness of a set of updates."""
    if not staleness:
        return {"updates": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0}
    ordered = sorted(staleness)

    def pct(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)])

    return {"updates": len(ordered), "mean": sum(ordered) / len(ordered), "p50": pct(0.5), "p90": pct(0.9),
            "max": ordered[-1]}
