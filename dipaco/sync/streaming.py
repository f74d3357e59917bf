"""Streaming DiLoCo for DiPaCo: modules synced in fragments at staggered steps, overlapped with training.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) cuts DiLoCo's peak bandwidth and hides its
latency: the model is split into F fragments, fragment f is synced every H inner steps at offset
f * H / F, its exchange runs during the next tau inner steps, and when it lands every replica mixes
theta = alpha * local + (1 - alpha) * global (the paper: alpha = 0.5; alpha = 0 keeps the global
value alone). With 4-bit outer gradients (``dist.comm_dtype=fp4``) accumulated in fp32 the paper
reports ~400x fewer bits than data-parallel at equal loss.

In DiPaCo the unit of a fragment (``outer.streaming.fragment``) is

* ``module``: one module;
* ``level``: a part (the embedding, one level of modules, the head);
* ``blocks:K``: K consecutive decoder blocks of one module (a level's module holds several blocks;
  the last run of a module is shorter when K does not divide its blocks, and K may not exceed any
  level's blocks per module), while every part without blocks (the embedding; the head: final norm
  and LM head) is cut into the fewest contiguous pieces of equal size with at most K blocks'
  parameters each. Units are then never much larger than K blocks, so a fragment's share of the
  model, and with it the peak bytes of a sync, can fall to about 1/F even when the modules are few
  and large (a 2x2 grid of 2 blocks cut into 4 fragments: 0.310 of DiLoCo's peak with module units,
  0.250 with ``blocks:1``). The pieces are :mod:`dipaco.sync.slices`.

Units, in model order (by module, then position in the module), go to fragments by ``pattern``:
``strided`` (unit i -> fragment i mod F, the paper's), ``sequential`` (consecutive units), or
``balanced`` (largest unit first to the fragment with the fewest parameters, ties to the lower
index; this evens the peak). The schedule depends on the topology only, never on the ranks.

Schedule within a round of H inner steps (F divides H; tau < H / F):

* fragment 0 leaves at offset H, fragment f > 0 at offset f * H / F;
* a fragment that leaves at offset s lands at s + tau (fragment 0 at offset tau of the next round);
  each lands before the next one leaves, so at most one is in flight;
* in the last round (``train.rounds``) a fragment whose landing would fall after the run lands at
  once, so the final bank holds every fragment's last outer step.

When fragment f leaves (offset s), every path's modules in f give their weighted deltas against
the bank, Delta_m = sum_p w_p (theta_m - theta_{p,m}) / sum_p w_p over the paths containing m (the
DiLoCo step of :mod:`dipaco.sync.diloco`, per module; with ``blocks:K`` the same formula restricted
to the elements of f's slices of m), and the transport starts the exchange as asynchronous
torch.distributed work; the paths keep training. When it lands (s + tau), the holders of each module
take the same Nesterov step on Delta_m (on a slice: the step of the whole module, elementwise, on
the slice's elements only; momentum and parameters elsewhere untouched), and every path containing
m is mixed on those elements: theta_{p,m} <- alpha * theta_{p,m} + (1 - alpha) * theta_m.
Codecs, error-feedback residuals and adaptive codec choices are per slice (per module unless
``blocks:K``), checkpointed by slice name.

Guarantees:

* with F = 1, tau = 0 and alpha = 0 it *is* DiLoCo: the same operations in the same order, so the
  bank is bit-identical on CPU (with ``blocks:K`` too: every module's slices land together, and
  their elementwise outer gradients make up the module's);
* the other guarantees of :mod:`dipaco.sync.diloco` hold per fragment (only the paths containing a
  module contribute to it; a module without contribution is untouched; every holder applies the
  same bits; multi-rank fp32 equals a single process up to the order of fp32 additions);
* a fragment in flight at a checkpoint is finished and saved with its landing point, so a resumed
  run continues bit-exactly (CPU), fragments in flight included.

It is a :class:`~dipaco.sync.schedule.Schedule` of :class:`~dipaco.sync.diloco.DiLoCo`: fragments at
staggered offsets, a delay of tau inner steps, mixing alpha. This file builds that schedule and checks
the ``outer.streaming`` keys.
"""

from __future__ import annotations

import re

from dipaco.config import StreamingConfig
from dipaco.errors import ConfigError, check_range
from dipaco.model.bank import ModuleBank
from dipaco.sync.base import SyncContext
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.schedule import Schedule
from dipaco.sync.slices import Slice, block_slices, whole_modules
from dipaco.sync.transport import Exchange

IN_FLIGHT = "streaming"  # the checkpoint part of the fragment in flight


def fragment_blocks(fragment: str) -> int | None:
    """K of ``outer.streaming.fragment=blocks:K`` (None for ``level`` and ``module``); checks the
    syntax. Whether K fits the topology (at most a module's blocks) is checked when the slices are cut."""
    if fragment in ("level", "module"):
        return None
    match = re.fullmatch(r"blocks:([0-9]+)", fragment)
    if match and int(match.group(1)) >= 1:
        return int(match.group(1))
    raise ConfigError(f"outer.streaming.fragment: {fragment!r} is not one of level, module, blocks:K "
                      f"(K >= 1 decoder blocks, e.g. blocks:1)")


