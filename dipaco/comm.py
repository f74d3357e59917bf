"""Per-module communication of outer-gradient sums among the ranks that hold a module.

DiPaCo (Douillard et al., arXiv 2403.10616, section 2.3) averages, for each module m, the changes
of only the paths that contain m. With paths spread over ranks, each rank computes the partial sums
of its own paths (:meth:`dipaco.outer.OuterOptimizer.local_sums`) and :class:`OuterComm` adds them
up across the ranks holding m, so every holder applies the identical DiLoCo Nesterov step
(Douillard et al., arXiv 2311.08105) and the replicas of m stay bit-identical.

* **Groups.** One process group per distinct set of ranks holding a module; modules with the same
  holders share it (:func:`plan_groups`). Groups are created in the same (sorted) order on every
  rank, as ``torch.distributed.new_group`` requires. A module held by one rank is not communicated.
* **One buffer per group per round**: the [weight, count] of every module of the group, then every
  module's payload, so a round costs one collective per group.
* **fp32** (``dist.comm_dtype=fp32``): ring all-reduce (SUM) of the raw sums. The result differs
  from a single process only by the order of the fp32 additions (see README, Multi-worker training).
* **bf16 / fp16 / int8**, never summed in the low-precision type (a ring all-reduce in bf16/fp16
  rounds every partial sum to 8/11 mantissa bits; int8 would overflow or need re-quantization at
  every hop). Streaming DiLoCo (arXiv 2501.18512) likewise sends low-precision outer gradients and
  accumulates in fp32.

  - groups of 2 ranks: every rank encodes its payload, the group all-gathers the encoded bytes, and
    every rank decodes and adds the contributions in fp32 in rank order: the same bits on every
    holder, and no error beyond each rank's own encoding. An all-gather sends (n-1) B per rank,
    which equals the 2 (n-1)/n B of a ring all-reduce for n = 2 only;
  - groups of 3 or more: a reduce-scatter then an all-gather, both on encoded bytes. The flat payload
    is cut into n slices; an all-to-all sends slice j of every rank to group rank j, which decodes and
    adds them in fp32 in rank order, re-encodes the sum and all-gathers it. Per rank that is
    2 (n-1)/n B of encoded bytes, like a ring all-reduce, so int8 stays ~4x cheaper than fp32 for any
    n. The re-encoding error of slice j is carried by its owner's error feedback, and every holder
    decodes the same gathered bytes: identical results.
  The payload of module m is its local weighted delta divided by c_m = sum of w_p over every path
  through m (a constant every rank knows), so it has the scale of a parameter change (fp16 does
  not overflow on token-count weights). Weights and counts always travel in fp32, exactly.
* **int8**: per-chunk absmax scales (``dist.chunk_size`` elements per fp32 scale):
  q = round(x / s), s = absmax / 127, so |x - q s| <= absmax / 254 per element.
* **Error feedback** (``dist.error_feedback``, lossy types only): the quantization residual of each
  module's local payload is added to the next round's payload (Seide et al. 2014, "1-bit SGD";
  Karimireddy et al. 2019, arXiv 1901.09847), so the error does not accumulate over rounds. The
  residuals are per rank and are checkpointed (:meth:`OuterComm.state_dict`). A round in which no
  holder contributed to the module (all dropped) keeps the old residual, since nothing is applied.
* **Byte accounting** (:class:`CommStats`), per rank, with the bandwidth-optimal ring algorithms
  (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005) for a buffer of B bytes on n ranks:
  ring all-reduce sends 2 (n-1)/n B and receives 2 (n-1)/n B (reduce-scatter, then all-gather);
  ring all-gather sends (n-1) B and receives (n-1) B (each rank forwards the n-1 other blocks);
  all-to-all of n blocks of B/n sends and receives (n-1)/n B.
  The DDP baseline (:func:`ddp_bytes`) is data-parallel training of one path-sized model on all W
  ranks for the same inner steps: one fp32 ring all-reduce of every parameter's gradient per step.
* **Replica check** (``dist.check_replicas``): after the step, the holders of each module all-gather
  a sha256-based checksum of its parameters and momentum and raise on any difference.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dipaco.bank import ModuleBank
from dipaco.config import DistConfig
from dipaco.distributed import World
from dipaco.errors import CheckpointError, DistributedError
from dipaco.outer import OuterOptimizer, PartSums
from dipaco.topology import Topology

LOSSY = ("bf16", "fp16", "int8")
_TORCH_16 = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --- which ranks talk about which module ------------------------------------------------------------
@dataclass(frozen=True)
class CommGroup:
    """Ranks that all hold every one of ``modules`` (global module ids, ascending)."""

    ranks: tuple[int, ...]
    modules: tuple[int, ...]


def module_ranks(topology: Topology, owners: Mapping[int, int]) -> dict[int, tuple[int, ...]]:
    """Module id -> ranks holding a path through it (``owners``: path id -> rank), ascending."""
    return {
        m.id: tuple(sorted({owners[p] for p in topology.paths_through(m.id)})) for m in topology.modules
    }


def plan_groups(topology: Topology, owners: Mapping[int, int]) -> list[CommGroup]:
    """Groups of two or more ranks, one per distinct rank set, in the same order on every rank."""
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for module, ranks in module_ranks(topology, owners).items():
        if len(ranks) >= 2:
            by_ranks.setdefault(ranks, []).append(module)
    return [CommGroup(ranks, tuple(sorted(mods))) for ranks, mods in sorted(by_ranks.items())]


# --- cost models -----------------------------------------------------------------------------------
def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_allgather_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-gather of ``nbytes`` per rank over ``n`` ranks."""
    return float((n - 1) * nbytes)


