"""Tensor files: safetensors for weights, ``torch.save`` (read back with ``weights_only=True``) for small state.

Every job that writes tensors goes through here, so an I/O failure that a library reports in its own
exception type (``torch.save`` on a full disk raises a RuntimeError about stream positions,
safetensors its own error wrapping the I/O error) becomes an :class:`OSError` naming the file, and a
file that cannot be read back is a :class:`~dipaco.errors.CheckpointError` naming it. Pickles are
never executed: ``.pt`` files are read with ``weights_only=True``.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dipaco.errors import CheckpointError

_IO_FAILURE = re.compile(r"unexpected pos|PytorchStreamWriter|IoError|No space left|os error", re.IGNORECASE)


def _write_failed(path: Path, exc: Exception) -> Exception:
    """An OSError naming ``path`` when ``exc`` is a library's report of a failed write; else ``exc``."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if not _IO_FAILURE.search(str(exc)):
        return exc
    return OSError(errno.EIO, f"write failed ({message}); is the disk full?", str(path))


def _write(path: Path, write: Callable[[], None]) -> None:
    """Runs ``write`` for ``path``; an I/O failure reported in a library's own error type becomes an OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write()
    except OSError:
        raise
    except Exception as exc:
        failed = _write_failed(path, exc)
        if failed is exc:
            raise
        raise failed from exc


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _write(path, lambda: save_file(tensors, str(path), metadata=metadata))


def load_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(device))
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


@torch.no_grad()
def copy_params(model: torch.nn.Module, params: dict[str, torch.Tensor], source: Path | str) -> torch.nn.Module:
    """Copies named parameters into ``model``, in place; refuses a set whose names differ (``source`` names it)."""
    named = dict(model.named_parameters())
    if set(params) != set(named):
        raise CheckpointError(f"{source}: model parameters do not match the path model")
    for name, value in params.items():
        named[name].copy_(value)
    return model


def load_model_params(model: torch.nn.Module, file: Path) -> torch.nn.Module:
    """Copies a file of ``model``'s named parameters into it, in place; refuses one whose names differ."""
    return copy_params(model, load_tensors(file), file)


def save_state(obj: dict, path: Path) -> None:
    _write(path, lambda: torch.save(obj, path))


def load_state(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable state file ({exc})") from None
