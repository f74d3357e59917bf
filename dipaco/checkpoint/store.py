"""Atomic, verifiable checkpoints in one format: one directory per checkpoint index.

Layout of ``checkpoints/round_000004/`` (the index counts completed rounds under the round scheduler,
completed tasks under the task scheduler)::

    bank.safetensors            every module, as "<part>.<index>/<llama parameter name>"
    outer.safetensors           the outer optimizer: one Nesterov momentum buffer per module, by module name
    <part>.safetensors          the other parts the sync algorithm keeps (error-feedback residuals,
                                exchanges in flight, an executor's pending changes, ...)
    trainer_state.pt            the index, the RNG states, the placement and the scheduler's state
    paths/path_007/model.safetensors   the path's parameters after the outer step
    paths/path_007/inner.pt            its AdamW state, LR schedule and data cursor
    config.yaml                 the resolved config of the run
    MANIFEST.json               sha256 and size of every file above; written last

This module is the only one that knows these file names: components hand their state over as a
:class:`Snapshot` (parts of named tensors, each path's state, the trainer's state) and read it back
through a :class:`SavedCheckpoint`. The stateful components of a training run and how they fill a
snapshot are :class:`dipaco.checkpoint.state.TrainingState`.

A checkpoint is written into a temporary sibling directory and renamed into place only when
complete, so a crash mid-write never leaves a half checkpoint under a real name. Loading checks
every file against the manifest, so a truncated or corrupted file is named in a clear error and
older checkpoints stay usable. ``.pt`` files are read with ``torch.load(weights_only=True)``.

Several writers (the ranks of a distributed run, see :mod:`dipaco.comm.world`) share one temporary
directory: rank 0 creates it; every rank writes its own files (its paths, and the state of the
modules it is the lowest holder of), hashes and fsyncs them; the manifests are gathered to rank 0,
which writes ``MANIFEST.json`` and renames the directory. Rank 0's files keep the names above, rank
r > 0 writes under ``ranks/rank_RRR/``; a single process therefore writes exactly the layout above.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from dipaco.atomic import remove_tree
from dipaco.errors import CheckpointError
from dipaco.tensor_io import load_state, load_tensors, save_state, save_tensors

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


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


class Writers(Protocol):
    """The writers of one checkpoint (:class:`dipaco.comm.world.World` implements it)."""

    token: str  # the same on every writer: names the shared temporary directory

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def barrier(self, what: str) -> None: ...

    def all_gather_object(self, obj: Any, what: str) -> list[Any]: ...


class SingleWriter:
    """The one writer of a single-process run."""

    rank, size = 0, 1

    def __init__(self) -> None:
        self.token = str(os.getpid())

    def barrier(self, what: str) -> None:
        pass

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        return [obj]


class CheckpointManager:
    """Writes ``round_NNNNNN`` directories under ``root`` atomically and keeps the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def save(
        self, round_index: int, write: Callable[[Path], Iterable[Path] | None], writers: Writers | None = None
    ) -> Path:
        """``write(tmp_dir)`` fills a temporary directory; it becomes ``round_NNNNNN`` once complete.

        With several ``writers`` every one calls ``save`` and ``write`` returns the files it wrote.
        """
        writers = writers or SingleWriter()
        final = self.root / round_dir_name(round_index)
        tmp = self.root / f".{final.name}.tmp-{writers.token}"
        if writers.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        writers.barrier(f"creating {tmp}")
        try:
            self._fill(tmp, final, write, writers)
        except BaseException as exc:  # disk full, interrupted, ...: no half-written directory is left behind
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                where = f" ({exc.filename})" if exc.filename else ""
                reason = exc.strerror or str(exc)
                raise CheckpointError(
                    f"could not write checkpoint {final}: {reason}{where}; the partial checkpoint was removed "
                    f"and the earlier checkpoints are intact: free the space and continue with --resume"
                ) from None
            raise
        writers.barrier(f"renaming {final}")
        return final

    def _fill(self, tmp: Path, final: Path, write: Callable[[Path], Iterable[Path] | None], writers: Writers) -> None:
        """Writes the files, the manifest, and (rank 0) renames ``tmp`` to ``final``."""
        written = write(tmp)
        if written is None:
            if writers.size > 1:
                raise ValueError("with several writers, write() must return the files it wrote")
            written = _files(tmp)
        manifest = {}
        for path in sorted(Path(p) for p in written):
            manifest[str(path.relative_to(tmp))] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
            _fsync(path)
        parts = writers.all_gather_object(manifest, f"manifest of {final.name}")
        if writers.rank == 0:
            merged: dict[str, dict] = {}
            for rank, part in enumerate(parts):
                clash = sorted(set(merged) & set(part))
                if clash:
                    raise CheckpointError(f"{tmp}: rank {rank} wrote files another rank wrote too: {clash[:3]}")
                merged.update(part)
            (tmp / MANIFEST).write_text(json.dumps(merged, indent=1, sort_keys=True, allow_nan=False))
            _fsync(tmp / MANIFEST)
            if final.exists():  # re-running a round after a restart replaces its old checkpoint
                remove_tree(final)
            os.replace(tmp, final)
            self._prune()

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
            remove_tree(old)  # renamed away first: a kill never leaves a round_* directory without its manifest
        for stale in [*self.root.glob(".round_*.tmp-*"), *self.root.glob(".round_*.removing.*")]:
            shutil.rmtree(stale, ignore_errors=True)


