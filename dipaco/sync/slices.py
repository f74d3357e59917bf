"""Slices: the pieces of the bank's modules that outer gradients are exchanged and applied in.

A slice is the elements [start, stop) of one module's flat vector in the bank
(:class:`~dipaco.model.bank.ModuleBank`). DiLoCo and its variants exchange, encode, error-feed and
apply outer gradients per slice: the transport (:mod:`dipaco.comm.reduce`), its error feedback and
its adaptive codec choice are keyed by slice ids and named by slice names, so they need no notion of
a sub-module. Normally every slice is a whole module (:func:`whole_modules`: slice id = module id,
slice name = module name, so the checkpoints are the same as with modules). Streaming DiLoCo's
``outer.streaming.fragment=blocks:K`` cuts modules finer (:func:`block_slices`):

* a level module into runs of K consecutive decoder blocks (the last run of a module shorter when
  K does not divide its blocks); K may not exceed the blocks of any level's modules;
* every other part (the embedding; the head: final norm and LM head) into the fewest contiguous
  pieces of at most K blocks' parameters, of equal size (the first ones one element larger when
  the size does not divide), so that no slice is much larger than a K-block one and a fragment's
  share of the model can fall to about 1/F.

What stays per module: the averaging (every slice of module m carries the same meta values, the
weight and count of the paths through m), the scale of lossy payloads (the weight of every path
through m), the Nesterov momentum buffer (one per module, of which a slice steps its elements:
:meth:`dipaco.sync.nesterov.ModuleNesterov.step`), and which ranks hold it (a slice's group is its
module's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dipaco.errors import ConfigError
from dipaco.model.bank import ModuleBank


@dataclass(frozen=True)
class Slice:
    module: int  # global module id
    start: int  # [start, stop) of the module's flat vector
    stop: int
    name: str  # the module's name when whole, else "<module>[start:stop]"

    @property
    def numel(self) -> int:
        return self.stop - self.start


def _slice(bank: ModuleBank, module: int, start: int, stop: int) -> Slice:
    name = bank.module_name(module)
    whole = start == 0 and stop == bank.numel(bank.topology.modules[module].part)
    return Slice(module, start, stop, name if whole else f"{name}[{start}:{stop}]")


def whole_modules(bank: ModuleBank) -> list[Slice]:
    """One slice per module, in module order (slice id = module id)."""
    return [_slice(bank, m.id, 0, bank.numel(m.part)) for m in bank.topology.modules]


def block_slices(bank: ModuleBank, k: int) -> list[list[Slice]]:
    """``outer.streaming.fragment=blocks:K``: each module's slices (module order), as the module
    docstring says."""
    levels = [part for part in bank.topology.parts if part.kind == "level"]
    short = [part for part in levels if len(part.layers) < k]
    if short:
        raise ConfigError(f"outer.streaming.fragment: blocks:{k} but the modules of {short[0].name} have only "
                          f"{len(short[0].layers)} block(s); K must be at most every level's blocks per module "
                          f"({min(len(p.layers) for p in levels)} here)")
    block = max(stop - start for part in levels for start, stop in bank.block_spans(part))
    cap = k * block  # the most parameters a piece of a part without blocks may have
    out = []
    for module in bank.topology.modules:
        part = module.part
        if part.kind == "level":
            spans = bank.block_spans(part)
            runs = [(spans[i][0], spans[min(i + k, len(spans)) - 1][1]) for i in range(0, len(spans), k)]
        else:
            numel = bank.numel(part)
            pieces = max(1, -(-numel // cap))
            size, extra = divmod(numel, pieces)
            bounds = [i * size + min(i, extra) for i in range(pieces + 1)]
            runs = list(zip(bounds[:-1], bounds[1:]))
        out.append([_slice(bank, module.id, start, stop) for start, stop in runs])
    return out


def spans_by_module(slices: Iterable[Slice]) -> dict[int, list[tuple[int, int]]]:
    """Module id -> the [start, stop) ranges the slices cover, sorted, adjacent ranges merged."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in sorted(slices, key=lambda s: (s.module, s.start)):
        ranges = out.setdefault(s.module, [])
        if ranges and ranges[-1][1] == s.start:
            ranges[-1] = (ranges[-1][0], s.stop)
        else:
            ranges.append((s.start, s.stop))
    return out


def ids_by_module(slices: Sequence[Slice]) -> dict[int, tuple[int, ...]]:
    """Module id -> the ids (indices in ``slices``) of its slices, in order."""
    out: dict[int, tuple[int, ...]] = {}
    for i, piece in enumerate(slices):
        out[piece.module] = out.get(piece.module, ()) + (i,)
    return out


def check_cover(slices: Sequence[Slice], bank: ModuleBank) -> dict[int, tuple[int, ...]]:
    """:func:`ids_by_module`, checked: every module's slices have consecutive ids and cover it end to end."""
    of_module = ids_by_module(slices)
    for m in bank.topology.modules:
        ids, at = of_module.get(m.id, ()), 0
        for i in ids:
            at = slices[i].stop if slices[i].start == at else -1
        if not ids or at != bank.numel(m.part) or list(ids) != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError(f"the slices of module {m.name} do not cover it in order")
    return of_module


def module_vectors(slices: Sequence[Slice], values: Mapping[int, torch.Tensor], numel: Mapping[int, int],
                   device: torch.device) -> tuple[dict[int, torch.Tensor], dict[int, list[tuple[int, int]]]]:
    """Slice vectors (slice id -> tensor) put together per module: module id -> a vector of the module's
    ``numel`` (a whole module's own vector when its one slice covers it, else zeros outside the slices
    given), and, for the modules that only some slices cover, the ranges they cover."""
    vectors: dict[int, torch.Tensor] = {}
    partial: dict[int, list[tuple[int, int]]] = {}
    for m, ranges in spans_by_module(slices[i] for i in values).items():
        pieces, size = sorted(i for i in values if slices[i].module == m), numel[m]
        if ranges != [(0, size)]:
            partial[m] = ranges
        if len(pieces) == 1 and slices[pieces[0]].numel == size:
            vectors[m] = values[pieces[0]]  # a whole module: its vector as it is
            continue
        vectors[m] = torch.zeros(size, device=device)
        for i in pieces:
            vectors[m][slices[i].start:slices[i].stop] = values[i]
    return vectors, partial
