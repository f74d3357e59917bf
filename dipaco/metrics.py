"""Metrics: one JSON object per line in ``metrics.jsonl``, mirrored to TensorBoard when it is installed.

Every record has an ``event`` (e.g. ``pretrain``, ``path``, ``outer``, ``eval``) and a wall-clock
``time``; the JSONL file is the source of truth and is appended to, so a resumed run keeps its history.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional extra
        return None
    return SummaryWriter(log_dir=str(log_dir))


class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = _tensorboard_writer(Path(run_dir) / "tensorboard") if tensorboard else None

    def log(self, event: str, step: int | None = None, **values: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **({"step": step} if step is not None else {}), **values}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()
        if self._tb is not None and step is not None:
            self._log_scalars(event, step, values)

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
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def echo(message: str) -> None:
    """Prints a line without breaking any live tqdm bar."""
    tqdm.write(message)


def read_metrics(path: str | Path, event: str | None = None) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if event is None or r["event"] == event]
