"""Exceptions the CLI turns into one clear line instead of a traceback, and the range check behind many of them."""

import math


class DipacoError(Exception):
    """Base class: a problem with the user's input, config, data or files."""


class ConfigError(DipacoError):
    """An unknown key, a wrong type or an inconsistent value in a config."""


class DataError(DipacoError):
    """A corpus, document or shard that cannot be used as it is."""


class CheckpointError(DipacoError):
    """A checkpoint that is missing, truncated or corrupted."""


class DistributedError(DipacoError):
    """A collective that failed or timed out (a peer rank died), or replicas of a module that diverged."""


def check_range(key: str, value: float, low: float, high: float, *, high_closed: bool = False) -> None:
    """``value`` must be a finite number in [low, high) (or [low, high] with ``high_closed``); the
    ConfigError names ``key``."""
    ok = math.isfinite(value) and low <= value and (value <= high if high_closed else value < high)
    if not ok:
        where = f">= {low}" if math.isinf(high) else f"in [{low}, {high}{']' if high_closed else ')'}"
        raise ConfigError(f"{key}: must be a finite number {where}, got {value}")
