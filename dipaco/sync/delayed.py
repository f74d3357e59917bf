"""One-step-delay DiLoCo for DiPaCo: each round's outer gradient is applied one round later.

DiLoCoX (Qi et al., arXiv 2506.21263) overlaps the outer exchange with local training by a
one-step delay: the outer gradient of round t is all-reduced while round t + 1 trains, and applied
at the end of round t + 1, so communication never blocks training as long as one exchange takes
less than a round. (Kale et al., arXiv 2502.12996, study the same overlap in DiLoCo.)

The exact update, per module m, with d = ``outer.delayed.delay`` (1 in the paper), theta_t the
bank at the start of round t, and every path starting round t from theta_t:

* end of round t: Delta_{m,t} = sum_p w_p (theta_{m,t} - theta_{p,m}) / sum_p w_p over the paths
  containing m (as in DiLoCo, :mod:`dipaco.sync.diloco`); its exchange starts (asynchronous
  torch.distributed work) and runs during the next round (exchanges still in flight are finished
  before a new one starts, so with d > 1 the overlap is still one round);
* still at the end of round t: theta_{m,t+1} = Nesterov(theta_{m,t}, Delta_{m,t-d}) with the exchange
  that started d rounds earlier, now finished (no step while t < d); every path restarts from
  theta_{t+1};
* the last round (``train.rounds``) also applies the exchanges still in flight, oldest first, so the
  final bank holds every round's outer gradient.

d = 0 is DiLoCo: the same operations in the same order (bit-identical on CPU). The rest of DiLoCo's
guarantees hold (per-module averaging over the paths containing the module, identical bits on every
holder, multi-rank fp32 equal to one process up to the order of additions). Exchanges in flight at a
checkpoint are finished and saved with the round they apply at, so a resumed run continues
bit-exactly (CPU).

Eager variant (``outer.delayed.eager=true``, delay 1; after Kale et al.'s eager updates, made
replica-safe): the bank is updated exactly as above, only by averaged deltas, so every holder keeps
the same bits; what changes is where each *path* restarts. With d_p the path's own change over round
t, measured from where it started the round (s_p - theta_p),

* the exchange of round t carries sum_p w_p d_p (not the change from the bank);
* the path restarts round t + 1 from theta_{t+1} - d_p: the bank with everyone's outer gradient up
  to round t - 1, plus its own round t at once (its round-t share reaches the bank a round later,
  in the average, when its own d_p is no longer added);
* the last round lands everything, and the paths restart from the bank.

A single path with ``outer.lr=1, outer.momentum=0`` then trains exactly as if alone, while the bank
lags one round behind it. Each path's d_p is checkpointed (per rank, by path).

It is a :class:`~dipaco.sync.schedule.Schedule` of :class:`~dipaco.sync.diloco.DiLoCo`: one fragment,
a delay of d rounds, paths restarting from the bank after every sync. This file builds that schedule,
the outer step it takes, and checks the ``outer.delayed`` keys.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dipaco.config import DelayedConfig, OuterConfig
from dipaco.errors import ConfigError, check_range
from dipaco.sync.base import SyncContext
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.nesterov import OuterStep
from dipaco.sync.schedule import Schedule
from dipaco.sync.transport import Exchange

# The outer momentum of a delayed run when outer.delayed.momentum is null: measured, not derived. Of the momenta
# tried with the eager variant (H = 96, 6 rounds), 0.5 was the only one at or better than DiLoCo's perplexity; higher
# ones overshoot on the round-late gradient, 0 loses the momentum's help (docs/notes/2026-11-23-streaming-delay-codecs.md).
DELAYED_MOMENTUM = 0.5
IN_FLIGHT = "delayed"  # the checkpoint part of the outer gradients in flight (and delayed_own: eager's own changes)


def check_delayed(delayed: DelayedConfig) -> None:
    """The ``outer.delayed`` keys."""
    if delayed.delay < 0:
        raise ConfigError(f"outer.delayed.delay: must be >= 0, got {delayed.delay}")
    if delayed.lr is not None:
        check_range("outer.delayed.lr", delayed.lr, 0.0, math.inf)
    if delayed.momentum is not None:
        check_range("outer.delayed.momentum", delayed.momentum, 0.0, 1.0)
    if delayed.eager and delayed.delay != 1:
        raise ConfigError(f"outer.delayed.eager: needs outer.delayed.delay=1 (a path's own delta is kept while "
                          f"exactly one exchange is in flight), got delay={delayed.delay}")


def delayed_outer_step(outer: OuterConfig) -> OuterStep:
    """The outer optimizer settings of the delayed sync.

    ``outer.delayed.lr`` and ``outer.delayed.momentum`` where set. Otherwise the lr is ``outer.lr``
    and, with a delay, the momentum is at most :data:`DELAYED_MOMENTUM`: an outer gradient applied a
    round late keeps the momentum pushing for a round after the paths have moved on, and momentum
    0.9 (DiLoCo's) overshoots. A zero delay keeps ``outer.momentum``: DiLoCo, bit for bit."""
    lr = outer.lr if outer.delayed.lr is None else outer.delayed.lr
    if outer.delayed.momentum is not None:
        momentum = outer.delayed.momentum
    else:
        momentum = min(outer.momentum, DELAYED_MOMENTUM) if outer.delayed.delay > 0 else outer.momentum
    return OuterStep(lr, momentum, outer.nesterov, outer.embedding_head_lr_scale)


class DelayedDiLoCo(DiLoCo):
    name = "delayed"
    in_flight_part = IN_FLIGHT

    def __init__(self, ctx: SyncContext, two_phase_from: int = 3) -> None:
        delayed = ctx.outer.delayed
        check_delayed(delayed)
        diloco = Schedule.diloco(ctx.inner_steps, ctx.rounds, len(ctx.topology.modules))  # whole modules
        schedule = replace(diloco, delay=delayed.delay * ctx.inner_steps, restart=True, eager=delayed.eager)
        super().__init__(ctx, schedule, outer_step=delayed_outer_step(ctx.outer), two_phase_from=two_phase_from)

    @property
    def in_flight(self) -> list[Exchange]:
        """The outer gradients in flight, oldest first."""
        return self.transport.exchanges
