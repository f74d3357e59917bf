"""Metrics: one JSON object per line in ``metrics.jsonl``, mirrored to TensorBoard when it is installed.

Every record has an ``event`` (e.g. ``pretrain``, ``path``, ``outer``, ``eval``) and a wall-clock
``time``; the JSONL file is the source of truth and is appended to, so a resumed run keeps its history.

A record is one ``write`` of one whole line to a file opened for appending. When the write fails
(a full disk), the file is cut back to where it was, so it never holds half a line, and the error
says so; a line cut by a crash (SIGKILL mid-write) is dropped when the file is opened again.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dipaco import json_text
from dipaco.errors import DataError, DipacoError


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional extra
        return None
    return SummaryWriter(log_dir=str(log_dir))


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        _drop_torn_line(self._fd)
        self._tb = _tensorboard_writer(Path(run_dir) / "tensorboard") if tensorboard else None
        self._pending: list[tuple[bytes, str, int | None, dict[str, Any]]] | None = None

    def log(self, event: str, step: int | None = None, **values: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **({"step": step} if step is not None else {}), **values}
        line = (json_text.dumps(record, default=_jsonable) + "\n").encode("utf-8")
        if self._pending is not None:  # inside together(): written with the others
            self._pending.append((line, event, step, values))
            return
        self._append(line)
        if self._tb is not None and step is not None:
            self._log_scalars(event, step, values)

    @contextmanager
    def together(self) -> Iterator[None]:
        """The records logged inside are appended in one write, all or none: a round's records, so that a
        full disk cannot leave some of them (a resumed run, seeing the round's ``outer`` record, would never
        log the rest, and one that did not would log the others twice)."""
        if self._pending is not None:
            yield
            return
        self._pending = []
        try:
            yield
            pending = self._pending
        finally:
            self._pending = None
        self._append(b"".join(line for line, *_ in pending))
        for _, event, step, values in pending:
            if self._tb is not None and step is not None:
                self._log_scalars(event, step, values)

    def _append(self, data: bytes) -> None:
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            os.ftruncate(self._fd, end)  # no half line: the log is as it was before these records
            raise DipacoError(f"could not append to {self.path}: {exc.strerror or exc}; it is as it was before "
                              f"these records: free the space and continue with --resume") from None

    def _log_scalars(self, prefix: str, step: int, values: dict[str, Any]) -> None:
        assert self._tb is not None
        suffix = f"/path{values['path']}" if "path" in values else ""
        for key, value in values.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        self._tb.add_scalar(f"{prefix}/{key}/{sub}", v, step)
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "path":
                self._tb.add_scalar(f"{prefix}/{key}{suffix}", value, step)

    def close(self) -> None:
        os.close(self._fd)
        if self._tb is not None:
            self._tb.close()


def _drop_torn_line(fd: int) -> None:
    """Cuts the file back to just after its last newline: a record a crash cut in the middle is dropped."""
    size = keep = os.lseek(fd, 0, os.SEEK_END)
    while keep > 0:
        start = max(0, keep - (1 << 16))
        newline = os.pread(fd, keep - start, start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        keep = start
    if keep != size:
        os.ftruncate(fd, keep)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def echo(message: str) -> None:
    """Prints a line without breaking any live tqdm bar."""
    tqdm.write(message)


def read_metrics(path: str | Path, event: str | None = None) -> list[dict]:
    """The records of a ``metrics.jsonl`` (of ``event`` only, if given). A last line without its newline
    (a write a crash cut) is left out; any other line that is not a JSON object is an error naming it."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    complete = lines[:-1]  # the last element is "" for a file ending in a newline, else a torn record
    records = []
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise DataError(f"{path}:{number}: not a JSON record ({line[:60]!r})") from None
        if not isinstance(record, dict) or "event" not in record:
            raise DataError(f"{path}:{number}: not a metrics record ({line[:60]!r})")
        records.append(record)
    return [r for r in records if event is None or r["event"] == event]
