"""Checkpoints of the formats before this one: the lock-step driver's format 2 resumes bit-exactly; the
old Ray driver's format 2, whose executors kept another state, is refused with an error naming it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.checkpoint.state import TrainingState
from dipaco.checkpoint.store import MANIFEST, SavedCheckpoint
from dipaco.errors import CheckpointError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.run import Run
from dipaco.tensor_io import load_state, save_state


def tiny_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=7, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                                        num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=8))


def rewrite_state(ckpt: Path, change) -> None:
    """Edits a checkpoint's trainer_state.pt and vouches for it in the manifest, as its writer would have."""
    path = ckpt / "trainer_state.pt"
    state = load_state(path)
    change(state)
    save_state(state, path)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["trainer_state.pt"] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def as_format_2(state: dict) -> None:
    """The lock-step driver's format 2: no driver, no scheduler state, no checkpoint event info."""
    for key in ("driver", "scheduler", "checkpoint_info"):
        state.pop(key)
    state["format"] = 2


@pytest.mark.slow
def test_a_format_2_checkpoint_of_the_lock_step_driver_resumes_bit_exactly(run_cfg):
    straight = Run(replace(run_cfg, train=replace(run_cfg.train, name="straight", rounds=3))).train()
    cfg = replace(run_cfg, train=replace(run_cfg.train, name="old", rounds=3))
    exp = Run(cfg).train(until_round=2)
    rewrite_state(exp.checkpoints.latest(), as_format_2)
    resumed = Run(cfg).train(resume=True)
    assert all(torch.equal(a, b) for a, b in zip(straight.bank.params, resumed.bank.params))
    assert all(torch.equal(a, b) for a, b in zip(straight.sync.nesterov.state_dict().values(),
                                                 resumed.sync.nesterov.state_dict().values()))


def test_a_format_2_checkpoint_of_the_old_ray_driver_is_refused_naming_its_format(tmp_path):
    topo = Topology.grid(2, [1])
    save_state({"round": 4, "format": 2, "driver": "ray", "queue": {}, "executors": {}}, tmp_path / "trainer_state.pt")
    state = TrainingState(ModuleBank(topo, tiny_model()), frozenset(), {}, SimpleNamespace(), SimpleNamespace(driver="ray"),
                          0, [(0,)])
    with pytest.raises(CheckpointError, match="a format-2 checkpoint of the Ray driver.*reads format 3"):
        state.restore(SavedCheckpoint(tmp_path))
    torchrun = replace(state, scheduler=SimpleNamespace(driver="torchrun"))
    with pytest.raises(CheckpointError, match="written by train.driver=ray; train.driver=torchrun cannot continue it"):
        torchrun.restore(SavedCheckpoint(tmp_path))
