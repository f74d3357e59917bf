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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Collection, Mapping

import torch
from transformers import PreTrainedModel

from dipaco.comm.accounting import CommStats
from dipaco.comm.adaptive import AdaptiveCodecs
from dipaco.comm.codecs import build_codec
from dipaco.comm.feedback import ErrorFeedback
from dipaco.comm.groups import plan_groups
from dipaco.comm.reduce import Payload, Transport
from dipaco.errors import CheckpointError
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.deltas import dropped_paths, local_sums, outer_gradient
from dipaco.sync.nesterov import ModuleNesterov
from dipaco.train.placement import module_writers, owners_of

MOMENTUM_FILE = "outer"  # outer.safetensors: one Nesterov buffer per module, written by its lowest holder
RESIDUAL_FILE = "comm"  # comm.safetensors: this rank's error-feedback residuals
ADAPTIVE_FILE = "adaptive"  # adaptive.safetensors: each module's codec choice (dist.adaptive), lowest holder


@dataclass
class Exchange:
    """One outer gradient on its way: every held module's totals (local sums, replaced by the
    reduced sums once the exchange completes) and the transport's handle while it is in flight.

    ``due``: (round, offset) at which the sync applies it (the overlapping syncs)."""

    totals: dict[int, Payload]
    handle: object | None
    due: tuple[int, int]
    modules: tuple[int, ...]  # the modules it carries (on every rank: a fragment, or all of them)
    dropped: tuple[int, ...] = ()
    stats: CommStats | None = None
    wait_seconds: float = 0.0


