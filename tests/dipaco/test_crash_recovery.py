"""Killed mid-clean-up or out of disk, the same command again ends as an uninterrupted run (issue 48).

Each command runs in a process of its own, as a user runs it, with a fault from tests/dipaco/crash_hooks.py.

Kills during the clean-up: `dipaco prepare` (in a fresh run directory) and `dipaco route` (on a prepared and
pretrained one) run once uninterrupted, counting the unlinks, rmdirs and renames of ``prepare.work``'s and
``routing.work``'s removal. Then the same command starts from the same state, SIGKILLed just before the k-th of
them, and runs again: it must exit 0 and leave the same files under data/ and tokenizer/ (prepare) or routing/
(route), byte for byte but for what no two uninterrupted runs share either: the random ``fingerprint`` that
`datasets` writes into Arrow files and state.json, and JSON fields that are durations (``time``, ``*_s``,
``*_seconds``). No work directory and no hidden leftover may remain.

A full disk on metrics.jsonl: `dipaco train` runs once uninterrupted per setup, counting its writes to
metrics.jsonl. Then the k-th write fails with ENOSPC and the disk stays full for metrics.jsonl (``enospc``), or
lands half its bytes and the next one fails (``short``): the command must exit 2, and `dipaco train --resume`
must leave every record of the uninterrupted run (timing fields aside) exactly once, in order, every line whole.

``pytest --sweep full`` strikes at every point, in both setups and both modes (the figures in docs/results.md);
by default, the first and last kill of each clean-up and one short write of the default setup.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from crash_hooks import HOOK
from tiny import TINY, subprocess_env

from dipaco import json_text
from dipaco.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
WORK_DIRS = ("prepare.work", "routing.work")
OUTPUTS = {"prepare": ("data", "tokenizer"), "route": ("routing",)}
TRAIN_SETUPS = {
    "background": [],
    "every2_eval": ["train.checkpoint_every=2", "train.checkpoint_background=false", "eval.every=2",
                    "eval.max_docs=16"],
}
FINGERPRINT = re.compile(rb'"(_?fingerprint)": "[0-9a-f]+"')

pytestmark = pytest.mark.slow  # every point is a command or two, each in its own process


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "setup" in metafunc.fixturenames:
        full = metafunc.config.getoption("--sweep") == "full"
        metafunc.parametrize("setup", list(TRAIN_SETUPS) if full else ["background"])


def dipaco(args: list[str], hook: dict | None = None) -> tuple[int, str]:
    """`dipaco ARGS` (with ``hook``: through crash_hooks); its exit status (-9: SIGKILLed) and stderr's end."""
    env = subprocess_env(**({HOOK: json_text.dumps(hook)} if hook else {}))
    cmd = [sys.executable, "-m", "dipaco" if hook is None else "crash_hooks", *args]
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc.returncode, proc.stderr[-2000:]


def spread(n: int, limit: int | None) -> list[int]:
    """1..n, or ``limit`` of them spread evenly (the first and the last included)."""
    if limit is None or limit >= n:
        return list(range(1, n + 1))
    if limit <= 1:
        return [1][:limit]
    return sorted({round(1 + i * (n - 1) / (limit - 1)) for i in range(limit)})


def without_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if k != "time" and not k.endswith(("_s", "_seconds"))}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def files(run_dir: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """Every file under ``run_dir/NAME`` for each name, by path relative to ``run_dir``."""
    return {str(p.relative_to(run_dir)): p.read_bytes()
            for name in names for p in sorted((run_dir / name).rglob("*")) if p.is_file()}


def compare_files(got: dict[str, bytes], want: dict[str, bytes]) -> list[str]:
    """What differs, once `datasets`' random fingerprints and JSON files' timing fields are left out."""
    differs = [f"missing {p}" for p in sorted(set(want) - set(got))] + [f"extra {p}" for p in sorted(set(got) - set(want))]
    for path in sorted(set(got) & set(want)):
        a, b = (FINGERPRINT.sub(rb'"\1": "<random>"', x[path]) for x in (got, want))
        if a == b:
            continue
        if path.endswith(".json"):
            try:
                if without_timing(json.loads(a)) == without_timing(json.loads(b)):
                    continue
            except ValueError:
                pass
        differs.append(f"differs {path}")
    return differs


def leftovers(run_dir: Path) -> list[str]:
    """Work directories and hidden temporaries (``.NAME.removing.*``, ``.NAME.tmp``, ``.NAME.old``) in the run
    directory, and the prepare scratch directory beside it."""
    found = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name in WORK_DIRS or p.name.startswith(".")]
    scratch = run_dir.parent / f".{run_dir.name}.prepare-scratch"
    return sorted(found) + ([scratch.name] if scratch.exists() else [])


