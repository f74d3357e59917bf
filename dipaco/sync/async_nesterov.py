"""Asynchronous per-module outer steps with delayed Nesterov momentum.

Asynchronous Local-SGD (Liu et al., arXiv 2401.09135) lets every worker push its outer gradient as
soon as its inner steps are done. Applying a full Nesterov step per arrival over-shoots: the
momentum, built for one averaged gradient per round, is applied once per *worker*. Their fix,
**delayed Nesterov**, buffers the arriving gradients and updates the momentum once every N
arrivals, with plain gradient steps in between. DiPaCo (Douillard et al., arXiv 2403.10616,
section 2.3 and its infrastructure section) runs one such outer executor per module, fed by the
paths through that module.

The outer step is the lock-step one: the same :class:`~dipaco.sync.nesterov.NesterovKernel` (torch
SGD with Nesterov momentum, each module at its own lr) on the same outer gradient
(:func:`~dipaco.sync.deltas.outer_gradient`, ``outer.rescale`` on the gradient). Delayed Nesterov is
a schedule around it. For module m with N arrivals per momentum step (``outer.nesterov_delay``;
default: the number n of paths through m), weights w_p, anchor theta_bar (the module at its last
momentum step), and arrival t of path p computed from the module at version v (the number of
arrivals applied before the task started):

    S += w_p * (theta_m(v) - theta_{p,m})                    weighted change, summed in arrival order
    G  = outer_gradient(S / (sum_{q through m} w_q * N / n))  DiLoCo's average over a round of arrivals
    every arrival but the N-th:  theta_m = theta_bar - lr * G      plain steps (the partial average)
    the N-th arrival:            theta_bar, momentum = SGD-Nesterov step of theta_bar on G; S = 0
                                 theta_m = theta_bar

Over N arrivals the module moves by exactly torch's SGD-Nesterov step on the averaged gradient:
per-module DiLoCo (:mod:`dipaco.sync.diloco`) when the N arrivals are the N paths of one round, and
bit for bit when they arrive in path order from bit-identical paths (the sums are the lock-step
sync's, in the same order). ``nesterov_delay=1`` is plain asynchronous Nesterov (a full step per
arrival), the baseline the paper shows to be worse.

:class:`AsyncNesterov` is plain torch; the task scheduler (:mod:`dipaco.train.tasks`) runs one per
module executor. It does not implement the lock-step :class:`~dipaco.sync.base.OuterSync` protocol:
there are no rounds and no collective ``at()`` call, each arrival is applied on its own by
:meth:`AsyncNesterov.apply`.

Guarantees:

* every task's change is applied at most once per module: an arrival whose task id is already in
  the update log is refused (a re-sent update after a lost acknowledgement changes nothing);
* each applied update is logged with its path, the version it started from and its staleness (the
  number of updates applied to the module between the task's start and its arrival);
* the state (parameters, anchor, momentum, buffer, counters, log) round-trips through
  :meth:`tensors` / :meth:`counters` and :meth:`load`;
* N arrivals from one common start version reproduce torch SGD-Nesterov on their weighted mean.

Asynchronous runs are not bit-reproducible: the order of arrivals depends on timing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from dipaco.comm.reduce import Payload
from dipaco.config import OuterConfig
from dipaco.errors import CheckpointError, ConfigError
from dipaco.sync.base import OUTER_MOMENTUM_PART
from dipaco.sync.deltas import outer_gradient
from dipaco.sync.nesterov import NesterovKernel

# The parts of an executor's state, by module name (each a checkpoint part): the modules as tasks pull
# them, the outer momentum (the part every sync has), the weighted changes pending, the anchors.
PARAMS, MOMENTUM, BUFFER, ANCHOR = "bank", OUTER_MOMENTUM_PART, "async_outer", "async_anchor"


def check_async(outer: OuterConfig) -> None:
    """``outer.nesterov_delay``."""
    if outer.nesterov_delay is not None and outer.nesterov_delay < 1:
        raise ConfigError(f"outer.nesterov_delay: must be >= 1 or null (the paths through each module), "
                          f"got {outer.nesterov_delay}")


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
                 lr: float | Mapping[int, float], momentum: float, delay: Mapping[int, int],
                 rescale: str = "none") -> None:
        """``params``: module id -> flat fp32 parameters (copied); ``path_weights``: module id -> the
        outer weight w_p of every path through it; ``lr``: one outer lr, or module id -> its own;
        ``delay``: module id -> N (arrivals per momentum step); ``rescale``: ``outer.rescale``."""
        # the modules at their last momentum step, which the kernel steps
        self.anchors = {m: torch.nn.Parameter(p.detach().to(torch.float32).clone(), requires_grad=False)
                        for m, p in params.items()}
        self.lr = {m: float(lr[m] if isinstance(lr, Mapping) else lr) for m in self.anchors}
        self.kernel = NesterovKernel({m: self.anchors[m] for m in sorted(self.anchors)}, self.lr, momentum)
        self.path_weights = {m: dict(ws) for m, ws in path_weights.items()}
        self.delay = {m: int(delay[m]) for m in self.anchors}
        bad = {m: n for m, n in self.delay.items() if n < 1}
        if bad:
            raise ValueError(f"nesterov delay must be >= 1, got {bad}")
        self.rescale = rescale
        self.meta = {m: self._meta(m) for m in self.anchors}
        self.buffer = {m: torch.zeros_like(p) for m, p in self.anchors.items()}
        self.theta = {m: p.detach().clone() for m, p in self.anchors.items()}
        self.pending = {m: 0 for m in self.anchors}  # arrivals in the buffer
        self.log: list[Update] = []
        self._applied: set[tuple[str, int]] = set()
        self._versions = {m: 0 for m in self.anchors}

    def _meta(self, module: int) -> torch.Tensor:
        """[normalizer, paths through the module]: the payload meta the lock-step sync sums for a round.
        The normalizer is the fp32 sum of the paths' weights in path order (as ``local_sums`` adds them),
        times N / n when a momentum step takes N arrivals instead of one per path."""
        weights = self.path_weights[module]
        w = torch.tensor([float(weights[p]) for p in sorted(weights)], dtype=torch.float32)
        total = torch.zeros(1).index_add_(0, torch.zeros(len(w), dtype=torch.long), w)[0]
        n, arrivals = len(weights), self.delay[module]
        if arrivals != n:
            total = total * (arrivals / n)
        return torch.stack((total, torch.tensor(float(n))))

    @property
    def params(self) -> dict[int, torch.Tensor]:
        """Each module as tasks pull it: its anchor, moved by the plain steps of the arrivals pending."""
        return self.theta

    @property
    def momentum(self) -> dict[int, torch.Tensor]:
        """Each module's Nesterov buffer (zeros before its first momentum step)."""
        out = {}
        for m, p in self.anchors.items():
            buf = self.kernel.momentum(m)
            out[m] = torch.zeros_like(p) if buf is None else buf
        return out

    def version(self, module: int) -> int:
        """Updates applied to ``module`` so far."""
        return self._versions[module]

    def weighted_change(self, module: int, path: int, delta: torch.Tensor) -> torch.Tensor:
        """w_p * delta, in fp32 as the lock-step sync weights a path's change."""
        weights = self.path_weights[module]
        if path not in weights:
            raise ValueError(f"path {path} does not go through module {module}")
        return delta.to(torch.float32) * torch.tensor(float(weights[path]), dtype=torch.float32)

    def _gradient(self, module: int) -> torch.Tensor:
        grad = outer_gradient(Payload(self.meta[module], self.buffer[module]), self.rescale)
        assert grad is not None  # the normalizer is a sum of positive weights
        return grad

    @torch.no_grad()
    def apply(self, task: str, path: int, module: int, start_version: int, delta: torch.Tensor) -> Update | None:
        """Applies one arrival: ``delta`` = theta_m(start_version) - theta_{p,m} after the task's
        inner steps. Returns the logged update, or None when this task was already applied here."""
        if (task, module) in self._applied:
            return None
        anchor = self.anchors[module]
        if delta.shape != anchor.shape:
            raise ValueError(f"delta for module {module}: shape {tuple(delta.shape)}, expected {tuple(anchor.shape)}")
        version = self._versions[module]
        if not 0 <= start_version <= version:
            raise ValueError(f"task {task}: start version {start_version} of module {module} is not in [0, {version}]")
        self.buffer[module].add_(self.weighted_change(module, path, delta))
        self.pending[module] += 1
        momentum_step = self.pending[module] == self.delay[module]
        if momentum_step:
            self.kernel.step({module: self._gradient(module)})
            self.buffer[module].zero_()
            self.pending[module] = 0
            self.theta[module] = anchor.detach().clone()
        else:
            self.theta[module] = anchor.detach() - self.lr[module] * self._gradient(module)
        update = Update(task=task, path=path, module=module, start_version=start_version, version=version + 1,
                        staleness=version - start_version, momentum_step=momentum_step)
        self.log.append(update)
        self._applied.add((task, module))
        self._versions[module] = version + 1
        return update

    # --- state ---------------------------------------------------------------------------------
    def tensors(self, names: Mapping[int, str]) -> dict[str, dict[str, torch.Tensor]]:
        """part -> tensors by module name: ``bank`` (the modules as tasks pull them), ``outer`` (momentum,
        the part every sync has), ``async_outer`` (the weighted changes pending), ``async_anchor``."""
        momentum = self.momentum
        return {PARAMS: {names[m]: p for m, p in self.theta.items()},
                MOMENTUM: {names[m]: v for m, v in momentum.items()},
                BUFFER: {names[m]: v for m, v in self.buffer.items()},
                ANCHOR: {names[m]: p.detach() for m, p in self.anchors.items()}}

    def counters(self) -> dict:
        """What is not a tensor: arrivals pending in each buffer, and the update log."""
        return {"pending": dict(self.pending), "log": [asdict(u) for u in self.log]}

    @torch.no_grad()
    def load(self, tensors: Mapping[str, Mapping[str, torch.Tensor]], counters: Mapping, names: Mapping[int, str]) -> None:
        """Restores what :meth:`tensors` and :meth:`counters` saved."""
        saved = {part: _named(tensors, part, names, self.anchors) for part in (PARAMS, MOMENTUM, BUFFER, ANCHOR)}
        for m, anchor in self.anchors.items():
            anchor.copy_(saved[ANCHOR][m])
            self.theta[m] = saved[PARAMS][m].clone()
            self.buffer[m].copy_(saved[BUFFER][m])
        self.kernel.load_state_dict(saved[MOMENTUM], names)
        self.pending = {m: int(counters["pending"][m]) for m in self.anchors}
        self.log = [Update(**u) for u in counters["log"]]
        self._applied = {(u.task, u.module) for u in self.log}
        self._versions = {m: 0 for m in self.anchors}
        for u in self.log:
            self._versions[u.module] += 1


def _named(tensors: Mapping[str, Mapping[str, torch.Tensor]], part: str, names: Mapping[int, str],
           like: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Module id -> the saved tensor of ``part``, checked to exist and to have the module's shape."""
    saved = tensors.get(part, {})
    out = {}
    for m, value in like.items():
        if names[m] not in saved:
            raise CheckpointError(f"{part}.safetensors: no tensor for module {names[m]}")
        if saved[names[m]].shape != value.shape:
            raise CheckpointError(f"{part}.safetensors: {names[m]} has shape {tuple(saved[names[m]].shape)}, "
                                  f"expected {tuple(value.shape)}")
        out[m] = saved[names[m]]
    return out


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
