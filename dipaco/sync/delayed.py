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

Not implemented: the eager variant (Kale et al.), in which each worker applies its own fresh delta at
once and the others' delayed ones later: the holders of a module would then hold different values,
which the checkpoint (one copy per module) and ``dist.check_replicas`` rule out.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch
from transformers import PreTrainedModel

from dipaco.sync.base import SavedState, SyncContext, SyncReport
from dipaco.sync.diloco import DiLoCo, Exchange

IN_FLIGHT_FILE = "delayed"  # delayed.safetensors: the outer gradients in flight at the checkpoint


class DelayedDiLoCo(DiLoCo):
    name = "delayed"

    def __init__(self, ctx: SyncContext, two_phase_from: int = 3) -> None:
        super().__init__(ctx, two_phase_from)
        self.delay = ctx.cfg.outer.delayed.delay
        self.in_flight: list[Exchange] = []  # oldest first

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
        self.in_flight.append(self.send(round_index, paths, due=(due, offset)))
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
        for p, model in paths.items():  # every path restarts from the bank
            self.bank.load_path(p, model)
        report.seconds = time.perf_counter() - start
        return report

    # --- state: DiLoCo's, plus the outer gradients in flight ------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        in_flight = self.exchanges_state(self.in_flight)  # first: finishing updates residuals and codec choices
        state = super().state_dict()
        if in_flight:
            state[IN_FLIGHT_FILE] = in_flight
        return state

    def load_state(self, saved: SavedState) -> None:
        super().load_state(saved)
        self.in_flight = self.load_exchanges(saved, IN_FLIGHT_FILE)
