"""The one place an inner loop is built: a path's model, its shard's sampler, AdamW and the LR schedule.

The lock-step ranks, the Ray path workers and pretraining all build their loops here, so the three
cannot drift apart. The seed rule of the samplers (:func:`sampler_seed`) is the only one:

* path ``p`` draws its batches with ``run.seed * 7919 + p`` (7919 is prime: the streams of the
  paths of nearby run seeds do not collide for up to 7919 paths);
* the dense pretraining model (:data:`DENSE`, one shard of every training document) draws with
  ``run.seed`` itself.

A loop's device decides its precision (``auto``: bf16 on CUDA, fp32 elsewhere), so the factory keeps
the setting and resolves it where the loop runs: a Ray worker on a GPU node gets the GPU's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dipaco.config import ModelConfig, OptimConfig
from dipaco.paths.inner import InnerLoop, InnerOptions
from dipaco.paths.sampler import Sequences, ShardSampler
from dipaco.precision import resolve_precision

DENSE = -1  # the shard key of the dense pretraining model (every training document)
PATH_SEED_STRIDE = 7919


def sampler_seed(run_seed: int, path: int) -> int:
    """The seed of a shard's sampler (see the module docstring)."""
    return run_seed if path == DENSE else run_seed * PATH_SEED_STRIDE + path


@dataclass(frozen=True)
class LoopSettings:
    """How every loop of a job runs: the ``train.*`` or ``pretrain.*`` keys an inner loop reads."""

    optim: OptimConfig
    total_steps: int  # the LR schedule's length
    precision: str  # the setting; resolved on each loop's device
    compile: bool = False
    activation_checkpointing: bool = False
    offload_inactive: bool = False
    key: str = "train"  # the config section, named in errors

    @staticmethod
    def from_config(section, model: ModelConfig, total_steps: int, key: str) -> LoopSettings:
        """From ``train`` or ``pretrain`` (``key`` names it) and ``model``."""
        return LoopSettings(optim=section.optim, total_steps=total_steps, precision=section.precision,
                            compile=section.compile, activation_checkpointing=model.activation_checkpointing,
                            offload_inactive=getattr(section, "offload_inactive", False), key=key)

    def options(self, device: torch.device | str) -> InnerOptions:
        return InnerOptions(precision=resolve_precision(self.precision, device, f"{self.key}.precision"),
                            compile=self.compile, activation_checkpointing=self.activation_checkpointing,
                            offload_inactive=self.offload_inactive)


@dataclass(frozen=True)
class PathLoops:
    """Builds the inner loop of any path (or of :data:`DENSE`) from its shard."""

    shards: Mapping[int, Sequences]  # path -> its packed training sequences
    settings: LoopSettings
    seed: int  # run.seed

    def build(self, path: int, model: PreTrainedModel, device: torch.device | str) -> InnerLoop:
        """``model`` (already holding the path's parameters) trained on ``path``'s shard."""
        settings = self.settings
        sampler = ShardSampler(self.shards[path], settings.optim.batch_size, seed=sampler_seed(self.seed, path))
        return InnerLoop(model, sampler, settings.optim, settings.total_steps, device, settings.options(device))