def metrics_state(path: Path) -> tuple[list[dict] | None, str]:
    """The records of a metrics.jsonl without their timing fields (None when it cannot be read), and what is wrong
    with the file itself ("" when every line is a whole record)."""
    if not path.is_file():
        return None, "no metrics.jsonl"
    text = path.read_text(encoding="utf-8")
    try:
        records = [without_timing(r) for r in read_metrics(path)]
    except Exception as exc:  # a line that is not a record
        return None, str(exc)
    if text and not text.endswith("\n"):
        return records, "a partial last line"
    if len([line for line in text.split("\n") if line.strip()]) != len(records):
        return records, "lines that are not records"
    return records, ""


def start_over(command: str, run_dir: Path) -> None:
    """prepare: no run directory; route: the prepared and pretrained one, its routing and hidden files removed."""
    if command == "prepare":
        shutil.rmtree(run_dir, ignore_errors=True)
    for path in run_dir.iterdir() if run_dir.exists() else ():
        if path.name in (*OUTPUTS[command], *WORK_DIRS) or path.name.startswith("."):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    shutil.rmtree(run_dir.parent / f".{run_dir.name}.prepare-scratch", ignore_errors=True)


def kill_sweep(command: str, args: list[str], run_dir: Path, limit: int | None) -> tuple[list[list[str]], list[str]]:
    """SIGKILL ``dipaco COMMAND`` before each unlink/rmdir/rename of its work directory's removal, then rerun it.
    (the operation each kill came before, the points whose rerun did not end as the uninterrupted run)."""
    log = run_dir.parent / f"{command}.hook.json"
    start_over(command, run_dir)
    rc, err = dipaco([command, *args], {"kind": "kill", "at": 0, "log": str(log)})
    assert rc == 0, f"the uninterrupted `dipaco {command}` failed ({rc}):\n{err}"
    ops, want = json.loads(log.read_text())["ops"], files(run_dir, OUTPUTS[command])
    assert not leftovers(run_dir), leftovers(run_dir)
    killed_before, failed = [], []
    for k in spread(len(ops), limit):
        start_over(command, run_dir)
        log.unlink(missing_ok=True)
        rc_killed, _ = dipaco([command, *args], {"kind": "kill", "at": k, "log": str(log)})
        before = json.loads(log.read_text()).get("killed_before") if log.is_file() else None
        killed_before.append([a.replace(f"{run_dir}{os.sep}", "") for a in before or []])
        rc, err = dipaco([command, *args])
        problems = compare_files(files(run_dir, OUTPUTS[command]), want) + leftovers(run_dir)
        print(f"{command} killed at {k}/{len(ops)} before {' '.join(killed_before[-1])}: rerun rc {rc} {problems[:5]}")
        if rc_killed != -signal.SIGKILL or rc != 0 or problems:
            failed.append(f"{k}/{len(ops)}: killed rc {rc_killed}, rerun rc {rc}, {problems[:5]} {err[-300:]}")
    return killed_before, failed


def test_prepare_killed_at_each_step_of_its_clean_up_then_rerun_ends_as_an_uninterrupted_run(run_cfg, full_sweep):
    args = [*TINY, f"data.corpus={run_cfg.data.corpus}", f"run.dir={Path(run_cfg.run.dir).parent / 'fresh'}"]
    killed_before, failed = kill_sweep("prepare", args, Path(run_cfg.run.dir).parent / "fresh", None if full_sweep else 2)
    assert not failed, failed
    assert len(killed_before) >= 2
    # the first kill came before the rename away (the work directory whole: the rerun resumed from it), the last
    # before the last rmdir of the renamed directory
    assert killed_before[0][0] == "rename" and killed_before[0][1].endswith("prepare.work")
    assert killed_before[-1][0] == "rmdir" and ".removing." in killed_before[-1][1]