class DiLoCo(OuterSync):
    name = "diloco"

    def __init__(self, ctx: SyncContext, two_phase_from: int = 3) -> None:
        cfg = ctx.cfg
        self.cfg, self.bank, self.topology, self.world = cfg, ctx.bank, ctx.topology, ctx.world
        self.weights = dict(ctx.weights)
        self.nesterov = ModuleNesterov(ctx.bank, cfg.outer)
        self.writers = module_writers(ctx.topology, ctx.by_rank)
        names = {m.id: m.name for m in ctx.topology.modules}
        codec = build_codec(cfg.dist.comm_dtype, cfg.dist.chunk_size)
        transport = Transport(plan_groups(ctx.topology, owners_of(ctx.by_rank)), ctx.world, codec, names,
                              cfg.dist.timeout_s, two_phase_from)
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
        # token-count weights. fp32 sends the raw sums.
        self.scale = {m: float(sum(self.weights[p] for p in ctx.topology.paths_through(m)))
                      for m in transport.modules} if codec.lossy else {}

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
             modules: Collection[int] | None = None) -> Exchange:
        """This rank's weighted deltas of ``modules`` (default: every held module) against the bank,
        sent to the other holders; the exchange runs until :meth:`finish`."""
        dropped = dropped_paths(self.cfg.run.seed, round_index, self.topology.num_paths, self.cfg.outer.drop_prob)
        contributing = {p: model for p, model in paths.items() if p not in dropped}
        wanted = None if modules is None else set(modules)
        totals: dict[int, Payload] = {}
        for part in self.topology.parts:
            ids = range(part.first_module, part.first_module + part.num_modules)
            if wanted is None or any(m in wanted for m in ids):
                sums = local_sums(self.bank, part, contributing, self.weights)
                totals.update(sums if wanted is None else {m: t for m, t in sums.items() if m in wanted})
        sent = {m: Payload(totals[m].meta, totals[m].values / self.scale[m]) if m in self.scale else totals[m]
                for m in self.transport.modules if m in totals}
        begin = time.perf_counter()
        handle = self.transport.start(sent) if wanted is None else self.transport.start(sent, only=wanted)
        carried = tuple(range(len(self.topology.modules))) if wanted is None else tuple(sorted(wanted))
        return Exchange(totals, handle, due, carried, tuple(sorted(dropped)), wait_seconds=time.perf_counter() - begin)

    def finish(self, exchange: Exchange) -> Exchange:
        """Waits for the exchange (idempotent); its totals become the sums over every holder."""
        if exchange.handle is not None:
            begin = time.perf_counter()
            reduced = exchange.handle.wait()
            exchange.wait_seconds += time.perf_counter() - begin
            for m, payload in reduced.payloads.items():
                exchange.totals[m] = (Payload(payload.meta, payload.values * self.scale[m]) if m in self.scale
                                      else payload)
            exchange.stats, exchange.handle = reduced.stats, None
        return exchange

    def apply(self, exchange: Exchange) -> SyncReport:
        """Finishes the exchange and takes the Nesterov step of its modules (the path models are the caller's)."""
        self.finish(exchange)
        totals = exchange.totals
        norms = self.nesterov.step({m: outer_gradient(t, self.cfg.outer.rescale) for m, t in totals.items()})
        stats = exchange.stats or CommStats()
        if self.cfg.dist.check_replicas:
            self.transport.check_identical(
                {m: (self.bank.params[m], self.nesterov.momentum(m)) for m in self.transport.modules if m in totals},
                stats)
        return SyncReport(norms=norms, dropped=list(exchange.dropped), stats=stats,
                          comm_seconds=exchange.wait_seconds)

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        mine = {self.bank.module_name(m) for m in self.bank.held if self.writers[m] == self.world.rank}
        state = {MOMENTUM_FILE: {k: v for k, v in self.nesterov.state_dict().items() if k in mine}}
        if self.feedback is not None and self.feedback.residual:
            state[RESIDUAL_FILE] = self.feedback.state_dict()
        if self.adaptive is not None:
            choices = {k: v for k, v in self.adaptive.state_dict().items() if k in mine}
            if choices:
                state[ADAPTIVE_FILE] = choices
        return state

    def load_state(self, saved: SavedState) -> None:
        held = {self.bank.module_name(m) for m in self.bank.held}
        self.nesterov.load_state_dict(saved.replicated(MOMENTUM_FILE, held))
        if self.feedback is not None:
            self.feedback.load_state_dict(self._residuals(saved), self._numel(), self.bank.device)
        if self.adaptive is not None:
            communicated = {self.bank.module_name(m) for m in self.transport.modules}
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
        mine = {self.bank.module_name(m) for m in self.transport.modules if self.writers[m] == self.world.rank}
        return {n: v for n, v in summed.items() if n in mine}

    def _numel(self) -> dict[int, int]:
        return {m: self.bank.numel(self.topology.modules[m].part) for m in self.transport.modules}

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
            out[f"{k}/modules"] = torch.tensor(exchange.modules, dtype=torch.int64)
            out[f"{k}/bytes"] = torch.tensor([stats.bytes_sent, stats.bytes_received], dtype=torch.float64)
            for m, total in exchange.totals.items():
                if self.writers[m] == self.world.rank:
                    name = self.bank.module_name(m)
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
            modules = tuple(int(m) for m in own[f"{k}/modules"].tolist())
            totals: dict[int, Payload] = {}
            for m in (m for m in modules if self.bank.holds(m)):
                name = self.bank.module_name(m)
                if f"{k}/{name}/meta" not in merged:
                    raise CheckpointError(f"{stem}: the outer gradient in flight lacks module {name}")
                totals[m] = Payload(merged[f"{k}/{name}/meta"].to(self.bank.device),
                                    merged[f"{k}/{name}/values"].to(self.bank.device))
            due = tuple(int(v) for v in own[f"{k}/due"].tolist())
            sent, received = own[f"{k}/bytes"].tolist()
            exchanges.append(Exchange(totals, None, (due[0], due[1]), modules,
                                      tuple(int(p) for p in own[f"{k}/dropped"].tolist()),
                                      stats=CommStats(bytes_sent=sent, bytes_received=received)))
        return exchanges