def check_streaming(stream: StreamingConfig, inner_steps: int, active: bool) -> None:
    """The ``outer.streaming`` keys; ``active``: outer.sync=streaming, so the schedule must fit the round."""
    fragment_blocks(stream.fragment)
    if stream.num_fragments is not None and stream.num_fragments < 1:
        raise ConfigError(f"outer.streaming.num_fragments: must be >= 1 or null, got {stream.num_fragments}")
    if stream.overlap_steps < 0:
        raise ConfigError(f"outer.streaming.overlap_steps: must be >= 0, got {stream.overlap_steps}")
    check_range("outer.streaming.mix_alpha", stream.mix_alpha, 0.0, 1.0)
    if active and stream.num_fragments is not None:
        check_streaming_schedule(stream, inner_steps, stream.num_fragments)


def check_streaming_schedule(stream: StreamingConfig, inner_steps: int, fragments: int) -> None:
    """F must divide H, and tau < H / F (each fragment lands before the next one leaves)."""
    h, tau = inner_steps, stream.overlap_steps
    if h % fragments:
        raise ConfigError(f"train.inner_steps: {h} is not a multiple of outer.streaming.num_fragments={fragments} "
                          f"(fragment f syncs at offset f * inner_steps / F)")
    if tau >= h // fragments:
        raise ConfigError(f"outer.streaming.overlap_steps: tau={tau} must be < train.inner_steps / "
                          f"outer.streaming.num_fragments = {h}/{fragments} = {h // fragments}")


def fragment_units(bank: ModuleBank, unit: str) -> list[tuple[Slice, ...]]:
    """The units fragments are made of (``outer.streaming.fragment``), in model order: the slices of
    each unit (whole modules, except with ``blocks:K``)."""
    k = fragment_blocks(unit)
    if k is not None:
        return [(piece,) for pieces in block_slices(bank, k) for piece in pieces]
    modules = whole_modules(bank)
    if unit == "level":
        return [tuple(modules[p.first_module: p.first_module + p.num_modules]) for p in bank.topology.parts]
    return [(piece,) for piece in modules]


def assign_fragments(sizes: list[int], fragments: int, pattern: str) -> list[int]:
    """Unit index -> fragment index (``sizes``: parameters per unit, for ``balanced``)."""
    n = len(sizes)
    if pattern == "strided":
        return [i % fragments for i in range(n)]
    if pattern == "sequential":
        return [i * fragments // n for i in range(n)]
    load = [0] * fragments
    out = [0] * n
    for i in sorted(range(n), key=lambda i: (-sizes[i], i)):
        f = min(range(fragments), key=lambda f: (load[f], f))
        out[i], load[f] = f, load[f] + sizes[i]
    return out


class StreamingDiLoCo(DiLoCo):
    name = "streaming"
    in_flight_part = IN_FLIGHT

    def __init__(self, ctx: SyncContext, two_phase_from: int = 3) -> None:
        cfg = ctx.outer.streaming
        check_streaming(cfg, ctx.inner_steps, active=True)
        units = fragment_units(ctx.bank, cfg.fragment)
        slices = [piece for unit in units for piece in unit]
        count = cfg.num_fragments if cfg.num_fragments is not None else len(units)
        if count > len(units):
            raise ConfigError(f"outer.streaming.num_fragments: {count} fragments but outer.streaming.fragment="
                              f"{cfg.fragment} gives only {len(units)} units")
        check_streaming_schedule(cfg, ctx.inner_steps, count)
        which = assign_fragments([sum(piece.numel for piece in unit) for unit in units], count, cfg.pattern)
        index = {piece: i for i, piece in enumerate(slices)}
        # slice ids per fragment (= module ids, unless blocks:K)
        fragments = tuple(tuple(sorted(index[piece] for unit, f in zip(units, which) if f == k for piece in unit))
                          for k in range(count))
        empty = [k for k, mods in enumerate(fragments) if not mods]
        if empty:
            raise ConfigError(f"outer.streaming.pattern: {cfg.pattern} leaves fragments {empty} without modules "
                              f"({len(units)} units into {count} fragments)")
        h = ctx.inner_steps
        leaves = tuple(h if k == 0 else k * h // count for k in range(count))
        schedule = Schedule(h, ctx.rounds, fragments, leaves, delay=cfg.overlap_steps, alpha=cfg.mix_alpha)
        super().__init__(ctx, schedule, slices=slices, two_phase_from=two_phase_from)

    @property
    def in_flight(self) -> Exchange | None:
        """The fragment in flight (at most one: each lands before the next one leaves)."""
        return self.transport.exchanges[0] if self.transport.exchanges else None
