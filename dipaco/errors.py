"""Exceptions the CLI turns into one clear line instead of a traceback."""


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
