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

One class, three parameters (as torchft's ``local_sgd.DiLoCo``): a :class:`Schedule` says which
slices leave together (*fragments*, each at its offset of the round), how many inner steps an
exchange runs before it lands (*delay*), and what a path does with a landed fragment (*mixing*
``theta_path <- alpha * theta_path + (1 - alpha) * theta_bank``, or a restart from the bank after every
sync). Plain DiLoCo is one fragment, no delay, alpha 0. Streaming DiLoCo
(:mod:`dipaco.sync.streaming`) and the one-round delay of DiLoCoX (:mod:`dipaco.sync.delayed`) are
schedules of it; each of those files builds its schedule and checks its own config keys. At every
sync point: exchanges in flight are finished (an exchange overlaps the inner steps up to the next
sync point), the fragments leaving now are sent, every exchange due now is applied oldest first, and
the paths take the result. An exchange whose landing would fall after the run lands at the run's
last sync point, so the final bank holds every outer gradient.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from dipaco.comm.accounting import CommStats
from dipaco.comm.adaptive import AdaptiveCodecs
from dipaco.comm.codecs import build_codec
from dipaco.comm.feedback import ErrorFeedback
from dipaco.comm.groups import CommGroup, plan_groups
from dipaco.comm.placement import module_writers, owners_of
from dipaco.comm.reduce import Payload, Transport
from dipaco.config import OuterConfig
from dipaco.errors import CheckpointError
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.deltas import dropped_paths, local_sums, outer_gradient
from dipaco.sync.nesterov import ModuleNesterov
from dipaco.sync.slices import Slice, spans_by_module, whole_modules

MOMENTUM = "outer"  # the outer optimizer's momentum, one buffer per module, written by its lowest holder
RESIDUALS = "comm"  # this rank's error-feedback residuals
CODEC_CHOICES = "adaptive"  # each module's codec choice (dist.adaptive), written by its lowest holder


@dataclass(frozen=True)
class Schedule:
    """When the slices leave, when they land, and what the paths do then (see the module docstring)."""

    # the offset in the round at which each fragment leaves (fragment 0 last); None: one fragment, which
    # leaves at every call of at() (plain DiLoCo, also inside another algorithm's schedule)
    leaves: tuple[int, ...] | None = None
    fragments: tuple[tuple[int, ...], ...] | None = None  # slice ids of each fragment; None: every slice
    delay: int = 0  # inner steps from leaving to landing (Streaming DiLoCo's tau; DiLoCoX: a round)
    alpha: float = 0.0  # landing: theta_path <- alpha * theta_path + (1 - alpha) * theta_bank on its slices
    restart: bool = False  # after every sync each path restarts from the whole bank (DiLoCoX), alpha unused
    eager: bool = False  # with restart: a path keeps its own change while it is in flight (Kale et al.)
    in_flight_part: str = "in_flight"  # the checkpoint part of the exchanges in flight


@dataclass
class Exchange:
    """One outer gradient on its way: the totals of every slice it carries of a held module (local
    sums, replaced by the reduced sums once the exchange completes) and the transport's handle while
    it is in flight.

    ``due``: (round, offset) at which the sync applies it (the overlapping syncs)."""

    totals: dict[int, Payload]  # slice id -> payload
    handle: Any
    due: tuple[int, int]
    slices: tuple[int, ...]  # the slices it carries (on every rank: a fragment, or all of them)
    dropped: tuple[int, ...] = ()
    stats: CommStats | None = None
    wait_seconds: float = 0.0


class DiLoCo(OuterSync):
    name = "diloco"

    def __init__(self, ctx: SyncContext, schedule: Schedule | None = None, slices: Sequence[Slice] | None = None,
                 outer_step: OuterConfig | None = None, two_phase_from: int = 3) -> None:
        """``schedule``: default plain DiLoCo (one fragment at the end of the round, landing at once).
        ``slices``: what the modules are exchanged in, in (module, start) order, covering every module
        exactly (default: whole modules). ``outer_step``: the outer SGD's lr and momentum (default ``outer.*``)."""
        self.outer, self.dist = ctx.outer, ctx.dist
        self.inner_steps, self.rounds, self.seed = ctx.inner_steps, ctx.rounds, ctx.seed
        self.bank, self.topology, self.world = ctx.bank, ctx.topology, ctx.world
        self.plan = schedule or Schedule()
        self.slices: tuple[Slice, ...] = tuple(slices if slices is not None else whole_modules(ctx.bank))
        self.of_module: dict[int, tuple[int, ...]] = {}  # module id -> its slice ids, in order
        for i, piece in enumerate(self.slices):
            self.of_module[piece.module] = self.of_module.get(piece.module, ()) + (i,)
        for m in self.topology.modules:  # each module's slices: consecutive ids, end to end over it
            ids, at = self.of_module.get(m.id, ()), 0
            for i in ids:
                at = self.slices[i].stop if self.slices[i].start == at else -1
            if not ids or at != ctx.bank.numel(m.part) or list(ids) != list(range(ids[0], ids[0] + len(ids))):
                raise ValueError(f"the slices of module {m.name} do not cover it in order")
        self.weights = dict(ctx.weights)
        self.nesterov = ModuleNesterov(ctx.bank, outer_step or ctx.outer)
        self.writers = module_writers(ctx.topology, ctx.by_rank)
        names = {i: piece.name for i, piece in enumerate(self.slices)}
        codec = build_codec(self.dist.comm_dtype, self.dist.chunk_size)
        groups = [CommGroup(g.ranks, tuple(i for m in g.modules for i in self.of_module[m]))
                  for g in plan_groups(ctx.topology, owners_of(ctx.by_rank))]  # a slice goes where its module goes
        transport = Transport(groups, ctx.world, codec, names, self.dist.timeout_s, two_phase_from)
        self.transport: Any = transport  # the Transport, maybe wrapped in error feedback and adaptive codecs
        self.feedback: ErrorFeedback | None = None
        self.adaptive: AdaptiveCodecs | None = None
        if codec.lossy and self.dist.error_feedback:
            self.transport = self.feedback = ErrorFeedback(transport, applied=lambda meta: bool(meta[0] > 0))
        if self.dist.adaptive:
            self.transport = self.adaptive = AdaptiveCodecs(self.transport, codec, self.dist.chunk_size,
                                                            self.dist.adaptive_tolerance,
                                                            self.dist.adaptive_sample_chunks)
        # Lossy payloads are divided by c_m = the weight of every path through m (a constant every
        # rank knows), so they have the scale of a parameter change: fp16 does not overflow on
        # token-count weights. fp32 sends the raw sums. Keyed by slice id, like every payload.
        self.scale = {i: float(sum(self.weights[p] for p in ctx.topology.paths_through(self.slices[i].module)))
                      for i in transport.modules} if codec.lossy else {}
        self.exchanges: list[Exchange] = []  # in flight, oldest first
        self.own: dict[int, dict[str, torch.Tensor]] = {}  # eager: path -> part name -> its change in flight
        self.paths = tuple(ctx.by_rank[ctx.world.rank])

    # --- the schedule ------------------------------------------------------------------------------
    @property
    def fragments(self) -> list[tuple[int, ...]]:
        """Slice ids of each fragment."""
        if self.plan.fragments is None:
            return [tuple(range(len(self.slices)))]
        return list(self.plan.fragments)

    def landing(self, round_index: int, offset: int) -> tuple[int, int]:
        """(round, offset) at which an exchange leaving at ``offset`` of ``round_index`` lands; one that would
        land after the run lands at its last sync point."""
        h, last = self.inner_steps, self.rounds - 1
        landed_round, landed_offset = divmod(round_index * h + offset + self.plan.delay - 1, h)
        if landed_round > last:
            return last, h
        return landed_round, landed_offset + 1

    @property
    def leaves(self) -> tuple[int, ...]:
        return self.plan.leaves if self.plan.leaves is not None else (self.inner_steps,)

    def schedule(self, round_index: int) -> list[tuple[int, int, tuple[int, int]]]:
        """(offset, fragment, landing (round, offset)) of every fragment that leaves in ``round_index``."""
        return sorted((leave, k, self.landing(round_index, leave)) for k, leave in enumerate(self.leaves))

    def sync_points(self) -> tuple[int, ...]:
        h, tau = self.inner_steps, self.plan.delay
        return tuple(sorted(set(self.leaves) | {(s + tau - 1) % h + 1 for s in self.leaves}))

    @torch.no_grad()
    def at(self, round_index: int, offset: int, paths: Mapping[int, PreTrainedModel]) -> SyncReport:
        start = time.perf_counter()
        # Every exchange has had the inner steps since the last sync point to complete. Finishing them
        # before the next one starts keeps the error-feedback residuals and codec choices that it carries
        # the same whether or not a checkpoint (which finishes them) came in between: resume stays bit-exact.
        for exchange in self.exchanges:
            self.finish(exchange)
        self._add_own(paths, sign=1.0)  # eager: the path as if it had started the round from the bank
        report = SyncReport()
        for leave, k, due in self.schedule(round_index):
            if self.plan.leaves is None:  # plain DiLoCo leaves wherever it is called
                leave, due = offset, self.landing(round_index, offset)
            if leave == offset:
                slices = None if self.plan.fragments is None else self.plan.fragments[k]
                self.exchanges.append(self.send(round_index, paths, due, slices=slices))
                report.comm_seconds += self.exchanges[-1].wait_seconds  # issuing it; the landing counts its wait
                self.exchanges[-1].wait_seconds = 0.0
        own = self._own_changes(paths) if self.plan.eager else {}
        while self.exchanges and self.exchanges[0].due <= (round_index, offset):
            exchange = self.exchanges.pop(0)
            report.merge(self.apply(exchange))
            if not self.plan.restart:
                self._land(exchange, paths)
        if self.plan.restart:  # every path restarts from the bank (eager: minus its own change in flight)
            self.own = own if self.exchanges else {}
            for p, model in paths.items():
                self.bank.load_path(p, model)
            self._add_own(paths, sign=-1.0)
        report.seconds = time.perf_counter() - start
        return report

    def _land(self, exchange: Exchange, paths: Mapping[int, PreTrainedModel]) -> None:
        """The paths take the landed slices: the bank's values, mixed with their own by alpha."""
        if self.plan.fragments is None:
            for p, model in paths.items():
                self.bank.load_path(p, model)
            return
        spans = spans_by_module(self.slices[i] for i in exchange.slices)
        for p, model in paths.items():
            self.bank.load_path(p, model, modules=set(spans), keep=self.plan.alpha, spans=spans)

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

    # --- the parts every DiLoCo-like sync is made of ----------------------------------------------
    def send(self, round_index: int, paths: Mapping[int, PreTrainedModel], due: tuple[int, int],
             slices: Collection[int] | None = None) -> Exchange:
        """This rank's weighted deltas of ``slices`` (default: every slice of every held module)
        against the bank, sent to the other holders; the exchange runs until :meth:`finish`."""
        dropped = dropped_paths(self.seed, round_index, self.topology.num_paths, self.outer.drop_prob)
        contributing = {p: model for p, model in paths.items() if p not in dropped}
        wanted = None if slices is None else set(slices)
        modules = None if wanted is None else {self.slices[i].module for i in wanted}
        totals: dict[int, Payload] = {}
        for part in self.topology.parts:
            ids = range(part.first_module, part.first_module + part.num_modules)
            if modules is None or any(m in modules for m in ids):
                for m, total in local_sums(self.bank, part, contributing, self.weights).items():
                    for i in self.of_module[m]:  # every slice of m carries m's weight and path count
                        if wanted is None or i in wanted:
                            piece = self.slices[i]
                            totals[i] = Payload(total.meta, total.values[piece.start:piece.stop])
        sent = {i: Payload(totals[i].meta, totals[i].values / self.scale[i]) if i in self.scale else totals[i]
                for i in self.transport.modules if i in totals}
        begin = time.perf_counter()
        handle = self.transport.start(sent) if wanted is None else self.transport.start(sent, only=wanted)
        carried = tuple(range(len(self.slices))) if wanted is None else tuple(sorted(wanted))
        return Exchange(totals, handle, due, carried, tuple(sorted(dropped)), wait_seconds=time.perf_counter() - begin)

    def finish(self, exchange: Exchange) -> Exchange:
        """Waits for the exchange (idempotent); its totals become the sums over every holder."""
        if exchange.handle is not None:
            begin = time.perf_counter()
            reduced = exchange.handle.wait()
            exchange.wait_seconds += time.perf_counter() - begin
            for i, payload in reduced.payloads.items():
                exchange.totals[i] = (Payload(payload.meta, payload.values * self.scale[i]) if i in self.scale
                                      else payload)
            exchange.stats, exchange.handle = reduced.stats, None
        return exchange

    def apply(self, exchange: Exchange) -> SyncReport:
        """Finishes the exchange and takes the Nesterov step of its slices (the path models are the
        caller's). A module whose slices are all in the exchange steps whole; the others step only
        the elements of their slices (the same values as a whole step would give them)."""
        self.finish(exchange)
        totals = exchange.totals
        grads = {i: g for i, t in totals.items() if (g := outer_gradient(t, self.outer.rescale)) is not None}
        module_grads: dict[int, torch.Tensor] = {}
        partial: dict[int, list[tuple[int, int]]] = {}  # modules of which only some slices step
        for m, ranges in spans_by_module(self.slices[i] for i in grads).items():
            pieces, numel = [i for i in self.of_module[m] if i in grads], self.bank.params[m].numel()
            if ranges != [(0, numel)]:
                partial[m] = ranges
            if len(pieces) == 1 and self.slices[pieces[0]].numel == numel:
                module_grads[m] = grads[pieces[0]]  # a whole module: its gradient as it is
                continue
            module_grads[m] = torch.zeros(numel, device=self.bank.device)
            for i in pieces:
                module_grads[m][self.slices[i].start:self.slices[i].stop] = grads[i]
        norms = self.nesterov.step(module_grads, partial)
        stats = exchange.stats or CommStats()
        if self.dist.check_replicas:
            tensors = {}
            for i in (i for i in self.transport.modules if i in totals):
                piece, mom = self.slices[i], self.nesterov.momentum(self.slices[i].module)
                tensors[i] = (self.bank.params[piece.module][piece.start:piece.stop],
                              None if mom is None else mom[piece.start:piece.stop])
            self.transport.check_identical(tensors, stats)
        return SyncReport(norms=norms, dropped=list(exchange.dropped), stats=stats,
                          comm_seconds=exchange.wait_seconds)

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        in_flight = self.exchanges_state(self.exchanges)  # first: finishing updates residuals and codec choices
        mine = {self.bank.module_name(m) for m in self.bank.held if self.writers[m] == self.world.rank}
        state = {MOMENTUM: {k: v for k, v in self.nesterov.state_dict().items() if k in mine}}
        if self.feedback is not None and self.feedback.residual:
            state[RESIDUALS] = self.feedback.state_dict()
        if self.adaptive is not None:
            choices = {k: v for k, v in self.adaptive.state_dict().items() if k in self._written()}
            if choices:
                state[CODEC_CHOICES] = choices
        if in_flight:
            state[self.plan.in_flight_part] = in_flight
        if self.own:
            state[self.plan.in_flight_part + "_own"] = {f"path_{p:03d}/{name}": v for p, parts in sorted(self.own.items())
                                                        for name, v in parts.items()}
        return state

    def load_state(self, saved: SavedState) -> None:
        held = {self.bank.module_name(m) for m in self.bank.held}
        self.nesterov.load_state_dict(saved.replicated(MOMENTUM, held))
        if self.feedback is not None:
            self.feedback.load_state_dict(self._residuals(saved), self._numel(), self.bank.device)
        if self.adaptive is not None:
            communicated = {self.slices[i].name for i in self.transport.modules}
            self.adaptive.load_state_dict(saved.replicated(CODEC_CHOICES, communicated))
        self.exchanges = self.load_exchanges(saved, self.plan.in_flight_part)
        self.own = {}
        mine = {f"path_{p:03d}": p for p in self.paths}
        for tensors in saved.per_rank(self.plan.in_flight_part + "_own").values():  # by path: placement may change
            for key, value in tensors.items():
                path, part = key.split("/", 1)
                if path in mine:
                    self.own.setdefault(mine[path], {})[part] = value.to(self.bank.device)

    def _residuals(self, saved: SavedState) -> dict[str, torch.Tensor]:
        """This rank's own residuals or, when the ranks' paths changed since the checkpoint, each
        module's residuals summed onto its lowest holder (error feedback only needs their sum)."""
        files = saved.per_rank(RESIDUALS)
        if saved.same_placement:
            return files.get(self.world.rank, {})
        summed: dict[str, torch.Tensor] = {}
        for tensors in files.values():
            for name, value in tensors.items():
                summed[name] = summed[name] + value if name in summed else value
        mine = self._written()
        return {n: v for n, v in summed.items() if n in mine}

    def _written(self) -> set[str]:
        """The communicated slices whose module this rank writes (as its lowest holder), by name."""
        return {self.slices[i].name for i in self.transport.modules
                if self.writers[self.slices[i].module] == self.world.rank}

    def _numel(self) -> dict[int, int]:
        return {i: self.slices[i].numel for i in self.transport.modules}

    # --- exchanges in flight at a checkpoint (the overlapping syncs) ------------------------------------
    def exchanges_state(self, exchanges: list[Exchange]) -> dict[str, torch.Tensor]:
        """``exchanges``, finished, as tensors. Reduced totals are the same on every holder and do not
        depend on the placement, so the lowest holder of each module writes them; the schedule, the
        dropped paths and this rank's byte counts are in every rank's file."""
        out: dict[str, torch.Tensor] = {}
        for k, exchange in enumerate(exchanges):
            self.finish(exchange)
            stats = exchange.stats or CommStats()
            out[f"{k}/due"] = torch.tensor(exchange.due, dtype=torch.int64)
            out[f"{k}/dropped"] = torch.tensor(exchange.dropped, dtype=torch.int64)
            # slice ids, under the key of checkpoints that carried whole modules (then the same ids)
            out[f"{k}/modules"] = torch.tensor(exchange.slices, dtype=torch.int64)
            out[f"{k}/bytes"] = torch.tensor([stats.bytes_sent, stats.bytes_received], dtype=torch.float64)
            for i, total in exchange.totals.items():
                if self.writers[self.slices[i].module] == self.world.rank:
                    name = self.slices[i].name
                    out[f"{k}/{name}/meta"], out[f"{k}/{name}/values"] = total.meta, total.values
        return out

    def load_exchanges(self, saved: SavedState, stem: str) -> list[Exchange]:
        """The exchanges :meth:`exchanges_state` wrote (on any number of ranks), finished, with the
        totals of the modules this bank holds."""
        files = saved.per_rank(stem)
        if not files:
            return []
        own = files.get(self.world.rank, files[min(files)])
        merged: dict[str, torch.Tensor] = {}
        for r in sorted(files):
            for key, value in files[r].items():
                merged.setdefault(key, value)
        exchanges = []
        for k in range(len({key.split("/")[0] for key in own})):
            slices = tuple(int(i) for i in own[f"{k}/modules"].tolist())
            if any(not 0 <= i < len(self.slices) for i in slices):
                raise CheckpointError(f"{stem}: the outer gradient in flight names slices {list(slices)[:4]} of "
                                      f"{len(self.slices)}")
            totals: dict[int, Payload] = {}
            for i in (i for i in slices if self.bank.holds(self.slices[i].module)):
                name = self.slices[i].name
                if f"{k}/{name}/meta" not in merged:
                    raise CheckpointError(f"{stem}: the outer gradient in flight lacks {name}")
                totals[i] = Payload(merged[f"{k}/{name}/meta"].to(self.bank.device),
                                    merged[f"{k}/{name}/values"].to(self.bank.device))
            due = tuple(int(v) for v in own[f"{k}/due"].tolist())
            sent, received = own[f"{k}/bytes"].tolist()
            exchanges.append(Exchange(totals, None, (due[0], due[1]), slices,
                                      tuple(int(p) for p in own[f"{k}/dropped"].tolist()),
                                      stats=CommStats(bytes_sent=sent, bytes_received=received)))
        return exchanges
