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
from typing import Mapping

import torch
from transformers import PreTrainedModel

from dipaco.comm.codecs import build_codec
from dipaco.comm.feedback import ErrorFeedback
from dipaco.comm.groups import plan_groups
from dipaco.comm.reduce import Payload, Transport
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.deltas import dropped_paths, local_sums, outer_gradient
from dipaco.sync.nesterov import ModuleNesterov
from dipaco.train.placement import module_writers, owners_of

MOMENTUM_FILE = "outer"  # outer.safetensors: one Nesterov buffer per module, written by its lowest holder
RESIDUAL_FILE = "comm"  # comm.safetensors: this rank's error-feedback residuals


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
        if codec.lossy and cfg.dist.error_feedback:
            self.transport = ErrorFeedback(transport, applied=lambda meta: bool(meta[0] > 0))
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
        dropped = dropped_paths(self.cfg.run.seed, round_index, self.topology.num_paths, self.cfg.outer.drop_prob)
        contributing = {p: model for p, model in paths.items() if p not in dropped}
        totals: dict[int, Payload] = {}
        for part in self.topology.parts:
            totals.update(local_sums(self.bank, part, contributing, self.weights))
        sent = {m: Payload(totals[m].meta, totals[m].values / self.scale[m]) if m in self.scale else totals[m]
                for m in self.transport.modules}
        comm_start = time.perf_counter()
        reduced = self.transport.reduce(sent)
        comm_seconds = time.perf_counter() - comm_start
        for m, payload in reduced.payloads.items():
            totals[m] = Payload(payload.meta, payload.values * self.scale[m]) if m in self.scale else payload
        norms = self.nesterov.step({m: outer_gradient(t, self.cfg.outer.rescale) for m, t in totals.items()})
        if self.cfg.dist.check_replicas:
            self.transport.check_identical(
                {m: (self.bank.params[m], self.nesterov.momentum(m)) for m in self.transport.modules}, reduced.stats)
        for p, model in paths.items():  # every path restarts from the updated modules
            self.bank.load_path(p, model)
        return SyncReport(norms=norms, dropped=sorted(dropped), stats=reduced.stats, comm_seconds=comm_seconds,
                          seconds=time.perf_counter() - start)

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        mine = {self.bank.module_name(m) for m in self.bank.held if self.writers[m] == self.world.rank}
        state = {MOMENTUM_FILE: {k: v for k, v in self.nesterov.state_dict().items() if k in mine}}
        if isinstance(self.transport, ErrorFeedback) and self.transport.residual:
            state[RESIDUAL_FILE] = self.transport.state_dict()
        return state

    def load_state(self, saved: SavedState) -> None:
        held = {self.bank.module_name(m) for m in self.bank.held}
        self.nesterov.load_state_dict(saved.replicated(MOMENTUM_FILE, held))
        if isinstance(self.transport, ErrorFeedback):
            self.transport.load_state_dict(self._residuals(saved), self._numel(), self.bank.device)

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
