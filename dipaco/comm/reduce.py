"""The transport: sums per-module payloads over the ranks holding each module.

It knows nothing of the algorithm that uses it. Its "modules" are the ids its groups list: the
outer syncs pass slices of the bank's modules (:mod:`dipaco.sync.slices`; whole modules, or K-block
pieces of them under ``outer.streaming.fragment=blocks:K``, named ``module[start:stop]``), and the
error feedback and adaptive codecs that wrap it keep their state per such id. A payload is, per
module, a few exact fp32 ``meta`` values (summed in fp32, never encoded) and a flat fp32 vector (sent through a
:class:`~dipaco.comm.codecs.Codec`). :meth:`Transport.start` issues the collectives as
asynchronous torch.distributed work and returns a :class:`Reduction`; :meth:`Reduction.wait`
completes them, so a caller can overlap communication with computation.

* **Groups**: one process group per distinct set of holders (:mod:`dipaco.comm.groups`), created
  in the same order on every rank, as ``torch.distributed.new_group`` requires. One buffer per
  group per sync, so a sync costs one collective (two for the two-phase scheme) per group.
* **Lossless (fp32)**: a ring all-reduce (SUM) of the raw values. The result differs from a single
  process only by the order of the fp32 additions.
* **Lossy codecs**, never summed in the low-precision type:

  - groups smaller than ``two_phase_from`` (2 ranks by default): every rank encodes its payload,
    the group all-gathers the encoded bytes, and every rank decodes and adds the contributions in
    fp32 in rank order: the same bits on every holder, and no error beyond each rank's own
    encoding. An all-gather sends (n-1) B per rank, equal to a ring all-reduce's 2 (n-1)/n B for
    n = 2 only;
  - larger groups: a reduce-scatter then an all-gather, both on encoded bytes. The flat payload is
    cut into n slices; an all-to-all sends slice j of every rank to group rank j, which decodes and
    adds them in fp32 in rank order, re-encodes the sum and all-gathers it. Per rank that is
    2 (n-1)/n B of encoded bytes, like a ring all-reduce. Every holder decodes the same gathered
    bytes: identical results.

  With ``track_error`` the result carries, per module, what this rank's contribution lost: its own
  encoding error plus, for the slice it owns in the two-phase scheme, the re-encoding error of the
  sum (:class:`dipaco.comm.feedback.ErrorFeedback` carries it into the next sync).
* **Replica check** (:meth:`Transport.check_identical`): holders all-gather a sha256-based checksum
  of each module's tensors and raise on any difference.

A :class:`Transport` and the layers that wrap it (:class:`~dipaco.comm.feedback.ErrorFeedback`,
:class:`~dipaco.comm.adaptive.AdaptiveCodecs`, both :class:`TransportWrapper`) share one interface,
:class:`Reducer`; the layers that take a codec per call are :class:`CodecReducer`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dipaco.comm.accounting import CommStats, ring_allgather_bytes, ring_allreduce_bytes
from dipaco.comm.codecs import Codec
from dipaco.comm.groups import CommGroup
from dipaco.comm.world import World
from dipaco.errors import DistributedError


@dataclass
class Payload:
    """One module's contribution: exact ``meta`` values and a flat fp32 vector."""

    meta: torch.Tensor  # (width,) fp32, the same width for every module
    values: torch.Tensor  # (numel,) fp32


@dataclass
class Reduced:
    """The sums over each communicated module's holders (modules in no group are absent)."""

    payloads: dict[int, Payload]
    stats: CommStats
    errors: dict[int, torch.Tensor] = field(default_factory=dict)  # with track_error: what this rank lost


class PendingReduction(Protocol):
    """A reduction in flight (a :class:`Reduction`, or a layer's around it)."""

    def wait(self) -> Reduced:
        """Finishes it (idempotent) and returns the sums."""
        ...


