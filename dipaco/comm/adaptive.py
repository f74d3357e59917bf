"""Adaptive compression: each module's codec is chosen from the statistics of its outer gradients.

DiLoCoX (arXiv 2506.21263) picks the compression of each outer gradient adaptively. dipaco's rule
(``dist.adaptive=true``), per communicated module m:

* the first sync of m uses ``dist.comm_dtype`` (which must then be lossy);
* after every sync, every holder measures, on m's *reduced* outer gradient g (the decoded sum every
  holder received, so the same bits everywhere), the relative error each candidate codec would
  make: e(c) = ||g - decode(encode_c(g))|| / ||g||. It is measured on at most
  ``dist.adaptive_sample_chunks`` whole chunks of g, evenly spaced (0: all of g). The codecs scale
  each chunk on its own, so a sampled chunk is encoded exactly as in a real sync; the sample is an
  estimate of e(c) over the module, and it bounds the rule's cost, which sits on the exchange's
  critical path (encoding every candidate over a whole module cost more than the exchange itself);
* the next sync of m uses the cheapest candidate with e(c) <= ``dist.adaptive_tolerance``; among
  candidates of the same size (int4 and fp4) the one with the smaller error; if none is within the
  tolerance, the most precise candidate (bf16).

Candidates, cheapest first: fp4 (E2M1) and int4 (4 bits + a fp32 scale per ``dist.chunk_size``
values), int8, bf16. The rule sees only what every holder has, so every holder chooses the same
codec and issues the same collectives; the choices are checkpointed (:meth:`state_dict`). Modules
with the same choice are reduced together (one :meth:`Transport.start` call per codec, in the fixed
candidate order on every rank). Error feedback, when on, wraps the transport underneath, so a
residual carries over a change of codec.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
import torch.nn.functional as F

from dipaco.comm.accounting import CommStats
from dipaco.comm.codecs import Codec, build_codec, num_chunks
from dipaco.comm.reduce import CodecReducer, Payload, PendingReduction, Reduced, TransportWrapper
from dipaco.errors import CheckpointError

CANDIDATES = ("fp4", "int4", "int8", "bf16")  # cheapest first


def sample_chunks(values: torch.Tensor, chunk: int, count: int) -> torch.Tensor:
    """``count`` whole chunks of ``values`` (flat), evenly spaced from the first to the last, the last one
    zero-padded; all of ``values`` when it has no more chunks than that or ``count`` is 0."""
    total = num_chunks(values.numel(), chunk)
    if count <= 0 or total <= count:
        return values
    picks = torch.linspace(0, total - 1, count, dtype=torch.float64).round().long().to(values.device)
    padded = F.pad(values.reshape(-1), (0, (-values.numel()) % chunk)).view(-1, chunk)
    return padded[picks].reshape(-1)


def relative_error(codec: Codec, values: torch.Tensor) -> float:
    """||g - decode(encode(g))|| / ||g|| (0 for a zero vector)."""
    norm = float(values.norm())
    if norm == 0.0:
        return 0.0
    return float((values - codec.encode(values).decoded).norm()) / norm


def choose(codecs: Sequence[Codec], values: torch.Tensor, tolerance: float, chunk: int = 1,
           sample: int = 0) -> tuple[int, list[float]]:
    """Index of the codec the rule picks for an outer gradient like ``values``, and every candidate's error
    (measured on ``sample`` chunks of ``chunk`` values, see :func:`sample_chunks`)."""
    values = sample_chunks(values, chunk, sample)
    errors = [relative_error(c, values) for c in codecs]
    sizes = sorted({c.payload_bytes(1024) for c in codecs})
    for size in sizes:  # cheapest size first; within a size, the smallest error
        same = [i for i, c in enumerate(codecs) if c.payload_bytes(1024) == size]
        best = min(same, key=lambda i: (errors[i], i))
        if errors[best] <= tolerance:
            return best, errors
    return max(range(len(codecs)), key=lambda i: (codecs[i].payload_bytes(1024), -i)), errors


class _AdaptiveReduction:
    def __init__(self, handles: list[PendingReduction], owner: AdaptiveCodecs) -> None:
        self.handles, self.owner = handles, owner
        self.done: Reduced | None = None

    def wait(self) -> Reduced:
        if self.done is None:
            merged = Reduced({}, CommStats())
            for handle in self.handles:
                part = handle.wait()
                merged.payloads.update(part.payloads)
                merged.errors.update(part.errors)
                merged.stats.bytes_sent += part.stats.bytes_sent
                merged.stats.bytes_received += part.stats.bytes_received
                merged.stats.modules.update(part.stats.modules)
            self.owner.observe(merged.payloads)
            self.done = merged
        return self.done


class AdaptiveCodecs(TransportWrapper[CodecReducer]):
    """Wraps a transport (or :class:`~dipaco.comm.feedback.ErrorFeedback`); same ``start``/``reduce``."""

    def __init__(self, transport: CodecReducer, first: Codec, chunk: int, tolerance: float, sample_chunks: int = 0) -> None:
        super().__init__(transport)
        self.first, self.tolerance = first, tolerance
        self.chunk, self.sample = chunk, sample_chunks
        self.codecs = [build_codec(name, chunk) for name in CANDIDATES]
        self.choice: dict[int, int] = {}  # module id -> index in CANDIDATES (absent: ``first``)
        self.errors: dict[int, list[float]] = {}  # the last measured error of every candidate, for the logs

    def codec_of(self, module: int) -> Codec:
        return self.codecs[self.choice[module]] if module in self.choice else self.first

    def start(self, payloads: Mapping[int, Payload], only: Collection[int] | None = None) -> _AdaptiveReduction:
        wanted = [m for m in self.modules if only is None or m in set(only)]
        order = [self.first] + [c for c in self.codecs if c is not self.first]
        handles = []
        for codec in order:  # the same order on every rank: the choices are the same everywhere
            mods = [m for m in wanted if self.codec_of(m) is codec]
            if mods:
                handles.append(self.transport.start(payloads, codec=codec, only=mods))
        return _AdaptiveReduction(handles, self)

    def reduce(self, payloads: Mapping[int, Payload], only: Collection[int] | None = None) -> Reduced:
        return self.start(payloads, only=only).wait()

    def observe(self, reduced: Mapping[int, Payload]) -> None:
        """Chooses the next codec of every module from its reduced outer gradient."""
        for m, payload in reduced.items():
            if float(payload.meta[0]) > 0:  # nothing was summed: no statistics
                self.choice[m], self.errors[m] = choose(self.codecs, payload.values, self.tolerance, self.chunk,
                                                        self.sample)

    # --- state: one integer per module, by name (identical on every holder) -----------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.names[m]: torch.tensor(i, dtype=torch.int64) for m, i in sorted(self.choice.items())}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ids = {self.names[m]: m for m in self.modules}
        unknown = sorted(set(state) - set(ids))
        if unknown:
            raise CheckpointError(f"adaptive codec choices for modules this rank does not communicate: {unknown[:3]}")
        self.choice = {ids[name]: int(v) for name, v in state.items()}
        bad = sorted(name for name, v in state.items() if not 0 <= int(v) < len(CANDIDATES))
        if bad:
            raise CheckpointError(f"adaptive codec choice out of range for {bad[:3]}")
