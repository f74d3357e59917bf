"""The one reader of a trained experiment: its directory, a verified checkpoint and that checkpoint's bank.

Evaluation, test-time re-routing, discriminative re-routing and serving read a trained experiment
through :func:`experiment_checkpoint` and :func:`read_bank`; the first refuses an experiment whose
run's routing was replaced.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig

from dipaco.checkpoint.store import CheckpointManager, load_bank_state, resolve_checkpoint
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.topology import Topology
from dipaco.route.provenance import check_routing
from dipaco.run_dir import RunDir


def experiment_checkpoint(run_dir: str | Path, name: str, routed: bool,
                          checkpoint: str | Path | None = None) -> tuple[Path, Path]:
    """The experiment's directory and its newest (or given) verified checkpoint, for the jobs that read
    a trained experiment back; ``routed``: it trained on routed shards, whose routing must still be the
    run's."""
    exp_dir = RunDir(run_dir).experiment(name)
    check_routing(run_dir, exp_dir, routed)
    return exp_dir, resolve_checkpoint(CheckpointManager(exp_dir / "checkpoints"), checkpoint)


@torch.no_grad()
def read_bank(ckpt: Path, topology: Topology, llama: LlamaConfig) -> ModuleBank:
    """Only the bank of a checkpoint (for evaluation and serving; no optimizer state is read)."""
    bank = ModuleBank(topology, build_model(llama, seed=0))
    bank.load_state_dict(load_bank_state(ckpt))
    return bank