def test_route_killed_at_each_step_of_its_clean_up_then_rerun_ends_as_an_uninterrupted_run(run_cfg, full_sweep):
    args = [*TINY, f"data.corpus={run_cfg.data.corpus}", f"run.dir={run_cfg.run.dir}"]
    killed_before, failed = kill_sweep("route", args, Path(run_cfg.run.dir), None if full_sweep else 2)
    assert not failed, failed
    assert killed_before[0][0] == "rename" and killed_before[0][1].endswith("routing.work")
    assert killed_before[-1][0] == "rmdir" and ".removing." in killed_before[-1][1]


def test_a_full_disk_on_metrics_fails_train_and_resume_keeps_every_record_once(run_cfg, full_sweep, setup):
    rounds = 4 if full_sweep else 2
    args = [*TINY, f"data.corpus={run_cfg.data.corpus}", f"run.dir={run_cfg.run.dir}", f"train.rounds={rounds}",
            *TRAIN_SETUPS[setup]]
    assert dipaco(["route", *args])[0] == 0
    log = Path(run_cfg.run.dir).parent / "train.hook.json"
    rc, err = dipaco(["train", *args, "train.name=straight"], {"kind": "enospc", "at": 0, "short": False, "log": str(log)})
    assert rc == 0, err
    writes = json.loads(log.read_text())["writes"]
    want, problem = metrics_state(Path(run_cfg.run.dir) / "train" / "straight" / "metrics.jsonl")
    assert want and not problem, problem
    failed = []
    for mode in ("enospc", "short") if full_sweep else ("short",):
        for k in spread(len(writes), None if full_sweep else 1):
            name = f"{mode}_{k}"
            log.unlink(missing_ok=True)
            rc_failed, err_failed = dipaco(["train", *args, f"train.name={name}"],
                                           {"kind": "enospc", "at": k, "short": mode == "short", "log": str(log)})
            injected = json.loads(log.read_text()).get("injected") if log.is_file() else None
            rc, err = dipaco(["train", *args, f"train.name={name}", "--resume"])
            got, problem = metrics_state(Path(run_cfg.run.dir) / "train" / name / "metrics.jsonl")
            print(f"{setup} {mode} at write {k}/{len(writes)}: failed rc {rc_failed}, resumed rc {rc}, "
                  f"records equal {got == want} {problem}")
            if not (injected and rc_failed == 2 and "No space left on device" in err_failed and rc == 0
                    and got == want and not problem):
                failed.append(f"{mode} at {k}/{len(writes)}: injected {injected}, rc {rc_failed} then {rc}, "
                              f"records equal {got == want} {problem}; {err_failed[-300:]} {err[-300:]}")
            if mode == "short":
                assert injected is None or injected["landed"] > 0
    assert not failed, failed


def test_the_record_comparison_finds_a_round_logged_twice_and_a_partial_line(tmp_path):
    good = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"event": "outer", "time": t, "round": r, "round_seconds": t}) + "\n"
             for r, t in ((1, 1.5), (2, 2.5))]
    good.write_text("".join(lines))
    want, problem = metrics_state(good)
    assert want == [{"event": "outer", "round": 1}, {"event": "outer", "round": 2}] and problem == ""
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join([lines[0], lines[0], lines[1]]))
    assert metrics_state(twice)[0] != want
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(lines) + lines[0][:10])
    assert metrics_state(partial) == (want, "a partial last line")


def test_files_differ_but_for_datasets_fingerprints_and_timing_fields():
    want = {"a.arrow": b'x{"fingerprint": "0123456789abcdef"}y', "r.json": b'{"inertia": 1.0, "wall_time_s": 2.0}',
            "b.bin": b"\x00\x01"}
    same = {"a.arrow": b'x{"fingerprint": "fedcba9876543210"}y', "r.json": b'{"inertia": 1.0, "wall_time_s": 3.0}',
            "b.bin": b"\x00\x01"}
    assert compare_files(same, want) == []
    other = {**same, "r.json": b'{"inertia": 1.5, "wall_time_s": 2.0}', "b.bin": b"\x00\x02"}
    assert compare_files(other, want) == ["differs b.bin", "differs r.json"]
    assert compare_files({"b.bin": b"\x00\x01"}, want) == ["missing a.arrow", "missing r.json"]
    assert spread(10, 2) == [1, 10] and spread(10, 4) == [1, 4, 7, 10] and spread(3, None) == [1, 2, 3]