def ddp_bytes(path_numel: int, steps: int, world_size: int) -> float:
    """What DDP sends per rank: one fp32 gradient all-reduce of a path-sized model per inner step."""
    return steps * ring_allreduce_bytes(4.0 * path_numel, world_size)


# --- encodings -------------------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk absmax int8: returns (q int8 of x's numel, fp32 scale per chunk); |x - q s| <= s / 2."""
    n = x.numel()
    padded = F.pad(x.reshape(-1).float(), (0, (-n) % chunk)).view(-1, chunk)
    scale = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n].contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    n = q.numel()
    padded = F.pad(q.float(), (0, (-n) % chunk)).view(-1, chunk)
    return (padded * scale.unsqueeze(1)).view(-1)[:n]


def num_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


@dataclass(frozen=True)
class _Layout:
    """Byte layout of a group's lossy buffer: fp32 meta, fp32 int8 scales, payloads, padding to 4."""

    numels: tuple[int, ...]
    scales: tuple[tuple[int, int], ...]  # (start, end) byte ranges
    payloads: tuple[tuple[int, int], ...]
    nbytes: int

    @classmethod
    def build(cls, numels: tuple[int, ...], dtype: str, chunk: int) -> "_Layout":
        offset = 8 * len(numels)  # (weight, count) per module, fp32
        scales = []
        for n in numels:
            width = 4 * num_chunks(n, chunk) if dtype == "int8" else 0
            scales.append((offset, offset + width))
            offset += width
        payloads = []
        for n in numels:
            width = n * (1 if dtype == "int8" else 2)
            payloads.append((offset, offset + width))
            offset += width
        return cls(numels, tuple(scales), tuple(payloads), offset + (-offset) % 4)

    def module_bytes(self, j: int) -> int:
        return 8 + (self.scales[j][1] - self.scales[j][0]) + (self.payloads[j][1] - self.payloads[j][0])


def _all_gather(inp: torch.Tensor, n: int, group) -> torch.Tensor:
    """(n, *inp.shape): every member's ``inp``, in group-rank order (= ascending global rank)."""
    out = torch.empty(n * inp.numel(), dtype=inp.dtype, device=inp.device)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name is deprecated
    fn(out, inp.reshape(-1), group=group)
    return out.view(n, *inp.shape)


def checksum(*tensors: torch.Tensor | None) -> int:
    """A signed 64-bit digest (the first 8 bytes of sha256) of the tensors' bytes."""
    digest = hashlib.sha256()
    for t in tensors:
        if t is not None:
            digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        digest.update(b"|")
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


# --- accounting ------------------------------------------------------------------------------------
@dataclass
class CommStats:
    """Bytes this rank sent and received in one round, in total and per module (by name)."""

    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    check_bytes: float = 0.0  # the replica check's all-gathers (debug mode), not in the totals
    modules: dict[str, dict] = field(default_factory=dict)

    def add(self, name: str, ranks: tuple[int, ...], sent: float, received: float) -> None:
        self.modules[name] = {"ranks": list(ranks), "bytes_sent": sent, "bytes_received": received}


