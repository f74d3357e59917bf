"""Outer-sync algorithms, one class per file; ``outer.sync`` names one of :data:`SYNCS`."""

from __future__ import annotations

from dipaco.errors import ConfigError
from dipaco.sync.async_nesterov import AsyncNesterov
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.delayed import DelayedDiLoCo
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.streaming import StreamingDiLoCo

SYNCS: dict[str, type[OuterSync]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "delayed": DelayedDiLoCo,
}

# Algorithms without rounds: no OuterSync ``at()``; the Ray driver (train.driver=ray) applies each
# arrival as it comes (dipaco.train.ray_driver).
ASYNC_SYNCS: dict[str, type] = {
    "async_nesterov": AsyncNesterov,
}


def build_sync(ctx: SyncContext) -> OuterSync:
    name = ctx.cfg.outer.sync
    if name in ASYNC_SYNCS:
        raise ConfigError(f"outer.sync: {name} is asynchronous; it runs with train.driver=ray, not in rounds")
    if name not in SYNCS:
        raise ConfigError(f"outer.sync: {name!r} is not one of {', '.join(SYNCS)}")
    return SYNCS[name](ctx)


__all__ = ["ASYNC_SYNCS", "OuterSync", "SavedState", "SyncContext", "SyncReport", "SYNCS", "build_sync"]
