"""Outer-sync algorithms, one class per file; ``outer.sync`` names one of :data:`SYNCS`."""

from __future__ import annotations

from dipaco.errors import ConfigError
from dipaco.sync.base import OuterSync, SavedState, SyncContext, SyncReport
from dipaco.sync.delayed import DelayedDiLoCo
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.streaming import StreamingDiLoCo

SYNCS: dict[str, type[OuterSync]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "delayed": DelayedDiLoCo,
}


def build_sync(ctx: SyncContext) -> OuterSync:
    name = ctx.cfg.outer.sync
    if name not in SYNCS:
        raise ConfigError(f"outer.sync: {name!r} is not one of {', '.join(SYNCS)}")
    return SYNCS[name](ctx)


__all__ = ["OuterSync", "SavedState", "SyncContext", "SyncReport", "SYNCS", "build_sync"]
