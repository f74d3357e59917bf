"""The transport of DiLoCo's outer step: outer gradients on their way between the holders of each module.

:func:`build_transport` builds it once per sync, in layers: a codec (``dist.comm_dtype``), the
:class:`~dipaco.comm.reduce.Transport` that sums payloads over each module's holders, error feedback
(:class:`~dipaco.comm.feedback.ErrorFeedback`, lossy codecs with ``dist.error_feedback``) and
adaptive codec choices (:class:`~dipaco.comm.adaptive.AdaptiveCodecs`, ``dist.adaptive``) around
it. :class:`OuterTransport` owns them and the exchanges in flight:

* :meth:`OuterTransport.send` starts an :class:`Exchange`: the local sums of some slices, sent as
  asynchronous torch.distributed work; :meth:`OuterTransport.finish` waits for it, after which its
  totals are the sums over every holder;
* lossy payloads are divided by c_m = the weight of every path through the slice's module (a
  constant every rank knows), so they have the scale of a parameter change (fp16 does not overflow
  on token-count weights), and multiplied back when the exchange finishes; fp32 sends the raw sums;
* payloads, codecs, error-feedback residuals and adaptive codec choices are per slice
  (:mod:`dipaco.sync.slices`; whole modules have the module's id and name).

Its checkpointed state (:meth:`OuterTransport.state_dict` / :meth:`OuterTransport.load_state_dict`):
this rank's residuals (:data:`RESIDUALS_PART`, per rank: when the ranks' paths changed since the
checkpoint, each module's residuals are summed onto its lowest holder, as error feedback only needs
their sum), each slice's codec choice (:data:`CODEC_CHOICES_PART`, written by the module's lowest
holder), and the exchanges in flight, finished first (so the residuals and codec choices they carry
are the same whether or not a checkpoint came in between: a resumed run continues bit-exactly). An
exchange's reduced totals are the same on every holder and do not depend on the placement, so the
lowest holder of each module writes them; the schedule, the dropped paths and this rank's byte
counts are in every rank's file.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dipaco.comm.accounting import CommStats
from dipaco.comm.adaptive import AdaptiveCodecs
from dipaco.comm.codecs import build_codec
from dipaco.comm.feedback import ErrorFeedback
from dipaco.comm.groups import CommGroup, plan_groups
from dipaco.comm.placement import module_writers, owners_of
from dipaco.comm.reduce import CodecReducer, Payload, PendingReduction, Reducer, Transport
from dipaco.errors import CheckpointError
from dipaco.sync.base import SavedState, SyncContext
from dipaco.sync.slices import Slice, ids_by_module

RESIDUALS_PART = "comm"  # the checkpoint part of this rank's error-feedback residuals
CODEC_CHOICES_PART = "adaptive"  # each slice's codec choice (dist.adaptive), written by its module's lowest holder


@dataclass
class Exchange:
    """One outer gradient on its way: the totals of every slice it carries of a held module (local
    sums, replaced by the reduced sums once the exchange completes) and the transport's handle while
    it is in flight.

    ``due``: (round, offset) at which the sync applies it (the overlapping syncs)."""

    totals: dict[int, Payload]  # slice id -> payload
    handle: PendingReduction | None
    due: tuple[int, int]
    slices: tuple[int, ...]  # the slices it carries (on every rank: a fragment, or all of them)
    dropped: tuple[int, ...] = ()
    stats: CommStats | None = None
    wait_seconds: float = 0.0


@dataclass(frozen=True)
class Holder:
    """This rank, as the state of the exchanges sees it."""

    rank: int
    writers: Mapping[int, int]  # module id -> the rank that writes its replicated state (its lowest holder)
    held: frozenset[int]  # the modules this rank's bank holds
    device: torch.device

    def writes(self, module: int) -> bool:
        return self.writers[module] == self.rank


def build_transport(ctx: SyncContext, slices: Sequence[Slice], in_flight_part: str,
                    two_phase_from: int = 3) -> OuterTransport:
    """The layered transport of a sync over ``slices`` (every slice goes where its module goes);
    ``in_flight_part``: the checkpoint part of its exchanges in flight."""
    dist = ctx.dist
    of_module = ids_by_module(slices)
    holder = Holder(ctx.world.rank, module_writers(ctx.topology, ctx.by_rank), frozenset(ctx.bank.held),
                    ctx.bank.device)
    names = {i: piece.name for i, piece in enumerate(slices)}
    codec = build_codec(dist.comm_dtype, dist.chunk_size)
    groups = [CommGroup(g.ranks, tuple(i for m in g.modules for i in of_module[m]))
              for g in plan_groups(ctx.topology, owners_of(ctx.by_rank))]
    transport = Transport(groups, ctx.world, codec, names, dist.timeout_s, two_phase_from)
    inner: CodecReducer = transport
    top: Reducer = transport
    feedback: ErrorFeedback | None = None
    adaptive: AdaptiveCodecs | None = None
    if codec.lossy and dist.error_feedback:
        top = inner = feedback = ErrorFeedback(transport, applied=lambda meta: bool(meta[0] > 0))
    if dist.adaptive:
        top = adaptive = AdaptiveCodecs(inner, codec, dist.chunk_size, dist.adaptive_tolerance,
                                        dist.adaptive_sample_chunks)
    scale = {i: float(sum(ctx.weights[p] for p in ctx.topology.paths_through(slices[i].module)))
             for i in transport.modules} if codec.lossy else {}
    return OuterTransport(top, slices, holder, in_flight_part, scale, feedback, adaptive)


class OuterTransport:
    def __init__(self, reducer: Reducer, slices: Sequence[Slice], holder: Holder, in_flight_part: str,
                 scale: Mapping[int, float], feedback: ErrorFeedback | None = None,
                 adaptive: AdaptiveCodecs | None = None) -> None:
        """``reducer``: the outermost layer, ``feedback`` and ``adaptive`` the layers in it (if any);
        ``scale``: slice id -> c_m of the lossy payloads (empty: fp32)."""
        self.reducer, self.slices, self.holder, self.in_flight_part = reducer, tuple(slices), holder, in_flight_part
        self.scale, self.feedback, self.adaptive = dict(scale), feedback, adaptive
        self.exchanges: list[Exchange] = []  # in flight, oldest first

    @property
    def modules(self) -> tuple[int, ...]:
        """The slices this rank communicates."""
        return self.reducer.modules

    @property
    def mine(self) -> list[tuple[CommGroup, object]]:
        return self.reducer.mine

    def check_identical(self, tensors: Mapping[int, tuple[torch.Tensor | None, ...]], stats: CommStats) -> None:
        self.reducer.check_identical(tensors, stats)

    # --- exchanges ---------------------------------------------------------------------------------
    def send(self, totals: dict[int, Payload], slices: tuple[int, ...], due: tuple[int, int],
             dropped: tuple[int, ...]) -> float:
        """Starts the exchange of ``slices`` (every holder names the same ones) from this rank's local
        ``totals`` (slice id -> payload, for the slices of held modules); returns the seconds issuing it."""
        sent = {i: Payload(totals[i].meta, totals[i].values / self.scale[i]) if i in self.scale else totals[i]
                for i in self.modules if i in totals}
        begin = time.perf_counter()
        handle = self.reducer.start(sent, only=set(slices))
        self.exchanges.append(Exchange(totals, handle, due, slices, dropped))
        return time.perf_counter() - begin

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

    def finish_all(self) -> None:
        for exchange in self.exchanges:
            self.finish(exchange)

    def landed(self, round_index: int, offset: int) -> list[Exchange]:
        """The exchanges due at (round, offset) or before, oldest first, no longer in flight."""
        out = []
        while self.exchanges and self.exchanges[0].due <= (round_index, offset):
            out.append(self.exchanges.pop(0))
        return out

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        in_flight = self._exchanges_state()  # first: finishing updates residuals and codec choices
        state = {}
        if self.feedback is not None and self.feedback.residual:
            state[RESIDUALS_PART] = self.feedback.state_dict()
        if self.adaptive is not None:
            choices = {k: v for k, v in self.adaptive.state_dict().items() if k in self._written()}
            if choices:
                state[CODEC_CHOICES_PART] = choices
        if in_flight:
            state[self.in_flight_part] = in_flight
        return state

    def load_state_dict(self, saved: SavedState) -> None:
        if self.feedback is not None:
            numel = {i: self.slices[i].numel for i in self.modules}
            self.feedback.load_state_dict(self._residuals(saved), numel, self.holder.device)
        if self.adaptive is not None:
            communicated = {self.slices[i].name for i in self.modules}
            self.adaptive.load_state_dict(saved.replicated(CODEC_CHOICES_PART, communicated))
        self.exchanges = self._load_exchanges(saved)

    def _residuals(self, saved: SavedState) -> dict[str, torch.Tensor]:
        """This rank's own residuals or, when the ranks' paths changed since the checkpoint, each
        module's residuals summed onto its lowest holder (error feedback only needs their sum)."""
        files = saved.per_rank(RESIDUALS_PART)
        if saved.same_placement:
            return files.get(self.holder.rank, {})
        summed: dict[str, torch.Tensor] = {}
        for tensors in files.values():
            for name, value in tensors.items():
                summed[name] = summed[name] + value if name in summed else value
        mine = self._written()
        return {n: v for n, v in summed.items() if n in mine}

    def _written(self) -> set[str]:
        """The communicated slices whose module this rank writes (as its lowest holder), by name."""
        return {self.slices[i].name for i in self.modules if self.holder.writes(self.slices[i].module)}

    def _exchanges_state(self) -> dict[str, torch.Tensor]:
        """The exchanges in flight, finished, as tensors (see the module docstring)."""
        out: dict[str, torch.Tensor] = {}
        for k, exchange in enumerate(self.exchanges):
            self.finish(exchange)
            stats = exchange.stats or CommStats()
            out[f"{k}/due"] = torch.tensor(exchange.due, dtype=torch.int64)
            out[f"{k}/dropped"] = torch.tensor(exchange.dropped, dtype=torch.int64)
            # slice ids, under the key of checkpoints that carried whole modules (then the same ids)
            out[f"{k}/modules"] = torch.tensor(exchange.slices, dtype=torch.int64)
            out[f"{k}/bytes"] = torch.tensor([stats.bytes_sent, stats.bytes_received], dtype=torch.float64)
            for i, total in exchange.totals.items():
                if self.holder.writes(self.slices[i].module):
                    name = self.slices[i].name
                    out[f"{k}/{name}/meta"], out[f"{k}/{name}/values"] = total.meta, total.values
        return out

    def _load_exchanges(self, saved: SavedState) -> list[Exchange]:
        """The exchanges :meth:`_exchanges_state` wrote (on any number of ranks), finished, with the
        totals of the modules this rank holds."""
        stem, device = self.in_flight_part, self.holder.device
        files = saved.per_rank(stem)
        if not files:
            return []
        own = files.get(self.holder.rank, files[min(files)])
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
            for i in (i for i in slices if self.slices[i].module in self.holder.held):
                name = self.slices[i].name
                if f"{k}/{name}/meta" not in merged:
                    raise CheckpointError(f"{stem}: the outer gradient in flight lacks {name}")
                totals[i] = Payload(merged[f"{k}/{name}/meta"].to(device), merged[f"{k}/{name}/values"].to(device))
            due = tuple(int(v) for v in own[f"{k}/due"].tolist())
            sent, received = own[f"{k}/bytes"].tolist()
            exchanges.append(Exchange(totals, None, (due[0], due[1]), slices,
                                      tuple(int(p) for p in own[f"{k}/dropped"].tolist()),
                                      stats=CommStats(bytes_sent=sent, bytes_received=received)))
        return exchanges