# --- the communicator ------------------------------------------------------------------------------
class OuterComm:
    """Reduces each round's :class:`PartSums` over the ranks holding each module, in place."""

    def __init__(
        self,
        topology: Topology,
        bank: ModuleBank,
        owners: Mapping[int, int],
        weights: Mapping[int, float],
        cfg: DistConfig,
        world: World,
        two_phase_from: int = 3,
    ) -> None:
        """``two_phase_from``: group size from which lossy types use reduce-scatter + all-gather."""
        self.topology, self.bank, self.cfg, self.world = topology, bank, cfg, world
        self.two_phase_from = two_phase_from
        self.groups = plan_groups(topology, owners)
        self.mine: list[tuple[CommGroup, object]] = []
        for group in self.groups:  # every rank creates every group, in the same order
            if len(group.ranks) == world.size:
                handle = None  # the default (world) group
            else:
                with world.collective(f"new_group({list(group.ranks)})"):
                    handle = dist.new_group(list(group.ranks), timeout=timedelta(seconds=cfg.timeout_s))
            if world.rank in group.ranks:
                self.mine.append((group, handle))
        # c_m: total weight of every path through m; lossy payloads are divided by it.
        self.norm = {m: float(sum(weights[p] for p in topology.paths_through(m)))
                     for group, _ in self.mine for m in group.modules}
        self.lossy = cfg.comm_dtype in LOSSY
        self.feedback = self.lossy and cfg.error_feedback
        self.residual: dict[int, torch.Tensor] = {}  # module id -> carried quantization error

    def name(self, module_id: int) -> str:
        return self.topology.modules[module_id].name

    def _rows(self, group: CommGroup, sums: Mapping[str, PartSums]) -> list[tuple[PartSums, int]]:
        rows = []
        for m in group.modules:
            module = self.topology.modules[m]
            part_sums = sums[module.part.name]
            row = part_sums.row(module.index)
            if row is None:
                raise DistributedError(f"rank {self.world.rank}: no local sums for {module.name}, which it holds")
            rows.append((part_sums, row))
        return rows

    def _what(self, verb: str, group: CommGroup) -> str:
        names = [self.name(m) for m in group.modules]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        return f"{verb} of modules {shown} among ranks {list(group.ranks)}"

    @torch.no_grad()
    def reduce(self, sums: Mapping[str, PartSums]) -> CommStats:
        """Replaces this rank's partial sums of every communicated module by the sums over its holders."""
        stats = CommStats()
        for group, handle in self.mine:
            rows = self._rows(group, sums)
            if self.lossy and len(group.ranks) >= self.two_phase_from:
                self._two_phase_lossy(group, handle, rows, stats)
            elif self.lossy:
                self._gather_lossy(group, handle, rows, stats)
            else:
                self._all_reduce_fp32(group, handle, rows, stats)
        return stats

    def _all_reduce_fp32(self, group: CommGroup, handle, rows, stats: CommStats) -> None:
        n, k = len(group.ranks), len(rows)
        meta = torch.stack([torch.stack((s.weight[r], s.count[r])) for s, r in rows]).reshape(-1)
        buf = torch.cat([meta, *[s.weighted_delta[r] for s, r in rows]]).to(self.world.comm_device)
        with self.world.collective(self._what("all-reduce", group)):
            dist.all_reduce(buf, group=handle)
        buf = buf.to(self.bank.device)
        offset = 2 * k
        for j, (s, r) in enumerate(rows):
            s.weight[r], s.count[r] = buf[2 * j], buf[2 * j + 1]
            numel = s.weighted_delta.shape[1]
            s.weighted_delta[r].copy_(buf[offset : offset + numel])
            offset += numel
            per_module = ring_allreduce_bytes(4 * (numel + 2), n)
            stats.add(self.name(group.modules[j]), group.ranks, per_module, per_module)
        total = ring_allreduce_bytes(4 * buf.numel(), n)
        stats.bytes_sent += total
        stats.bytes_received += total

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale bytes, payload bytes, what the receivers will decode) of one module's payload."""
        if self.cfg.comm_dtype == "int8":
            q, scale = quantize_int8(x, self.cfg.chunk_size)
            return scale.view(torch.uint8), q.view(torch.uint8), dequantize_int8(q, scale, self.cfg.chunk_size)
        low = x.to(_TORCH_16[self.cfg.comm_dtype])
        return torch.empty(0, dtype=torch.uint8, device=x.device), low.view(torch.uint8), low.float()

    def _decode(self, row: torch.Tensor, layout: _Layout, j: int) -> torch.Tensor:
        return self._decode_at(row, layout.scales[j], layout.payloads[j])

    def _decode_at(self, row: torch.Tensor, scales: tuple[int, int], payload: tuple[int, int]) -> torch.Tensor:
        (s0, s1), (p0, p1) = scales, payload
        if self.cfg.comm_dtype == "int8":
            return dequantize_int8(row[p0:p1].view(torch.int8), row[s0:s1].view(torch.float32), self.cfg.chunk_size)
        return row[p0:p1].view(_TORCH_16[self.cfg.comm_dtype]).float()

    def _gather_lossy(self, group: CommGroup, handle, rows, stats: CommStats) -> None:
        n, k = len(group.ranks), len(rows)
        numels = tuple(s.weighted_delta.shape[1] for s, _ in rows)
        layout = _Layout.build(numels, self.cfg.comm_dtype, self.cfg.chunk_size)
        meta = torch.stack([torch.stack((s.weight[r], s.count[r])) for s, r in rows]).reshape(-1)
        scales, payloads, carried = [], [], {}
        for m, x in zip(group.modules, torch.split(self._payload(group, rows), list(layout.numels))):
            scale_bytes, payload_bytes, decoded = self._encode(x)
            scales.append(scale_bytes)
            payloads.append(payload_bytes)
            if self.feedback:
                carried[m] = x - decoded
        pad = torch.zeros(layout.nbytes - 8 * k - sum(t.numel() for t in scales + payloads), dtype=torch.uint8,
                          device=meta.device)
        mine = torch.cat([meta.view(torch.uint8), *scales, *payloads, pad]).to(self.world.comm_device)
        with self.world.collective(self._what("all-gather", group)):
            gathered = _all_gather(mine, n, handle)
        gathered = gathered.to(self.bank.device)
        # Every holder sums the same bytes in the same (rank) order, in fp32: identical results.
        meta_sum = torch.zeros(k, 2, device=self.bank.device)
        totals = [torch.zeros(numel, device=self.bank.device) for numel in layout.numels]
        for i in range(n):
            row = gathered[i]
            meta_sum += row[: 8 * k].view(torch.float32).view(k, 2)
            for j in range(k):
                totals[j] += self._decode(row, layout, j)
        for j, (m, (s, r)) in enumerate(zip(group.modules, rows)):
            s.weight[r], s.count[r] = meta_sum[j, 0], meta_sum[j, 1]
            s.weighted_delta[r].copy_(totals[j] * self.norm[m])
            if self.feedback and meta_sum[j, 0] > 0:  # nothing is applied when nobody contributed
                self.residual[m] = carried[m]
            per_module = ring_allgather_bytes(layout.module_bytes(j), n)
            stats.add(self.name(m), group.ranks, per_module, per_module)
        total = ring_allgather_bytes(layout.nbytes, n)
        stats.bytes_sent += total
        stats.bytes_received += total

    def _payload(self, group: CommGroup, rows) -> torch.Tensor:
        """The flat local payload of a group: weighted deltas / c_m, plus carried residuals."""
        xs = []
        for m, (s, r) in zip(group.modules, rows):
            x = s.weighted_delta[r] / self.norm[m]
            if self.feedback and m in self.residual:
                x = x + self.residual[m]
            xs.append(x)
        return torch.cat(xs)

    def _two_phase_lossy(self, group: CommGroup, handle, rows, stats: CommStats) -> None:
        n, k, me = len(group.ranks), len(rows), group.ranks.index(self.world.rank)
        numels = [s.weighted_delta.shape[1] for s, _ in rows]
        step = self.cfg.chunk_size if self.cfg.comm_dtype == "int8" else 1
        # every module starts on a chunk boundary, so a chunk's scale never mixes two modules
        spans = [-(-numel // step) * step for numel in numels]
        starts = [sum(spans[:j]) for j in range(k)]
        total = sum(spans)
        meta = torch.stack([torch.stack((s.weight[r], s.count[r])) for s, r in rows]).reshape(-1)
        x = torch.cat([F.pad(xj, (0, span - xj.numel()))
                       for xj, span in zip(torch.split(self._payload(group, rows), numels), spans)])
        per_rank = -(-total // n)
        length = -(-per_rank // step) * step  # slice length: ceil(total / n), rounded up to whole chunks
        slices = F.pad(x, (0, n * length - total)).view(n, length)
        scale_w = 4 * (length // step) if self.cfg.comm_dtype == "int8" else 0
        payload_w = length * (1 if self.cfg.comm_dtype == "int8" else 2)
        body = scale_w + payload_w
        pad = (-(8 * k + body)) % 4
        sent_slice = 8 * k + body + pad  # every slice carries the rank's (weight, count) rows too
        out, decoded = [], []
        for j in range(n):
            scale_bytes, payload_bytes, dec = self._encode(slices[j])
            zeros = torch.zeros(pad, dtype=torch.uint8, device=x.device)
            out += [meta.view(torch.uint8), scale_bytes, payload_bytes, zeros]
            decoded.append(dec)
        carried = x - torch.cat(decoded)[:total] if self.feedback else None
        send = torch.cat(out).to(self.world.comm_device)
        recv = torch.empty_like(send)
        with self.world.collective(self._what("reduce-scatter (all-to-all)", group)):
            dist.all_to_all_single(recv, send, group=handle)
        recv = recv.to(self.bank.device).view(n, sent_slice)
        meta_sum = torch.zeros(k, 2, device=self.bank.device)
        own = torch.zeros(length, device=self.bank.device)
        scales, payload = (8 * k, 8 * k + scale_w), (8 * k + scale_w, 8 * k + body)
        for i in range(n):  # rank order: the same sum wherever it is computed
            meta_sum += recv[i, : 8 * k].view(torch.float32).view(k, 2)
            own += self._decode_at(recv[i], scales, payload)
        scale_bytes, payload_bytes, dec = self._encode(own)
        if self.feedback:  # the owner carries the re-encoding error of its slice
            lo, hi = me * length, min((me + 1) * length, total)
            if hi > lo:
                carried[lo:hi] += (own - dec)[: hi - lo]
        mine = torch.cat([scale_bytes, payload_bytes, torch.zeros((-body) % 4, dtype=torch.uint8, device=own.device)])
        with self.world.collective(self._what("all-gather", group)):
            gathered = _all_gather(mine.to(self.world.comm_device), n, handle).to(self.bank.device)
        full = torch.cat([self._decode_at(gathered[j], (0, scale_w), (scale_w, body)) for j in range(n)])[:total]
        sent = (n - 1) * sent_slice + ring_allgather_bytes(mine.numel(), n)
        for j, (m, (s, r)) in enumerate(zip(group.modules, rows)):
            lo, hi = starts[j], starts[j] + numels[j]
            s.weight[r], s.count[r] = meta_sum[j, 0], meta_sum[j, 1]
            s.weighted_delta[r].copy_(full[lo:hi] * self.norm[m])
            if self.feedback and meta_sum[j, 0] > 0:  # nothing is applied when nobody contributed
                self.residual[m] = carried[lo:hi].clone()
            share = sent * spans[j] / total  # by the module's share of the payload
            stats.add(self.name(m), group.ranks, share, share)
        stats.bytes_sent += sent
        stats.bytes_received += sent

    # --- debug: replicas must stay identical ---------------------------------------------------
    @torch.no_grad()
    def check_replicas(self, outer: OuterOptimizer, stats: CommStats | None = None) -> None:
        """All-gathers a checksum of every communicated module (parameters + momentum) among its holders."""
        momentum = outer.state_dict()
        for group, handle in self.mine:
            n = len(group.ranks)
            mine = torch.tensor(
                [checksum(self.bank.params[m], momentum.get(self.name(m))) for m in group.modules],
                dtype=torch.int64, device=self.world.comm_device,
            )
            with self.world.collective(self._what("replica check", group)):
                gathered = _all_gather(mine, n, handle)
            if stats is not None:
                stats.check_bytes += ring_allgather_bytes(8 * mine.numel(), n)
            for j, m in enumerate(group.modules):
                column = gathered[:, j].tolist()
                if len(set(column)) > 1:
                    detail = ", ".join(f"rank {r}: {v & (2**64 - 1):016x}" for r, v in zip(group.ranks, column))
                    raise DistributedError(
                        f"dist.check_replicas: module {self.name(m)} diverged between its holders, ranks "
                        f"{list(group.ranks)} ({detail})"
                    )

    # --- error-feedback state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals, by module name (empty unless a lossy type is used)."""
        return {self.name(m): r for m, r in sorted(self.residual.items())}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ids = {self.name(m): m for group, _ in self.mine for m in group.modules}
        unknown = sorted(set(state) - set(ids))
        if unknown:
            raise CheckpointError(f"error-feedback residuals for modules this rank does not communicate: {unknown[:3]}")
        self.residual = {}
        for name, value in state.items():
            expected = self.bank.numel(self.topology.modules[ids[name]].part)
            if value.numel() != expected:
                raise CheckpointError(
                    f"error-feedback residual of {name}: {value.numel()} elements, expected {expected}"
                )
            self.residual[ids[name]] = value.to(self.bank.device, torch.float32).clone()

    def lowest_holder(self, module_id: int) -> bool:
        """Whether this rank is the lowest rank holding the module (and so writes its state)."""
        for group, _ in self.mine:
            if module_id in group.modules:
                return group.ranks[0] == self.world.rank
        return self.bank.holds(module_id)  # held by this rank alone
