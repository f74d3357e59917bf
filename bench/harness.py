"""The one harness every benchmark of :mod:`bench` runs on (issue 60).

Each benchmark once carried its own copy of these: a results writer, a table printer, a resume scheme,
a row syntax and a record of the machine. Written once here, a fix (an atomic write, NaN kept out of the
JSON) reaches every benchmark, and two benchmarks' files describe their machine in the same words.

* :func:`environment`: python, torch, threads, cpu count, platform, device name, date, git commit;
* :func:`write_json`: strict JSON (:mod:`dipaco.json_text`: NaN becomes null, with the reason beside it),
  written atomically (:mod:`dipaco.atomic`: a reader or a kill never leaves half a file);
* :class:`Results`: a results file of named rows, each with the settings it ran with; ``--resume`` keeps a
  row finished with the same settings and reruns one whose settings changed;
* :func:`parse_row`: the row syntax ``ROW@key=value@key=value`` (a row with extra dipaco overrides);
* :func:`markdown_table`: the table every benchmark prints;
* :func:`argument_parser` and :func:`command_line`: the ``python -m bench NAME`` a result records.

Nothing here imports torch at module level: ``python -m bench`` lists the benchmarks without it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import socket
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dipaco import atomic, json_text

REPO = Path(__file__).resolve().parents[1]
ROW_SEPARATOR = "@"


# ----------------------------------------------------------------------------- the command line


def argument_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of benchmark ``name``: its usage line names ``python -m bench NAME`` (the command that runs it)
    and its help is the module docstring as written (its command examples keep their line breaks)."""
    return argparse.ArgumentParser(prog=f"python -m bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line(name: str, argv: Sequence[str]) -> str:
    """The command that reproduces this run, as a result records it: ``python -m bench NAME ARGS`` (shell-quoted)."""
    return shlex.join(["python", "-m", "bench", name, *argv])


# ----------------------------------------------------------------------------- the machine


def git_commit(repo: Path = REPO) -> str | None:
    """The checked-out commit, with ``+dirty`` when tracked files differ from it; None outside a git checkout
    (a figure from an unknown tree says so rather than naming a commit it may not be)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def device_name(device: str | None = None) -> str:
    """The device a figure was measured on, in words: the CUDA device's name for ``cuda[:N]``, else
    ``cpu (<machine>)``. ``None`` means what ``run.device=auto`` picks: CUDA when there is one."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.device(device)
    if where.type == "cuda":
        return torch.cuda.get_device_name(where)
    return f"{where.type} ({platform.machine()})"


def environment(device: str | None = None) -> dict[str, Any]:
    """Where and with what a figure was measured; every benchmark records this under ``environment``.

    ``device``: the device the benchmark ran on (see :func:`device_name`); threads are torch's intra-op
    threads at the time of the call, so call it after the benchmark has set them."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }


# ----------------------------------------------------------------------------- writing results


def process_tree(pid: int) -> set[int]:
    """``pid`` and its living descendants, from /proc (Linux): a server with its router process, a job with its
    workers."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the comm field may hold spaces: ppid is the second field after its closing ')'
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we read
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parent_of.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return tree


def free_port() -> int:
    """A TCP port free on loopback now: for a server a benchmark starts, or a job's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_json(path: str | Path, value: Any, indent: int | None = 1, default: Callable[[Any], Any] | None = None) -> Path:
    """``value`` as strict JSON at ``path``, written atomically; the parent directory is created.

    Strict: a NaN or infinity is written as null with ``<key>_null_reason`` beside it, so jq and strict
    parsers read every file. Atomic: written to a sibling and renamed, so a kill mid-write leaves the
    previous file whole (an interrupted benchmark loses at most the row in progress). ``default``: as
    ``json.dumps`` takes it, for values JSON has no type for."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, json_text.dumps(value, indent=indent, default=default) + "\n")
    return path


def settings_key(settings: Mapping[str, Any]) -> str:
    """A stable short hash of JSON-able ``settings``: equal for equal settings whatever their key order.

    The text hashed is ``json.dumps(settings, sort_keys=True)`` (non-finite numbers as null), so keys
    recorded before the harness (scripts/bench_scale.py's ``settings_hash``) stay valid."""
    text = json_text.dumps(dict(settings), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ResultsFileError(ValueError):
    """A results file that cannot be resumed from (not JSON, or not a results file): named, never overwritten."""


class Results:
    """A benchmark's results file: top-level fields (``meta``) and rows by name, each with its settings.

    A row is stored as ``{"name": ROW, "settings": {...}, "settings_key": KEY, **record}``, in the order
    the rows were first put (a rerun row keeps its place). With ``resume`` (:meth:`load`), a row already
    in the file with the same settings is kept and :meth:`has` says so, so the benchmark skips it; a row
    whose settings changed does not match and runs again, replacing the old one. Without ``resume``
    the file starts empty and is overwritten at the first :meth:`write`.
    """

    def __init__(self, path: str | Path, benchmark: str, meta: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.benchmark = benchmark
        self.meta: dict[str, Any] = dict(meta or {})
        self._rows: dict[str, dict[str, Any]] = {}

    @classmethod
    def load(cls, path: str | Path, benchmark: str, resume: bool) -> Results:
        """The results at ``path`` when ``resume`` and the file exists, else an empty set for ``path``."""
        results = cls(path, benchmark)
        if not resume or not results.path.is_file():
            return results
        try:
            payload = json.loads(results.path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ResultsFileError(f"cannot resume from {results.path}: not JSON ({exc}); move it away or run "
                                   f"without --resume") from None
        rows = payload.get("rows") if isinstance(payload, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in rows):
            raise ResultsFileError(f"cannot resume from {results.path}: it has no list of named rows "
                                   f"(not a results file of `python -m bench {benchmark}`)")
        if payload.get("benchmark") not in (None, benchmark):
            raise ResultsFileError(f"cannot resume from {results.path}: it holds the results of "
                                   f"{payload['benchmark']!r}, not of {benchmark!r}")
        results.meta = {k: v for k, v in payload.items() if k not in ("benchmark", "rows")}
        results._rows = {r["name"]: r for r in rows}
        return results

    def has(self, row: str, settings: Mapping[str, Any]) -> bool:
        """Whether ``row`` is here, finished with these ``settings`` (a resumed run skips it)."""
        found = self._rows.get(row)
        return found is not None and found.get("settings_key") == settings_key(settings)

    def get(self, row: str) -> dict[str, Any] | None:
        """The stored record of ``row`` (with its name and settings), or None."""
        return self._rows.get(row)

    def put(self, row: str, settings: Mapping[str, Any], record: Mapping[str, Any]) -> dict[str, Any]:
        """Stores ``record`` as ``row``'s result with the ``settings`` it ran with, replacing an older one in
        its place; returns the stored row. Call :meth:`write` to save it."""
        clash = {"name", "settings", "settings_key"} & set(record)
        if clash:
            raise ValueError(f"row {row!r}: its record may not hold {sorted(clash)} (the harness writes them)")
        stored = {"name": row, "settings": dict(settings), "settings_key": settings_key(settings), **record}
        self._rows[row] = stored
        return stored

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every stored row, in order."""
        return list(self._rows.values())

    def sort(self, key: Callable[[dict[str, Any]], Any]) -> None:
        """Reorders the rows (a table's order rather than the order they ran in)."""
        self._rows = {r["name"]: r for r in sorted(self._rows.values(), key=key)}

    def payload(self) -> dict[str, Any]:
        """What :meth:`write` writes: the benchmark's name, its top-level fields, then the rows."""
        return {"benchmark": self.benchmark, **self.meta, "rows": self.rows}

    def write(self) -> Path:
        """Saves every row (strict JSON, atomic: see :func:`write_json`); call it after each row."""
        return write_json(self.path, self.payload())


# ----------------------------------------------------------------------------- rows


class RowSyntaxError(ValueError):
    """A row name that is not ``ROW`` or ``ROW@key=value@key=value``."""


def parse_row(name: str) -> tuple[str, list[str]]:
    """``ROW@key=value@key=value`` as ``(ROW, ["key=value", "key=value"])``: a benchmark row with extra
    dipaco overrides on top of its own (a sweep of one setting). A plain ``ROW`` has none.

    Raises :class:`RowSyntaxError` naming the part at fault: an empty row, an empty part (``ROW@``,
    ``ROW@@k=v``) or a part that is not ``key=value`` (``ROW@key``)."""
    base, *extra = name.split(ROW_SEPARATOR)
    if not base:
        raise RowSyntaxError(f"row {name!r}: no row name before {ROW_SEPARATOR!r} (ROW@key=value@key=value)")
    for part in extra:
        key, equals, _ = part.partition("=")
        if not equals or not key.strip():
            raise RowSyntaxError(f"row {name!r}: {part!r} is not key=value (ROW@key=value@key=value)")
    return base, extra


def unknown_rows(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """The names in ``names`` that do not parse, or whose row is not in ``known``: a benchmark checks its
    ``--rows`` with this before it runs anything."""
    known = set(known)
    bad = []
    for name in names:
        try:
            base, _ = parse_row(name)
        except RowSyntaxError:
            bad.append(name)
            continue
        if base not in known:
            bad.append(name)
    return bad


def safe_name(row: str) -> str:
    """``row`` as a plain directory or experiment name: ``ROW@key=value`` holds ``@``, ``=`` and maybe ``/``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", row)


# ----------------------------------------------------------------------------- tables

Cell = Callable[[Mapping[str, Any]], Any]
Column = tuple[str, "str | Cell"]  # (header, a key of the row or a function of the row)


def _cell(value: Any) -> str:
    """A table cell: None is ``-``; a ``|`` is escaped so it cannot split the cell."""
    return "-" if value is None else str(value).replace("|", "\\|")


def markdown_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """The rows as a markdown table, one column per ``(header, cell)``: ``cell`` is a key of the row (its value
    as text, ``-`` when absent or None) or a function of the row returning the cell (formatting is the caller's)."""
    if not columns:
        raise ValueError("markdown_table: no columns")
    lines = ["| " + " | ".join(_cell(header) for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [cell(row) if callable(cell) else row.get(cell) for _, cell in columns]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)
