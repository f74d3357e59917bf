"""The one reader of a trained experiment: its directory, a verified checkpoint and that checkpoint's bank.

Evaluation, test-time re-routing, discriminative re-routing and serving read a trained experiment
through :func:`experiment_checkpoint`; it refuses an experiment whose run's routing was replaced.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dipaco.checkpoint.store import CheckpointManager, load_bank_state, resolve_checkpoint
from dipaco.config import Config
from dipaco.data.prepare import Prepared
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.topology import Topology, topology_from_config
from dipaco.route.shards import check_routing
from dipaco.run_dir import RunDir
from dipaco.train.pretrain import path_llama_config


def experiment_checkpoint(cfg: Config, prepared: Prepared, checkpoint: str | None = None
                          ) -> tuple[Path, Path, Topology, ModuleBank]:
    """The experiment's directory, its newest (or given) checkpoint and that checkpoint's bank, for
    the jobs that read a trained experiment back; refuses one whose run's routing was replaced."""
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    check_routing(cfg, exp_dir)
    ckpt = resolve_checkpoint(CheckpointManager(exp_dir / "checkpoints"), checkpoint)
    return (exp_dir, ckpt, *bank_from_checkpoint(cfg, prepared, ckpt))


@torch.no_grad()
def bank_from_checkpoint(cfg: Config, prepared: Prepared, ckpt: Path) -> tuple[Topology, ModuleBank]:
    """Only the bank of a checkpoint (for evaluation and serving; no optimizer state is read)."""
    topology = topology_from_config(cfg.topology, cfg.model.num_layers)
    bank = ModuleBank(topology, build_model(path_llama_config(cfg, prepared), seed=0))
    bank.load_state_dict(load_bank_state(ckpt))
    return topology, bank
