"""Synchronous per-module DiLoCo: the outer sync of DiPaCo.

DiLoCo (Douillard et al., arXiv 2311.08105) keeps replicas of a model in sync with rare outer
steps: each replica takes H inner AdamW steps, and the average change of the replicas is the
gradient of an outer SGD-Nesterov step. DiPaCo (Douillard et al., arXiv 2403.10616, section 2.3)
applies it per module: the outer gradient of module m averages the changes of only the paths
that contain m (:mod:`dipaco.sync.deltas`), and every module has its own Nesterov state
(:mod:`dipaco.sync.nesterov`).

Schedule: one sync per round, after ``train.inner_steps`` steps. At the sync, this rank sums the
weighted deltas of its paths per module, the transport sums them over the ranks holding each
module, every holder applies the same Nesterov step, and every path of the rank restarts from the
updated modules. ``outer.drop_prob`` drops each path's contribution per round (seeded, the same
decision on every rank).

Guarantees:

* a path contributes only to the modules it contains;
* a module that no contributing path contains is left exactly as it was, parameters and momentum;
* with ``dist.comm_dtype=fp32`` every holder of a module applies bit-identical updates, which
  differ from a single process only by the order of fp32 additions; lossy codecs also give every
  holder the same bits (:mod:`dipaco.comm.reduce`);
* with ``lr=1, momentum=0`` a module becomes the weighted average of its paths, and a single path
  with every part shared is plain continued training;
* a single process is bit-reproducible, and a resumed run continues bit-exactly (CPU).

The unit of an exchange is a *slice* (:mod:`dipaco.sync.slices`): a whole module here, part of one
under Streaming DiLoCo's ``blocks:K`` fragments. Payloads, codecs, error-feedback residuals and
adaptive codec choices are per slice; averaging, the lossy scale, holders and Nesterov momentum per
module. Slices of whole modules have the module's id and name, so nothing changes for them.

DiLoCo in three parts (as torchft separates them): a :class:`~dipaco.sync.schedule.Schedule` says
which slices leave when, when they land and what the paths do then (plain DiLoCo: one fragment of
every slice at the end of the round, no delay, alpha 0; Streaming DiLoCo, :mod:`dipaco.sync.streaming`,
and the one-round delay of DiLoCoX, :mod:`dipaco.sync.delayed`, are other schedules of this class);
an :class:`~dipaco.sync.transport.OuterTransport` carries the outer gradients (codec, error feedback,
adaptive codecs, the exchanges in flight and their checkpointed state); the kernel
(:class:`~dipaco.sync.nesterov.ModuleNesterov`) takes the Nesterov step. At every sync point:
exchanges in flight are finished (an exchange overlaps the inner steps up to the next sync point),
the fragments leaving now are sent, every exchange due now is applied oldest first, and the paths
take the result.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from dipaco.comm.accounting import CommStats
from dipaco.comm.reduce import Payload
from dipaco.sync.base import OUTER_MOMENTUM_PART, OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.deltas import dropped_paths, local_sums, outer_gradient
from dipaco.sync.nesterov import ModuleNesterov, OuterStep
from dipaco.sync.schedule import Schedule
from dipaco.sync.slices import Slice, check_cover, module_vectors, spans_by_module, whole_modules
from dipaco.sync.transport import Exchange, build_transport

OWN_CHANGES_SUFFIX = "_own"  # eager: the checkpoint part of the paths' own changes in flight, after the exchanges'


class DiLoCo(OuterSync):
    name = "diloco"
    in_flight_part = "in_flight"  # the checkpoint part of the exchanges in flight

    def __init__(self, ctx: SyncContext, schedule: Schedule | None = None, slices: Sequence[Slice] | None = None,
                 outer_step: OuterStep | None = None, two_phase_from: int = 3) -> None:
        """``schedule``: default plain DiLoCo (:meth:`Schedule.diloco`). ``slices``: what the modules are
        exchanged in, in (module, start) order, covering every module exactly (default: whole modules).
        ``outer_step``: the outer SGD's numbers (default ``outer.*``)."""
        self.outer, self.seed, self.check_replicas = ctx.outer, ctx.seed, ctx.dist.check_replicas
        self.bank, self.topology, self.weights = ctx.bank, ctx.topology, dict(ctx.weights)
        self.slices: tuple[Slice, ...] = tuple(slices if slices is not None else whole_modules(ctx.bank))
        self.of_module = check_cover(self.slices, ctx.bank)  # module id -> its slice ids, in order
        self.plan = schedule or Schedule.diloco(ctx.inner_steps, ctx.rounds, len(self.slices))
        self.nesterov = ModuleNesterov(ctx.bank, outer_step or OuterStep.of(ctx.outer))
        self.transport = build_transport(ctx, self.slices, self.in_flight_part, two_phase_from)
        self.own: dict[int, dict[str, torch.Tensor]] = {}  # eager: path -> part name -> its change in flight
        self.paths = tuple(ctx.by_rank[ctx.world.rank])

    @property
    def fragments(self) -> list[tuple[int, ...]]:
        """Slice ids of each fragment."""
        return list(self.plan.fragments)

    def schedule(self, round_index: int) -> list[tuple[int, int, tuple[int, int]]]:
        """(offset, fragment, landing (round, offset)) of every fragment that leaves in ``round_index``."""
        return self.plan.departures(round_index)

    def sync_points(self) -> tuple[int, ...]:
        return self.plan.sync_points()

    @torch.no_grad()
    def at(self, round_index: int, offset: int, paths: Mapping[int, PreTrainedModel]) -> SyncReport:
        start = time.perf_counter()
        # Every exchange has had the inner steps since the last sync point to complete. Finishing them
        # before the next one starts keeps the error-feedback residuals and codec choices that it carries
        # the same whether or not a checkpoint (which finishes them) came in between: resume stays bit-exact.
        self.transport.finish_all()
        self._add_own(paths, sign=1.0)  # eager: the path as if it had started the round from the bank
        report = SyncReport()
        for k, due in self.plan.leaving(round_index, offset):
            report.comm_seconds += self.send(round_index, paths, due, self.plan.fragments[k])  # issuing it
        own = self._own_changes(paths) if self.plan.eager else {}
        for exchange in self.transport.landed(round_index, offset):
            report.merge(self.apply(exchange))  # the landing counts its wait
            if not self.plan.restart:
                self._land(exchange, paths)
        if self.plan.restart:  # every path restarts from the bank (eager: minus its own change in flight)
            self.own = own if self.transport.exchanges else {}
            for p, model in paths.items():
                self.bank.load_path(p, model)
            self._add_own(paths, sign=-1.0)
        report.seconds = time.perf_counter() - start
        return report

    def send(self, round_index: int, paths: Mapping[int, PreTrainedModel], due: tuple[int, int],
             slices: tuple[int, ...]) -> float:
        """Sends this rank's weighted deltas of ``slices`` against the bank to the other holders (the
        exchange runs until it is finished); returns the seconds issuing it."""
        dropped = dropped_paths(self.seed, round_index, self.topology.num_paths, self.outer.drop_prob)
        contributing = {p: model for p, model in paths.items() if p not in dropped}
        wanted = set(slices)
        modules = {self.slices[i].module for i in wanted}
        totals: dict[int, Payload] = {}
        for part in self.topology.parts:
            if any(m in modules for m in range(part.first_module, part.first_module + part.num_modules)):
                for m, total in local_sums(self.bank, part, contributing, self.weights).items():
                    for i in self.of_module[m]:  # every slice of m carries m's weight and path count
                        if i in wanted:
                            piece = self.slices[i]
                            totals[i] = Payload(total.meta, total.values[piece.start:piece.stop])
        return self.transport.send(totals, tuple(sorted(wanted)), due, tuple(sorted(dropped)))

    def apply(self, exchange: Exchange) -> SyncReport:
        """Finishes the exchange and takes the Nesterov step of its slices (the path models are the
        caller's). A module whose slices are all in the exchange steps whole; the others step only
        the elements of their slices (the same values as a whole step would give them)."""
        totals = self.transport.finish(exchange).totals
        grads = {i: g for i, t in totals.items() if (g := outer_gradient(t, self.outer.rescale)) is not None}
        numel = {m: self.bank.params[m].numel() for m in self.bank.held}
        norms = self.nesterov.step(*module_vectors(self.slices, grads, numel, self.bank.device))
        stats = exchange.stats or CommStats()
        if self.check_replicas:
            tensors = {}
            for i in (i for i in self.transport.modules if i in totals):
                piece, mom = self.slices[i], self.nesterov.momentum(self.slices[i].module)
                tensors[i] = (self.bank.params[piece.module][piece.start:piece.stop],
                              None if mom is None else mom[piece.start:piece.stop])
            self.transport.check_identical(tensors, stats)
        return SyncReport(norms=norms, dropped=list(exchange.dropped), stats=stats,
                          comm_seconds=exchange.wait_seconds)

    def _land(self, exchange: Exchange, paths: Mapping[int, PreTrainedModel]) -> None:
        """The paths take the landed slices: the bank's values, mixed with their own by alpha."""
        spans = spans_by_module(self.slices[i] for i in exchange.slices)
        for p, model in paths.items():
            self.bank.load_path(p, model, modules=set(spans), keep=self.plan.alpha, spans=spans)

    # --- eager: each path's own change while its exchange is in flight ------------------------------
    def _own_changes(self, paths: Mapping[int, PreTrainedModel]) -> dict[int, dict[str, torch.Tensor]]:
        """Each path's change since it started from the bank, per part."""
        return {p: {part.name: self.bank.params[m] - self.bank.path_vector(model, part)
                    for part, m in zip(self.topology.parts, self.topology.path_modules(p))}
                for p, model in paths.items()}

    def _add_own(self, paths: Mapping[int, PreTrainedModel], sign: float) -> None:
        for p, model in paths.items():
            for part in self.topology.parts:
                if p in self.own:
                    self.bank.add_to_path(model, part, self.own[p][part.name], alpha=sign)

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        carried = self.transport.state_dict()  # first: finishing the exchanges updates residuals and codec choices
        mine = {self.bank.module_name(m) for m in self.bank.held if self.transport.holder.writes(m)}
        state = {OUTER_MOMENTUM_PART: {k: v for k, v in self.nesterov.state_dict().items() if k in mine}, **carried}
        if self.own:
            state[self.in_flight_part + OWN_CHANGES_SUFFIX] = {
                f"path_{p:03d}/{name}": v for p, parts in sorted(self.own.items()) for name, v in parts.items()}
        return state

    def load_state_dict(self, saved: SavedState) -> None:
        held = {self.bank.module_name(m) for m in self.bank.held}
        self.nesterov.load_state_dict(saved.replicated(OUTER_MOMENTUM_PART, held))
        self.transport.load_state_dict(saved)
        self.own = {}
        mine = {f"path_{p:03d}": p for p in self.paths}
        own = saved.per_rank(self.in_flight_part + OWN_CHANGES_SUFFIX)
        for tensors in own.values():  # by path: placement may change
            for key, value in tensors.items():
                path, part = key.split("/", 1)
                if path in mine:
                    self.own.setdefault(mine[path], {})[part] = value.to(self.bank.device)
