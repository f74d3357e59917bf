"""The resume policy: which checkpoints a run may continue from.

A checkpoint keeps the resolved config it was written under (``config.yaml``). A run resumes from it
only when the two configs agree in every key that changes what the run computes
(:func:`dipaco.config.config_diff`). The one change allowed is a longer run: more ``train.rounds``
continue it, and only the paths' learning-rate schedule sees the new length. A shorter run is made
with ``--until-round``, never by lowering ``train.rounds``.
"""

from __future__ import annotations

from pathlib import Path

from dipaco.checkpoint.store import CONFIG
from dipaco.config import config_diff, merge_config, parse_config
from dipaco.errors import ConfigError
from dipaco.metrics import echo


def check_resume(checkpoint: Path, config_yaml: str) -> None:
    """Refuses ``checkpoint`` when its saved config differs from ``config_yaml`` (this run's resolved config)
    in a key that changes what the run computes, naming every such key; says so when the run grows longer."""
    saved = merge_config(checkpoint / CONFIG)
    current = parse_config(config_yaml, "this run's config")
    diff = config_diff(saved, current)
    longer = current.train.rounds > saved.train.rounds
    if longer:
        diff = [d for d in diff if not d.startswith("train.rounds:")]
    if diff:
        hint = "; a run is shortened with --until-round, not train.rounds" if current.train.rounds < saved.train.rounds else ""
        raise ConfigError(f"cannot resume {checkpoint}: the config changed ({'; '.join(diff)}){hint}")
    if longer:
        steps = current.train.rounds * current.train.inner_steps
        echo(f"[train] extending the run from {saved.train.rounds} to {current.train.rounds} rounds: each path's "
             f"warmup-cosine learning rate now spans {steps} steps, so it rises from where the shorter schedule "
             f"left it to that step's value on the longer one")