BANK, OUTER = "bank", "outer"  # the parts every training checkpoint has: the modules, the outer optimizer
TRAINER_STATE, CONFIG = "trainer_state.pt", "config.yaml"
# Files a checkpoint's readers need whatever the run (the writer of rank 0 always writes them).
REQUIRED = (f"{BANK}.safetensors", f"{OUTER}.safetensors", TRAINER_STATE, CONFIG)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def read_manifest(ckpt: str | Path) -> dict[str, dict]:
    """The checkpoint's ``MANIFEST.json``, its structure checked: a JSON object mapping relative paths
    inside the checkpoint to ``{"sha256": 64 hex digits, "bytes": size}``. Raises CheckpointError."""
    manifest_path = Path(ckpt) / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{ckpt}: no {MANIFEST}; the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({exc})") from None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{manifest_path}: malformed manifest: {what}")

    if not isinstance(manifest, dict):
        raise bad(f"expected a JSON object of files, got {type(manifest).__name__}")
    for rel, entry in manifest.items():
        parts = rel.replace("\\", "/").split("/")
        if not rel or rel.startswith("/") or Path(rel).is_absolute() or any(p in ("", ".", "..") for p in parts):
            raise bad(f"{rel!r} is not a relative path inside the checkpoint")
        if rel == MANIFEST:
            raise bad(f"{rel!r} lists the manifest itself")
        if not isinstance(entry, dict) or set(entry) != {"sha256", "bytes"}:
            raise bad(f"{rel!r}: expected {{\"sha256\": ..., \"bytes\": ...}}, got {json.dumps(entry)[:80]}")
        if not isinstance(entry["sha256"], str) or not _SHA256.match(entry["sha256"]):
            raise bad(f"{rel!r}: sha256 is not 64 lowercase hex digits ({json.dumps(entry['sha256'])[:80]})")
        size = entry["bytes"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad(f"{rel!r}: bytes is not a non-negative integer ({json.dumps(size)[:80]})")
    return manifest


def verify(ckpt: str | Path, select: Callable[[str], bool] | None = None) -> None:
    """Raises CheckpointError naming the first missing, unlisted, truncated or corrupted file.

    ``select(relative_path)`` limits the check to the files a reader needs (default: all). Every
    such file in the directory must be listed in the manifest, and so must the files every reader
    needs (``REQUIRED``): a file the manifest does not vouch for is never read.
    """
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    wanted = select or (lambda rel: True)
    for rel in REQUIRED:
        if wanted(rel) and rel not in manifest:
            raise CheckpointError(f"{ckpt / rel}: not listed in {ckpt / MANIFEST}; the checkpoint cannot be trusted")
    for path in _files(ckpt):
        rel = path.relative_to(ckpt).as_posix()
        if wanted(rel) and rel not in manifest:
            raise CheckpointError(f"{path}: not listed in {ckpt / MANIFEST}; the checkpoint cannot be trusted")
    for rel, entry in manifest.items():
        if not wanted(rel):
            continue
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{path}: truncated or overwritten ({size} bytes, expected {entry['bytes']})")
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: corrupted (sha256 does not match the manifest)")


def resolve_checkpoint(
    manager: CheckpointManager, resume_from: str | Path | None = None, select: Callable[[str], bool] | None = None
) -> Path:
    """The checkpoint to resume from, verified (``select``: see :func:`verify`); a bad one names the previous one."""
    ckpt = Path(resume_from) if resume_from else manager.latest()
    if ckpt is None:
        raise CheckpointError(f"no checkpoint to resume from under {manager.root}")
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt}")
    try:
        verify(ckpt, select)
    except CheckpointError as exc:
        older = [p for p in manager.checkpoints() if p.name < ckpt.name]
        hint = f"; the previous checkpoint is {older[-1]} (resume with --resume-from {older[-1]})" if older else ""
        raise CheckpointError(f"{exc}{hint}") from None
    return ckpt


