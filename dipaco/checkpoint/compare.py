"""Are two runs bit-identical? Two checkpoints compared tensor by tensor.

Every ``.safetensors`` file of a checkpoint (the bank, the outer state, each path's parameters, per rank)
and every tensor in its ``.pt`` state files (AdamW moments, RNG states) is keyed by relative file path and
tensor name and compared with ``torch.equal``: equal shapes, dtypes and bits. ``dipaco compare`` runs it
from the command line; the equivalence runs of a trainer change (``scripts/equivalence_runs.sh``) and the
resume tests rely on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dipaco.checkpoint.store import CheckpointManager
from dipaco.errors import DipacoError


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


def _file_tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        return list(load_file(str(path)).items())
    return list(_tensors(torch.load(path, map_location="cpu", weights_only=True)))


def checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    """``relative/file/path:tensor name`` -> tensor, for every tensor file of the checkpoint at ``root``."""
    if not root.is_dir():
        raise DipacoError(f"{root}: no checkpoint directory there")
    out: dict[str, torch.Tensor] = {}
    for path in [*sorted(root.rglob("*.safetensors")), *sorted(root.rglob("*.pt"))]:
        try:
            tensors = _file_tensors(path)
        except Exception as exc:  # a truncated or corrupted file: its name, not the reader's traceback
            raise DipacoError(f"{path}: cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from exc
        out.update((f"{path.relative_to(root)}:{name}", value) for name, value in tensors)
    return out


def tensor_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """What differs between two keyed tensor sets, one line each (empty: bit-identical)."""
    problems = [f"only in the first: {k}" for k in sorted(set(a) - set(b))]
    problems += [f"only in the second: {k}" for k in sorted(set(b) - set(a))]
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
            problems.append(f"{key}: differs (max abs difference {diff:.3g})")
    return problems


def newest_checkpoint(run_dir: Path, experiment: str) -> Path:
    found = CheckpointManager(run_dir / "train" / experiment / "checkpoints").latest()
    if found is None:
        raise DipacoError(f"no checkpoint under {run_dir / 'train' / experiment}")
    return found


def compare_checkpoints(a: Path, b: Path, ignore: tuple[str, ...] = ()) -> tuple[int, list[str]]:
    """(the first checkpoint's tensor count, the differences whose line contains none of ``ignore``)."""
    first = checkpoint_tensors(a)
    problems = tensor_differences(first, checkpoint_tensors(b))
    return len(first), [p for p in problems if not any(s in p for s in ignore)]
