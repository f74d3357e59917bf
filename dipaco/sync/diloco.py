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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from dipaco.comm.accounting import CommStats
from dipaco.comm.adaptive import AdaptiveCodecs
from dipaco.comm.codecs import build_codec
from dipaco.comm.feedback import ErrorFeedback
from dipaco.comm.groups import CommGroup, plan_groups
from dipaco.comm.reduce import Payload, Transport
from dipaco.errors import CheckpointError
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.deltas import dropped_paths, local_sums, outer_gradient
from dipaco.sync.nesterov import ModuleNesterov
from dipaco.sync.slices import Slice, spans_by_module, whole_modules
from dipaco.train.placement import module_writers, owners_of

MOMENTUM_FILE = "outer"  # outer.safetensors: one Nesterov buffer per module, written by its lowest holder
RESIDUAL_FILE = "comm"  # comm.safetensors: this rank's error-feedback residuals
ADAPTIVE_FILE = "adaptive"  # adaptive.safetensors: each module's codec choice (dist.adaptive), lowest holder


@dataclass
class Exchange:
    """One outer gradient on its way: the totals of every slice it carries of a held module (local
    sums, replaced by the reduced sums once the exchange completes) and the transport's handle while
    it is in flight.

    ``due``: (round, offset) at which the sync applies it (the overlapping syncs)."""

    totals: dict[int, Payload]  # slice id -> payload
    handle: object | None
    due: tuple[int, int]
    slices: tuple[int, ...]  # the slices it carries (on every rank: a fragment, or all of them)
    dropped: tuple[int, ...] = ()
    stats: CommStats | None = None
    wait_seconds: float = 0.0


class DiLoCo(OuterSync):
    name = "diloco"

    def __init__(self, ctx: SyncContext, two_phase_from: int = 3, slices: Sequence[Slice] | None = None) -> None:
        """``slices``: what the modules are exchanged in, in (module, start) order, covering every
        module exactly (default: whole modules)."""
        cfg = ctx.cfg
        self.cfg, self.bank, self.topology, self.world = cfg, ctx.bank, ctx.topology, ctx.world
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
        self.nesterov = ModuleNesterov(ctx.bank, cfg.outer)
        self.writers = module_writers(ctx.topology, ctx.by_rank)
        names = {i: piece.name for i, piece in enumerate(self.slices)}
        codec = build_codec(cfg.dist.comm_dtype, cfg.dist.chunk_size)
        groups = [CommGroup(g.ranks, tuple(i for m in g.modules for i in self.of_module[m]))
                  for g in plan_groups(ctx.topology, owners_of(ctx.by_rank))]  # a slice goes where its module goes
        transport = Transport(groups, ctx.world, codec, names, cfg.dist.timeout_s, two_phase_from)
        self.transport = transport
        self.feedback: ErrorFeedback | None = None
        self.adaptive: AdaptiveCodecs | None = None
        if codec.lossy and cfg.dist.error_feedback:
            self.transport = self.feedback = ErrorFeedback(transport, applied=lambda meta: bool(meta[0] > 0))
        if cfg.dist.adaptive:
            self.transport = self.adaptive = AdaptiveCodecs(self.transport, codec, cfg.dist.chunk_size,
                                                            cfg.dist.adaptive_tolerance,
                                                            cfg.dist.adaptive_sample_chunks)
        # Lossy payloads are divided by c_m = the weight of every path through m (a constant every
        # rank knows), so they have the scale of a parameter change: fp16 does not overflow on
        # token-count weights. fp32 sends the raw sums. Keyed by slice id, like every payload.
        self.scale = {i: float(sum(self.weights[p] for p in ctx.topology.paths_through(self.slices[i].module)))
                      for i in transport.modules} if codec.lossy else {}

    def sync_points(self) -> tuple[int, ...]:
        return (self.cfg.train.inner_steps,)

    @torch.no_grad()
    def at(self, round_index: int, offset: int, paths: Mapping[int, PreTrainedModel]) -> SyncReport:
        start = time.perf_counter()
        exchange = self.send(round_index, paths, due=(round_index, offset))
        report = self.apply(exchange)
        for p, model in paths.items():  # every path restarts from the updated modules
            self.bank.load_path(p, model)
        report.seconds = time.perf_counter() - start
        return report

    # --- the parts every DiLoCo-like sync is made of ----------------------------------------------
    def send(self, round_index: int, paths: Mapping[int, PreTrainedModel], due: tuple[int, int],
             slices: Collection[int] | None = None) -> Exchange:
        """This rank's weighted deltas of ``slices`` (default: every slice of every held module)
        against the bank, sent to the other holders; the exchange runs until :meth:`finish`."""
        dropped = dropped_paths(self.cfg.run.seed, round_index, self.topology.num_paths, self.cfg.outer.drop_prob)
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
        grads = {i: g for i, t in totals.items() if (g := outer_gradient(t, self.cfg.outer.rescale)) is not None}
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
        if self.cfg.dist.check_replicas:
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
        mine = {self.bank.module_name(m) for m in self.bank.held if self.writers[m] == self.world.rank}
        state = {MOMENTUM_FILE: {k: v for k, v in self.nesterov.state_dict().items() if k in mine}}
        if self.feedback is not None and self.feedback.residual:
            state[RESIDUAL_FILE] = self.feedback.state_dict()
        if self.adaptive is not None:
            choices = {k: v for k, v in self.adaptive.state_dict().items() if k in self._written()}
            if choices:
                state[ADAPTIVE_FILE] = choices
        return state

    def load_state(self, saved: SavedState) -> None:
        held = {self.bank.module_name(m) for m in self.bank.held}
        self.nesterov.load_state_dict(saved.replicated(MOMENTUM_FILE, held))
        if self.feedback is not None:
            self.feedback.load_state_dict(self._residuals(saved), self._numel(), self.bank.device)
        if self.adaptive is not None:
            communicated = {self.slices[i].name for i in self.transport.modules}
            self.adaptive.load_state_dict(saved.replicated(ADAPTIVE_FILE, communicated))

    def _residuals(self, saved: SavedState) -> dict[str, torch.Tensor]:
        """This rank's own residuals or, when the ranks' paths changed since the checkpoint, each
        module's residuals summed onto its lowest holder (error feedback only needs their sum)."""
        files = saved.per_rank(RESIDUAL_FILE)
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
