"""Atomic, verifiable checkpoints: one directory per completed round.

Layout of ``checkpoints/round_000004/``::

    bank.safetensors            every module, as "<part>.<index>/<llama parameter name>"
    outer.safetensors           one Nesterov momentum buffer per module, by module name
    trainer_state.pt            round index and RNG states
    paths/path_007/model.safetensors   the path's parameters at the end of the round
    paths/path_007/inner.pt            its AdamW state, LR schedule and data cursor
    config.yaml                 the resolved config of the run
    MANIFEST.json               sha256 and size of every file above; written last

A checkpoint is written into a temporary sibling directory and renamed into place only when
complete, so a crash mid-write never leaves a half checkpoint under a real name. Loading checks
every file against the manifest, so a truncated or corrupted file is named in a clear error and
older checkpoints stay usable. ``.pt`` files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import load_file, save_file

from dipaco.errors import CheckpointError

MANIFEST = "MANIFEST.json"
_ROUND_DIR = re.compile(r"^round_(\d{6})$")


def round_dir_name(round_index: int) -> str:
    return f"round_{round_index:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(root: Path) -> Iterable[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_tree(root: Path) -> None:
    for path in [*_files(root), root / MANIFEST]:
        with path.open("rb") as f:
            os.fsync(f.fileno())


class CheckpointManager:
    """Writes ``round_NNNNNN`` directories under ``root`` atomically and keeps the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def save(self, round_index: int, write: Callable[[Path], None]) -> Path:
        """``write(tmp_dir)`` fills a temporary directory; it becomes ``round_NNNNNN`` once complete."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / round_dir_name(round_index)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        manifest = {str(p.relative_to(tmp)): {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in _files(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_tree(tmp)
        if final.exists():  # re-running a round after a restart replaces its old checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (renamed into place), oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and _ROUND_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".round_*.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


def verify(ckpt: str | Path) -> None:
    """Raises CheckpointError naming the first missing, truncated or corrupted file."""
    ckpt = Path(ckpt)
    manifest_path = ckpt / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None
    for rel, entry in manifest.items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path}: truncated or overwritten ({size} bytes, expected {entry['bytes']})")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: corrupted (sha256 does not match the manifest)")


def resolve_checkpoint(manager: CheckpointManager, resume_from: str | Path | None = None) -> Path:
    """The checkpoint to resume from, verified; a bad one names the previous usable checkpoint."""
    ckpt = Path(resume_from) if resume_from else manager.latest()
    if ckpt is None:
        raise CheckpointError(f"no checkpoint to resume from under {manager.root}")
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt}")
    try:
        verify(ckpt)
    except CheckpointError as exc:
        older = [p for p in manager.checkpoints() if p.name < ckpt.name]
        hint = f"; the previous checkpoint is {older[-1]} (resume with --resume-from {older[-1]})" if older else ""
        raise CheckpointError(f"{exc}{hint}") from None
    return ckpt


# --- tensor files ---------------------------------------------------------------------------------
def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)


def load_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def save_state(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def load_state(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable state file ({exc})") from None


# --- the training state of a round ----------------------------------------------------------------
def path_dir(root: Path, path: int) -> Path:
    return root / "paths" / f"path_{path:03d}"


def write_training_state(root: Path, round_index: int, bank, outer, loops: dict, rng: dict, config_yaml: str) -> None:
    """Fills a checkpoint directory; ``loops`` maps path id -> InnerLoop."""
    meta = {"round": str(round_index)}
    save_tensors(bank.state_dict(), root / "bank.safetensors", metadata=meta)
    save_tensors(outer.state_dict(), root / "outer.safetensors", metadata=meta)
    for path, loop in loops.items():
        params = {n: p for n, p in loop.model.named_parameters()}
        save_tensors(params, path_dir(root, path) / "model.safetensors", metadata=meta)
        save_state(loop.state_dict(), path_dir(root, path) / "inner.pt")
    save_state({"round": round_index, "rng": rng}, root / "trainer_state.pt")
    (root / "config.yaml").write_text(config_yaml)


@torch.no_grad()
def read_training_state(root: Path, bank, outer, loops: dict) -> dict:
    """Restores bank, outer state and every path's model + inner state; returns the trainer state."""
    bank.load_state_dict(load_tensors(root / "bank.safetensors", bank.device))
    outer.load_state_dict(load_tensors(root / "outer.safetensors", bank.device))
    for path, loop in loops.items():
        params = load_tensors(path_dir(root, path) / "model.safetensors")
        named = dict(loop.model.named_parameters())
        if set(params) != set(named):
            raise CheckpointError(f"{path_dir(root, path)}: model parameters do not match the path model")
        for name, value in params.items():
            named[name].copy_(value)
        loop.load_state_dict(load_state(path_dir(root, path) / "inner.pt"))
    return load_state(root / "trainer_state.pt")
