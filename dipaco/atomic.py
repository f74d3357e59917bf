"""Write to a temporary sibling, then rename: a reader sees the old content or the new, never half.

Every job that replaces a file or directory in a run goes through :func:`replacing`; checkpoints,
whose several writers share one temporary directory, have their own protocol in
:mod:`dipaco.checkpoint.store`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dipaco.errors import DipacoError


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def replacing(final: str | Path) -> Iterator[Path]:
    """Yields a temporary sibling path of ``final`` (nothing is created there): write the new file or
    directory at it. When the block succeeds it takes ``final``'s place, and an old directory is
    removed only after the swap; when the block fails, the temporary is removed and ``final`` is
    untouched."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    recover(final)
    _remove(tmp)
    try:
        yield tmp
    except BaseException as exc:
        _remove(tmp)
        if isinstance(exc, OSError):  # a full disk, a read-only directory: one line, nothing lost
            where = f" ({exc.filename})" if exc.filename else ""
            raise DipacoError(f"could not write {final}: {exc.strerror or exc}{where}; {final} is as it was "
                              f"before: free the space (or fix the permission) and run the command again") from None
        raise
    if final.is_dir() and not final.is_symlink():
        old = final.with_name(f".{final.name}.old")
        _remove(old)
        final.rename(old)
        tmp.rename(final)
        _remove(old)
    else:
        os.replace(tmp, final)


def recover(final: str | Path) -> Path:
    """``final`` as the last complete :func:`replacing` left it: a directory is swapped in two renames (the old
    one aside, the new one in), so a kill between them leaves only ``.NAME.old``; it is put back. Readers of a
    directory that is replaced whole call this first."""
    final = Path(final)
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.is_dir() and not old.is_symlink():
        old.rename(final)
    return final


def remove_tree(path: str | Path) -> None:
    """Removes the directory ``path`` so that a kill at any moment leaves it whole or gone, never half:
    it is renamed away in one step, then deleted. A work directory whose marker file outlived its data
    would be resumed from files that are not there; this order cannot leave one. What a killed removal
    left behind (``.NAME.removing.*`` beside it) is deleted by the next call."""
    path = Path(path)
    for leftover in path.parent.glob(f".{path.name}.removing.*"):
        shutil.rmtree(leftover, ignore_errors=True)
    if not path.is_dir():
        return
    doomed = path.with_name(f".{path.name}.removing.{uuid.uuid4().hex[:8]}")
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def write_text(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)