# --- the training state of a checkpoint -------------------------------------------------------------
def part_file(part: str) -> str:
    return f"{part}.safetensors"


def path_dir(root: Path, path: int) -> Path:
    return root / "paths" / f"path_{path:03d}"


def rank_dir(root: Path, rank: int) -> Path:
    """Where a writer puts its parts and trainer state: the checkpoint itself for rank 0."""
    return root if rank == 0 else root / "ranks" / f"rank_{rank:03d}"


def rank_files(root: Path, name: str) -> dict[int, Path]:
    """rank -> its ``name`` file, for every rank that wrote one (rank 0 first)."""
    found = {0: root / name} if (root / name).is_file() else {}
    ranks = root / "ranks"
    for d in sorted(ranks.glob("rank_*")) if ranks.is_dir() else []:
        if (d / name).is_file():
            found[int(d.name.split("_")[1])] = d / name
    return found


def load_selected(
    files: Iterable[Path], wanted: set[str], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The tensors named in ``wanted`` from whichever of ``files`` hold them; reads nothing else."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key in wanted and key not in out:
                        out[key] = f.get_tensor(key)
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    return out


def load_bank_state(root: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every module of a checkpoint's bank, whichever writer saved it."""
    out: dict[str, torch.Tensor] = {}
    for path in rank_files(root, part_file(BANK)).values():
        out.update(load_tensors(path, device))
    return out


@dataclass
class Snapshot:
    """One writer's share of a checkpoint, as the components hand it over."""

    parts: dict[str, dict[str, torch.Tensor]]  # part -> named tensors: bank, outer and the sync's parts
    state: dict  # trainer_state.pt: the index, RNG, placement, the scheduler's state
    paths: dict[int, tuple[Mapping[str, torch.Tensor], dict]] = field(default_factory=dict)  # path -> (params, inner)
    texts: dict[str, str] = field(default_factory=dict)  # file name -> text: the config and spec (rank 0's writer)


def write_snapshot(root: Path, rank: int, snapshot: Snapshot, index: int) -> list[Path]:
    """Fills one writer's share of a checkpoint directory; returns the files it wrote."""
    meta = {"round": str(index)}
    own = rank_dir(root, rank)
    written = []
    for part, tensors in snapshot.parts.items():
        written.append(own / part_file(part))
        save_tensors(tensors, written[-1], metadata=meta)
    for path, (params, inner) in snapshot.paths.items():
        save_tensors(params, path_dir(root, path) / "model.safetensors", metadata=meta)
        save_state(inner, path_dir(root, path) / "inner.pt")
        written += [path_dir(root, path) / "model.safetensors", path_dir(root, path) / "inner.pt"]
    save_state(snapshot.state, own / TRAINER_STATE)
    written.append(own / TRAINER_STATE)
    for name, text in snapshot.texts.items():
        (root / name).write_text(text)
        written.append(root / name)
    return written


class SavedCheckpoint:
    """A verified checkpoint as one rank reads it back (the sync's :class:`~dipaco.sync.base.SavedState`).

    ``same_placement``: whether the ranks train the same paths as when it was written."""

    def __init__(self, root: Path, rank: int = 0, device: torch.device | str = "cpu",
                 same_placement: bool = True) -> None:
        self.root, self.rank, self.device = Path(root), rank, torch.device(device)
        self.same_placement = same_placement

    def replicated(self, part: str, names: set[str]) -> dict[str, torch.Tensor]:
        """Tensors every holder has identical copies of (the bank, momentum), from whichever rank wrote them."""
        return load_selected(rank_files(self.root, part_file(part)).values(), names, self.device)

    def per_rank(self, part: str) -> dict[int, dict[str, torch.Tensor]]:
        """Every rank's own ``part`` (rank -> tensors), for state that is private to a rank."""
        return {r: load_tensors(path, self.device) for r, path in rank_files(self.root, part_file(part)).items()}

    def path(self, path: int) -> tuple[dict[str, torch.Tensor], dict]:
        """A path's saved parameters and inner-loop state."""
        directory = path_dir(self.root, path)
        return load_tensors(directory / "model.safetensors"), load_state(directory / "inner.pt")

    def state(self) -> dict:
        """The trainer state this rank wrote, else rank 0's."""
        own = rank_dir(self.root, self.rank) / TRAINER_STATE
        return load_state(own if own.is_file() else self.root / TRAINER_STATE)

    def every_state(self) -> list[dict]:
        """The trainer state of every rank that wrote one (rank 0 first)."""
        return [load_state(path) for path in rank_files(self.root, TRAINER_STATE).values()]

    @property
    def config(self) -> Path:
        return self.root / CONFIG
