"""Outer-sync algorithms, one class per file; ``outer.sync`` names one of :data:`SYNCS` (or of
:data:`ASYNC_SYNCS`, for the task scheduler)."""

from __future__ import annotations

from collections.abc import Callable

from dipaco.config import OuterConfig
from dipaco.errors import ConfigError
from dipaco.sync.async_nesterov import AsyncNesterov, check_async
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.delayed import DelayedDiLoCo, check_delayed
from dipaco.sync.deltas import check_deltas
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.nesterov import check_outer_step
from dipaco.sync.streaming import StreamingDiLoCo, check_streaming

SYNCS: dict[str, Callable[[SyncContext], OuterSync]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "delayed": DelayedDiLoCo,
}

# Algorithms without rounds: no OuterSync ``at()``; each module executor of the task scheduler
# (train.driver=ray) applies each arrival as it comes (dipaco.train.tasks).
ASYNC_SYNCS: dict[str, type] = {
    "async_nesterov": AsyncNesterov,
}


def _known(name: str) -> None:
    if name not in SYNCS and name not in ASYNC_SYNCS:
        raise ConfigError(f"outer.sync: {name!r} is not one of {', '.join([*SYNCS, *ASYNC_SYNCS])}")


def check_outer(outer: OuterConfig, inner_steps: int) -> None:
    """The ``outer`` section: the algorithm's name, the outer step, and each algorithm's own keys."""
    _known(outer.sync)
    check_outer_step(outer)
    check_deltas(outer)
    check_streaming(outer.streaming, inner_steps, active=outer.sync == "streaming")
    check_delayed(outer.delayed)
    check_async(outer)


def build_sync(ctx: SyncContext) -> OuterSync:
    name = ctx.outer.sync
    _known(name)
    if name in ASYNC_SYNCS:
        raise ConfigError(f"outer.sync: {name} is asynchronous; it runs with train.driver=ray, not in rounds")
    return SYNCS[name](ctx)


__all__ = ["ASYNC_SYNCS", "OuterSync", "SavedState", "SyncContext", "SyncReport", "SYNCS", "build_sync",
           "check_outer"]
