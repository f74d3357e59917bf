"""One-step-delay DiLoCo for DiPaCo: each round's outer gradient is applied one round later.

DiLoCoX (Qi et al., arXiv 2506.21263) overlaps the outer exchange with local training by a
one-step delay: the outer gradient of round t is all-reduced while round t + 1 trains, and applied
at the end of round t + 1, so communication never blocks training as long as one exchange takes
less than a round. (Kale et al., arXiv 2502.12996, study the same overlap in DiLoCo.)

The exact update, per module m, with d = ``outer.delayed.delay`` (1 in the paper), theta_t the
bank at the start of round t, and every path starting round t from theta_t:

* end of round t: Delta_{m,t} = sum_p w_p (theta_{m,t} - theta_{p,m}) / sum_p w_p over the paths
  containing m (as in DiLoCo, :mod:`dipaco.sync.diloco`); its exchange starts (asynchronous
  torch.distributed work) and runs during the next round (exchanges still in flight are finished
  before a new one starts, so with d > 1 the overlap is still one round);
* still at the end of round t: theta_{m,t+1} = Nesterov(theta_{m,t}, Delta_{m,t-d}) with the exchange
  that started d rounds earlier, now finished (no step while t < d); every path restarts from
  theta_{t+1};
* the last round (``train.rounds``) also applies the exchanges still in flight, oldest first, so the
  final bank holds every round's outer gradient.

d = 0 is DiLoCo: the same operations in the same order (bit-identical on CPU). The rest of DiLoCo's
guarantees hold (per-module averaging over the paths containing the module, identical bits on every
holder, multi-rank fp32 equal to one process up to the order of additions). Exchanges in flight at a
checkpoint are finished and saved with the round they apply at, so a resumed run continues
bit-exactly (CPU).

Eager variant (``outer.delayed.eager=true``, delay 1; after Kale et al.'s eager updates, made
replica-safe): the bank is updated exactly as above, only by averaged deltas, so every holder keeps
the same bits; what changes is where each *path* restarts. With d_p the path's own change over round
t, measured from where it started the round (s_p - theta_p),

* the exchange of round t carries sum_p w_p d_p (not the change from the bank);
* the path restarts round t + 1 from theta_{t+1} - d_p: the bank with everyone's outer gradient up
  to round t - 1, plus its own round t at once (its round-t share reaches the bank a round later,
  in the average, when its own d_p is no longer added);
* the last round lands everything, and the paths restart from the bank.

A single path with ``outer.lr=1, outer.momentum=0`` then trains exactly as if alone, while the bank
lags one round behind it. Each path's d_p is checkpointed (per rank, by path).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Mapping

import torch
from transformers import PreTrainedModel

from dipaco.config import OuterConfig
from dipaco.sync.base import SavedState, SyncContext, SyncReport
from dipaco.sync.diloco import DiLoCo, Exchange
from dipaco.sync.nesterov import ModuleNesterov


# The outer momentum of a delayed run when outer.delayed.momentum is null: measured, not derived (the
# eager variant at H = 96, 6 rounds, docs/benchmarks.md): momentum 0.9 lost 76% perplexity to DiLoCo,
# 0.8 lost 26%, 0.7 lost 5.5%, 0.5 was 1.1% better, 0 lost 30%.
DELAYED_MOMENTUM = 0.5


def delayed_outer_step(outer: OuterConfig) -> OuterConfig:
    """The outer optimizer settings of the delayed sync.

    ``outer.delayed.lr`` and ``outer.delayed.momentum`` where set. Otherwise the lr is ``outer.lr``
    and, with a delay, the momentum is at most :data:`DELAYED_MOMENTUM`: an outer gradient applied a
    round late keeps the momentum pushing for a round after the paths have moved on, and momentum
    0.9 (DiLoCo's) overshoots. A zero delay keeps ``outer.momentum``: DiLoCo, bit for bit."""
    lr = outer.lr if outer.delayed.lr is None else outer.delayed.lr
    if outer.delayed.momentum is not None:
        momentum = outer.delayed.momentum
    else:
        momentum = min(outer.momentum, DELAYED_MOMENTUM) if outer.delayed.delay > 0 else outer.momentum
    return replace(outer, lr=lr, momentum=momentum)


IN_FLIGHT_FILE = "delayed"  # delayed.safetensors: the outer gradients in flight at the checkpoint
OWN_FILE = "delayed_own"  # delayed_own.safetensors (eager): each path's own last delta, per rank


class DelayedDiLoCo(DiLoCo):
    name = "delayed"

    def __init__(self, ctx: SyncContext, two_phase_from: int = 3) -> None:
        super().__init__(ctx, two_phase_from)
        self.delay, self.eager = ctx.cfg.outer.delayed.delay, ctx.cfg.outer.delayed.eager
        self.nesterov = ModuleNesterov(ctx.bank, delayed_outer_step(ctx.cfg.outer))
        self.in_flight: list[Exchange] = []  # oldest first
        self.paths = tuple(ctx.by_rank[ctx.world.rank])
        self.own: dict[int, dict[str, torch.Tensor]] = {}  # eager: path -> part name -> d_p while it is in flight

    @torch.no_grad()
    def at(self, round_index: int, offset: int, paths: Mapping[int, PreTrainedModel]) -> SyncReport:
        start = time.perf_counter()
        last = round_index == self.cfg.train.rounds - 1
        due = min(round_index + self.delay, self.cfg.train.rounds - 1)
        # Every exchange has had at least a round to complete. Finishing them before the next one
        # starts keeps the error-feedback residuals and codec choices that it carries the same
        # whether or not a checkpoint (which finishes them) came in between: resume stays bit-exact.
        for exchange in self.in_flight:
            self.finish(exchange)
        if self.eager:  # theta_p + d_p(t-1): the path as if it had started the round from the bank
            for p, model in paths.items():
                for part in self.topology.parts:
                    if p in self.own:
                        self.bank.add_to_path(model, part, self.own[p][part.name])
        self.in_flight.append(self.send(round_index, paths, due=(due, offset)))
        own = {p: {part.name: self.bank.params[m] - self.bank.path_vector(model, part)
                   for part, m in zip(self.topology.parts, self.topology.path_modules(p))}
               for p, model in paths.items()} if self.eager else {}
        report = SyncReport(comm_seconds=self.in_flight[-1].wait_seconds)
        self.in_flight[-1].wait_seconds = 0.0  # issuing it is counted now; the round it lands counts its wait
        while self.in_flight and (last or self.in_flight[0].due[0] <= round_index):
            applied = self.apply(self.in_flight.pop(0))
            report.norms.update(applied.norms)  # the last round may apply several: the newest norm is kept
            report.dropped = sorted(set(report.dropped) | set(applied.dropped))
            report.stats.bytes_sent += applied.stats.bytes_sent
            report.stats.bytes_received += applied.stats.bytes_received
            report.stats.modules.update(applied.stats.modules)
            report.comm_seconds += applied.comm_seconds
        self.own = own if self.in_flight else {}  # eager: a path keeps its own delta while it is in flight
        for p, model in paths.items():  # every path restarts from the bank (eager: minus its own delta)
            self.bank.load_path(p, model)
            for part in self.topology.parts:
                if p in self.own:
                    self.bank.add_to_path(model, part, self.own[p][part.name], alpha=-1.0)
        report.seconds = time.perf_counter() - start
        return report

    # --- state: DiLoCo's, plus the outer gradients in flight ------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        in_flight = self.exchanges_state(self.in_flight)  # first: finishing updates residuals and codec choices
        state = super().state_dict()
        if in_flight:
            state[IN_FLIGHT_FILE] = in_flight
        if self.own:
            state[OWN_FILE] = {f"path_{p:03d}/{name}": v for p, parts in sorted(self.own.items())
                               for name, v in parts.items()}
        return state

    def load_state(self, saved: SavedState) -> None:
        super().load_state(saved)
        self.in_flight = self.load_exchanges(saved, IN_FLIGHT_FILE)
        self.own = {}
        mine = {f"path_{p:03d}": p for p in self.paths}
        for tensors in saved.per_rank(OWN_FILE).values():  # by path: the ranks' paths may have changed
            for key, value in tensors.items():
                path, part = key.split("/", 1)
                if path in mine:
                    self.own.setdefault(mine[path], {})[part] = value.to(self.bank.device)
