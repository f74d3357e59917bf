"""Process-wide setup shared by every job: seeding, determinism, device choice."""

from __future__ import annotations

import random

import numpy as np
import torch

from dipaco.errors import ConfigError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # warn_only: some CUDA kernels have no deterministic variant; CPU runs are bit-exact.
    torch.use_deterministic_algorithms(True, warn_only=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {name!r} requested but CUDA is not available")
    return device


def rng_state() -> dict:
    """torch's global RNG state. Training draws from no other global generator (numpy and
    Python's are only seeded), and data order comes from per-shard generators in the sampler."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def quiet_library_progress_bars() -> None:
    """Silences datasets' and transformers' own bars (for run.progress=false, logs and CI)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