class Reducer(Protocol):
    """What sums payloads over each module's holders: a :class:`Transport`, or a layer wrapping one."""

    @property
    def modules(self) -> tuple[int, ...]:
        """The modules this rank communicates."""
        ...

    @property
    def mine(self) -> list[tuple[CommGroup, object]]:
        """This rank's groups and their process-group handles."""
        ...

    @property
    def names(self) -> Mapping[int, str]: ...

    def start(self, payloads: Mapping[int, Payload], *, only: Collection[int] | None = None) -> PendingReduction:
        """Issues the collectives (see :meth:`Transport.start`)."""
        ...

    def check_identical(self, tensors: Mapping[int, tuple[torch.Tensor | None, ...]],
                        stats: CommStats | None = None) -> None: ...


class CodecReducer(Reducer, Protocol):
    """A :class:`Reducer` whose codec a call may override (a :class:`Transport`, or error feedback over one)."""

    def start(self, payloads: Mapping[int, Payload], *, codec: Codec | None = None,
              only: Collection[int] | None = None) -> PendingReduction: ...


class Reduction:
    """Collectives in flight; :meth:`wait` finishes them (idempotent)."""

    def __init__(self, steps: list[Callable[[], None]], result: Reduced) -> None:
        self._steps, self._result = steps, result

    def wait(self) -> Reduced:
        steps, self._steps = self._steps, []
        for step in steps:
            step()
        return self._result


def _all_gather(inp: torch.Tensor, n: int, group, async_op: bool = False):
    """(n, *inp.shape): every member's ``inp``, in group-rank order (= ascending global rank)."""
    out = torch.empty(n * inp.numel(), dtype=inp.dtype, device=inp.device)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name is deprecated
    work = fn(out, inp.reshape(-1), group=group, async_op=async_op)
    return out.view(n, *inp.shape), work


def checksum(*tensors: torch.Tensor | None) -> int:
    """A signed 64-bit digest (the first 8 bytes of sha256) of the tensors' bytes."""
    digest = hashlib.sha256()
    for t in tensors:
        if t is not None:
            digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        digest.update(b"|")
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class _Layout:
    """Byte layout of a group's gathered buffer: fp32 meta, codec scales, payloads, padding to 4."""

    numels: tuple[int, ...]
    scales: tuple[tuple[int, int], ...]  # (start, end) byte ranges
    payloads: tuple[tuple[int, int], ...]
    nbytes: int
    meta_bytes: int

    @classmethod
    def build(cls, numels: tuple[int, ...], codec: Codec, meta_width: int) -> _Layout:
        meta_bytes = offset = 4 * meta_width * len(numels)
        scales = []
        for n in numels:
            scales.append((offset, offset + codec.scale_bytes(n)))
            offset = scales[-1][1]
        payloads = []
        for n in numels:
            payloads.append((offset, offset + codec.payload_bytes(n)))
            offset = payloads[-1][1]
        return cls(numels, tuple(scales), tuple(payloads), offset + (-offset) % 4, meta_bytes)

    def module_bytes(self, j: int) -> int:
        (s0, s1), (p0, p1) = self.scales[j], self.payloads[j]
        return self.meta_bytes // len(self.numels) + (s1 - s0) + (p1 - p0)


