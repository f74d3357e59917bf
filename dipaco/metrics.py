"""Metrics: one JSON object per line in ``metrics.jsonl``, mirrored to TensorBoard when it is installed.

Every record has an ``event`` (e.g. ``pretrain``, ``path``, ``outer``, ``eval``) and a wall-clock
``time``; the JSONL file is the source of truth and is appended to, so a resumed run keeps its history.

A record is one ``write`` of one whole line to a file opened for appending. When the write fails
(a full disk), the file is cut back to where it was, so it never holds half a line, and the error
says so; a line cut by a crash (SIGKILL mid-write) is dropped when the file is opened again.

With ``metrics.wandb=true`` every record also goes to Weights & Biases (the ``wandb`` extra, imported only
then). A job opens one W&B run (:func:`tracking`, entered by the composition root around `dipaco train`
and `dipaco pretrain`), with the resolved config as its config; every logger the job creates, on the
process that writes ``metrics.jsonl`` (rank 0, the Ray driver), mirrors its records there. A record
``{"event": E, "step": S, K: V}`` is logged as ``E/K`` (``E/K/pathP`` for a path's record, ``E/K/SUB`` for a
dict), with ``E/step`` = S as that event's x-axis: events count steps differently (pretraining steps,
path steps, rounds), and W&B's own step must only grow. A resumed job continues the W&B run it started.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dipaco import json_text
from dipaco.config import MetricsConfig
from dipaco.errors import ConfigError, DataError, DipacoError


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional extra
        return None
    return SummaryWriter(log_dir=str(log_dir))


# --- Weights & Biases ------------------------------------------------------------------------------------
WANDB_TAG_CHARS = 64  # W&B refuses longer tags


def check_metrics(section: MetricsConfig) -> None:
    """The ``metrics`` section."""
    if not section.wandb_project.strip():
        raise ConfigError("metrics.wandb_project: must not be empty")
    if section.wandb_run_name is not None and not section.wandb_run_name.strip():
        raise ConfigError("metrics.wandb_run_name: must not be empty (null: <job>/<experiment>)")
    for tag in section.wandb_tags:
        if not tag.strip() or len(tag) > WANDB_TAG_CHARS:
            raise ConfigError(f"metrics.wandb_tags: each tag must be 1 to {WANDB_TAG_CHARS} characters, got {tag!r}")


@dataclass(frozen=True)
class WandbRun:
    """The W&B run of one job: ``metrics`` names it; ``config`` is the resolved config it records;
    ``id_file`` keeps its id, so that ``resume`` continues the same W&B run."""

    metrics: MetricsConfig
    name: str  # the run name when metrics.wandb_run_name is null
    config: Mapping[str, Any]
    dir: Path  # W&B writes its files under <dir>/wandb, unless WANDB_DIR says where
    id_file: Path
    resume: bool = False


class _WandbSink:
    """One W&B run, started by the first logger that needs it: a rank that writes no metrics starts none."""

    def __init__(self, spec: WandbRun) -> None:
        self.spec = spec
        self._run: Any = None
        self._axes: set[str] = set()
        self._lock = threading.Lock()

    def _started(self) -> Any:
        if self._run is None:
            import wandb

            spec, section = self.spec, self.spec.metrics
            run_id = None
            if spec.resume and spec.id_file.is_file():
                run_id = spec.id_file.read_text(encoding="utf-8").strip() or None
            if run_id is None:
                # W&B's own id format (8 lowercase letters and digits), made here: wandb's helper moved between releases
                run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
                spec.id_file.parent.mkdir(parents=True, exist_ok=True)
                spec.id_file.write_text(run_id + "\n", encoding="utf-8")
            self._run = wandb.init(
                project=section.wandb_project, name=section.wandb_run_name or spec.name, tags=list(section.wandb_tags),
                config=dict(spec.config), mode=section.wandb_mode, id=run_id, resume="allow",
                # the console is not captured: the records are what is logged, and tqdm's bars would garble its copy
                dir=os.environ.get("WANDB_DIR") or str(spec.dir), settings=wandb.Settings(console="off"))
        return self._run

    def log(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        data = dict(_scalars(event, values))
        if step is not None:
            data[f"{event}/step"] = step
        if not data:
            return
        with self._lock:  # the Ray driver's scheduler and checkpoint threads may log at once
            run = self._started()
            if step is not None and event not in self._axes:  # each event on its own x-axis
                run.define_metric(f"{event}/step")
                run.define_metric(f"{event}/*", step_metric=f"{event}/step")
                self._axes.add(event)
            run.log(data)

    def finish(self, failed: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


_sink: _WandbSink | None = None  # the job's W&B run, while tracking() is entered


@contextmanager
def tracking(spec: WandbRun | None) -> Iterator[None]:
    """The job's W&B run (``spec``: None, or ``metrics.wandb=false``: none): every :class:`MetricsLogger`
    created inside mirrors its records there; the run is finished when the job ends, failed or not."""
    global _sink
    if spec is None or not spec.metrics.wandb:
        yield
        return
    try:  # before the job starts, not at its first record
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("metrics.wandb=true needs the wandb package: pip install 'dipaco[wandb]' "
                          "(or set metrics.wandb=false)") from None
    if _sink is not None:
        raise DipacoError("a W&B run is already open in this process: jobs with metrics.wandb=true run one at a time")
    _sink = _WandbSink(spec)
    failed = True
    try:
        yield
        failed = False
    finally:
        sink, _sink = _sink, None
        sink.finish(failed)


def _scalars(prefix: str, values: dict[str, Any]) -> Iterator[tuple[str, float | int]]:
    """A record's numbers as TensorBoard and W&B name them: ``prefix/key`` (``/pathP`` for a path's record),
    ``prefix/key/sub`` for a dict's finite ones; strings and lists are left out."""
    suffix = f"/path{values['path']}" if "path" in values else ""
    for key, value in values.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    yield f"{prefix}/{key}/{sub}", v
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "path":
            yield f"{prefix}/{key}{suffix}", value


# --- the logger ------------------------------------------------------------------------------------------
class MetricsLogger:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        _drop_torn_line(self._fd)
        self._tb = _tensorboard_writer(Path(run_dir) / "tensorboard") if tensorboard else None
        self._wandb = _sink  # the job's W&B run, if it has one (see tracking())
        self._pending: list[tuple[bytes, str, int | None, dict[str, Any]]] | None = None

    def log(self, event: str, step: int | None = None, **values: Any) -> None:
        record = {"event": event, "time": round(time.time(), 3), **({"step": step} if step is not None else {}), **values}
        line = (json_text.dumps(record, default=_jsonable) + "\n").encode("utf-8")
        if self._pending is not None:  # inside together(): written with the others
            self._pending.append((line, event, step, values))
            return
        self._append(line)
        self._mirror(event, step, values)

    def _mirror(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        """A record written to metrics.jsonl, to the other sinks: TensorBoard (records with a step) and W&B."""
        if self._tb is not None and step is not None:
            self._log_scalars(event, step, values)
        if self._wandb is not None:
            self._wandb.log(event, step, values)

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
            self._mirror(event, step, values)

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
        for tag, value in _scalars(prefix, values):
            self._tb.add_scalar(tag, value, step)

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