class Transport:
    """Sums payloads over each module's holders. ``two_phase_from``: the group size from which lossy
    codecs use reduce-scatter + all-gather instead of one all-gather."""

    def __init__(self, groups: list[CommGroup], world: World, codec: Codec, names: Mapping[int, str],
                 timeout_s: float, two_phase_from: int = 3) -> None:
        self.world, self.codec, self.names, self.two_phase_from = world, codec, names, two_phase_from
        self.mine: list[tuple[CommGroup, object]] = []
        for group in groups:  # every rank creates every group, in the same order
            if len(group.ranks) == world.size:
                handle = None  # the default (world) group
            else:
                with world.collective(f"new_group({list(group.ranks)})"):
                    handle = dist.new_group(list(group.ranks), timeout=timedelta(seconds=timeout_s))
                world.groups.append(handle)
            if world.rank in group.ranks:
                self.mine.append((group, handle))

    @property
    def modules(self) -> tuple[int, ...]:
        """The modules this rank communicates."""
        return tuple(m for group, _ in self.mine for m in group.modules)

    def _what(self, verb: str, group: CommGroup) -> str:
        names = [self.names[m] for m in group.modules]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"{verb} of modules {shown} among ranks {list(group.ranks)}"

    def _wait(self, work, what: str) -> None:
        with self.world.collective(what):
            work.wait()

    @torch.no_grad()
    def start(self, payloads: Mapping[int, Payload], track_error: bool = False, codec: Codec | None = None,
              only: Collection[int] | None = None) -> Reduction:
        """Issues the collectives of every group of this rank.

        ``payloads`` must hold each module of those groups, or of ``only`` when given: a sync that
        reduces some modules at a time (a fragment) names them, and every holder must name the same
        ones. ``codec`` overrides the transport's codec for this call (per-module codec choices are
        one call per codec, in the same order on every rank). Groups with no module to reduce are
        skipped.
        """
        codec = codec or self.codec
        wanted = None if only is None else set(only)
        result = Reduced({}, CommStats())
        steps = []
        for group, handle in self.mine:
            modules = tuple(m for m in group.modules if wanted is None or m in wanted)
            if not modules:
                continue
            missing = [self.names[m] for m in modules if m not in payloads]
            if missing:
                raise DistributedError(f"rank {self.world.rank}: no local payload for {missing[:3]}, which it holds")
            part = CommGroup(group.ranks, modules)
            rows = [payloads[m] for m in modules]
            if not codec.lossy:
                steps.append(self._all_reduce(part, handle, rows, result))
            elif len(group.ranks) >= self.two_phase_from:
                steps.append(self._two_phase(part, handle, rows, result, track_error, codec))
            else:
                steps.append(self._gather(part, handle, rows, result, track_error, codec))
        return Reduction(steps, result)

    def reduce(self, payloads: Mapping[int, Payload], track_error: bool = False, codec: Codec | None = None,
               only: Collection[int] | None = None) -> Reduced:
        return self.start(payloads, track_error, codec, only).wait()

    # --- lossless: ring all-reduce ---------------------------------------------------------------
    def _all_reduce(self, group: CommGroup, handle, rows: list[Payload], result: Reduced) -> Callable[[], None]:
        n, k = len(group.ranks), len(rows)
        width = rows[0].meta.numel()
        meta = torch.stack([p.meta for p in rows]).reshape(-1)
        device = meta.device
        buf = torch.cat([meta, *[p.values for p in rows]]).to(self.world.comm_device)
        what = self._what("all-reduce", group)
        with self.world.collective(what):
            work = dist.all_reduce(buf, group=handle, async_op=True)

        def finish() -> None:
            self._wait(work, what)
            out = buf.to(device)
            offset = width * k
            for j, (m, p) in enumerate(zip(group.modules, rows)):
                numel = p.values.numel()
                result.payloads[m] = Payload(out[width * j: width * (j + 1)], out[offset: offset + numel])
                offset += numel
                per_module = ring_allreduce_bytes(4 * (numel + width), n)
                result.stats.add(self.names[m], group.ranks, per_module, per_module)
            total = ring_allreduce_bytes(4 * buf.numel(), n)
            result.stats.bytes_sent += total
            result.stats.bytes_received += total

        return finish

    # --- lossy, small groups: all-gather of encoded payloads -------------------------------------
    def _gather(self, group: CommGroup, handle, rows: list[Payload], result: Reduced,
                track_error: bool, codec: Codec) -> Callable[[], None]:
        n, k = len(group.ranks), len(rows)
        width = rows[0].meta.numel()
        numels = tuple(p.values.numel() for p in rows)
        layout = _Layout.build(numels, codec, width)
        meta = torch.stack([p.meta for p in rows]).reshape(-1)
        device = meta.device
        scales, payloads = [], []
        for m, p in zip(group.modules, rows):
            encoded = codec.encode(p.values)
            scales.append(encoded.scale)
            payloads.append(encoded.payload)
            if track_error:
                result.errors[m] = p.values - encoded.decoded
        pad = torch.zeros(layout.nbytes - layout.meta_bytes - sum(t.numel() for t in scales + payloads),
                          dtype=torch.uint8, device=device)
        mine = torch.cat([meta.view(torch.uint8), *scales, *payloads, pad]).to(self.world.comm_device)
        what = self._what("all-gather", group)
        with self.world.collective(what):
            gathered, work = _all_gather(mine, n, handle, async_op=True)

        def finish() -> None:
            self._wait(work, what)
            rows_in = gathered.to(device)
            # Every holder sums the same bytes in the same (rank) order, in fp32: identical results.
            meta_sum = torch.zeros(k, width, device=device)
            totals = [torch.zeros(numel, device=device) for numel in numels]
            for i in range(n):
                row = rows_in[i]
                meta_sum += row[: layout.meta_bytes].view(torch.float32).view(k, width)
                for j in range(k):
                    (s0, s1), (p0, p1) = layout.scales[j], layout.payloads[j]
                    totals[j] += codec.decode(row[s0:s1], row[p0:p1], numels[j])
            for j, m in enumerate(group.modules):
                result.payloads[m] = Payload(meta_sum[j], totals[j])
                per_module = ring_allgather_bytes(layout.module_bytes(j), n)
                result.stats.add(self.names[m], group.ranks, per_module, per_module)
            total = ring_allgather_bytes(layout.nbytes, n)
            result.stats.bytes_sent += total
            result.stats.bytes_received += total

        return finish

    # --- lossy, larger groups: reduce-scatter (all-to-all) + all-gather of encoded bytes ---------
    def _two_phase(self, group: CommGroup, handle, rows: list[Payload], result: Reduced,
                   track_error: bool, codec: Codec) -> Callable[[], None]:
        n, k, me = len(group.ranks), len(rows), group.ranks.index(self.world.rank)
        width = rows[0].meta.numel()
        numels = [p.values.numel() for p in rows]
        step = codec.block
        # every module starts on a block boundary, so a scale chunk never mixes two modules
        spans = [-(-numel // step) * step for numel in numels]
        starts = [sum(spans[:j]) for j in range(k)]
        total = sum(spans)
        meta = torch.stack([p.meta for p in rows]).reshape(-1)
        device = meta.device
        x = torch.cat([F.pad(p.values, (0, span - p.values.numel())) for p, span in zip(rows, spans)])
        per_rank = -(-total // n)
        length = -(-per_rank // step) * step  # slice length: ceil(total / n), rounded up to whole blocks
        slices = F.pad(x, (0, n * length - total)).view(n, length)
        scale_w, payload_w = codec.scale_bytes(length), codec.payload_bytes(length)
        body = scale_w + payload_w
        meta_bytes = 4 * width * k
        pad = (-(meta_bytes + body)) % 4
        sent_slice = meta_bytes + body + pad  # every slice carries the rank's meta rows too
        out, decoded = [], []
        for j in range(n):
            encoded = codec.encode(slices[j])
            out += [meta.view(torch.uint8), encoded.scale, encoded.payload,
                    torch.zeros(pad, dtype=torch.uint8, device=device)]
            decoded.append(encoded.decoded)
        carried = x - torch.cat(decoded)[:total] if track_error else None
        send = torch.cat(out).to(self.world.comm_device)
        recv = torch.empty_like(send)
        what = self._what("reduce-scatter (all-to-all)", group)
        with self.world.collective(what):
            work = dist.all_to_all_single(recv, send, group=handle, async_op=True)

        def finish() -> None:
            self._wait(work, what)
            got = recv.to(device).view(n, sent_slice)
            meta_sum = torch.zeros(k, width, device=device)
            own = torch.zeros(length, device=device)
            for i in range(n):  # rank order: the same sum wherever it is computed
                meta_sum += got[i, :meta_bytes].view(torch.float32).view(k, width)
                own += codec.decode(got[i, meta_bytes: meta_bytes + scale_w], got[i, meta_bytes + scale_w: meta_bytes + body],
                                    length)
            encoded = codec.encode(own)
            if carried is not None:  # the owner carries the re-encoding error of its slice
                lo, hi = me * length, min((me + 1) * length, total)
                if hi > lo:
                    carried[lo:hi] += (own - encoded.decoded)[: hi - lo]
            mine = torch.cat([encoded.scale, encoded.payload,
                              torch.zeros((-body) % 4, dtype=torch.uint8, device=device)])
            with self.world.collective(self._what("all-gather", group)):
                gathered, _ = _all_gather(mine.to(self.world.comm_device), n, handle)
            gathered = gathered.to(device)
            full = torch.cat([codec.decode(gathered[j, :scale_w], gathered[j, scale_w:body], length)
                              for j in range(n)])[:total]
            sent = (n - 1) * sent_slice + ring_allgather_bytes(mine.numel(), n)
            for j, m in enumerate(group.modules):
                lo, hi = starts[j], starts[j] + numels[j]
                result.payloads[m] = Payload(meta_sum[j], full[lo:hi])
                if carried is not None:
                    result.errors[m] = carried[lo:hi].clone()
                share = sent * spans[j] / total  # by the module's share of the payload
                result.stats.add(self.names[m], group.ranks, share, share)
            result.stats.bytes_sent += sent
            result.stats.bytes_received += sent

        return finish

    # --- debug: replicas must stay identical ---------------------------------------------------
    @torch.no_grad()
    def check_identical(self, tensors: Mapping[int, tuple[torch.Tensor | None, ...]], stats: CommStats | None = None) -> None:
        """All-gathers a checksum of each module's ``tensors`` among its holders; raises naming the
        module and ranks on any difference. Modules absent from ``tensors`` are not checked (every
        holder must give the same modules)."""
        for full, handle in self.mine:
            group = CommGroup(full.ranks, tuple(m for m in full.modules if m in tensors))
            if not group.modules:
                continue
            n = len(group.ranks)
            mine = torch.tensor([checksum(*tensors[m]) for m in group.modules], dtype=torch.int64,
                                device=self.world.comm_device)
            with self.world.collective(self._what("replica check", group)):
                gathered, _ = _all_gather(mine, n, handle)
            if stats is not None:
                stats.check_bytes += ring_allgather_bytes(8 * mine.numel(), n)
            for j, m in enumerate(group.modules):
                column = gathered[:, j].tolist()
                if len(set(column)) > 1:
                    detail = ", ".join(f"rank {r}: {v & (2**64 - 1):016x}" for r, v in zip(group.ranks, column))
                    raise DistributedError(
                        f"dist.check_replicas: module {self.names[m]} diverged between its holders, ranks "
                        f"{list(group.ranks)} ({detail})"
                    )


Inner = TypeVar("Inner", bound=CodecReducer)


class TransportWrapper(Generic[Inner]):
    """A transport that adds behaviour around another one (a :class:`Transport` or another wrapper)
    and passes the rest through: the modules it reduces, this rank's share, their names, and the
    replica check. Subclasses define ``start`` / ``reduce``."""

    def __init__(self, transport: Inner) -> None:
        self.transport = transport

    @property
    def modules(self) -> tuple[int, ...]:
        return self.transport.modules

    @property
    def mine(self) -> list[tuple[CommGroup, object]]:
        return self.transport.mine

    @property
    def names(self) -> Mapping[int, str]:
        return self.transport.names

    def check_identical(self, tensors: Mapping[int, tuple[torch.Tensor | None, ...]],
                        stats: CommStats | None = None) -> None:
        self.transport.check_identical(tensors, stats)

