"""SIGKILL `dipaco prepare` and `dipaco route` at every step of their work directory's removal, and fail every
write to `metrics.jsonl` with a full disk; the same command again must end as an uninterrupted run (issue 48).

    python scripts/crash_sweep.py --out docs/crash_sweep.json

Everything runs in a temporary directory on the tests' tiny setup (tests/dipaco/tiny.py: the BBC News slice, a
2-layer d=32 model, a 2x2 grid), each command in its own process, as a user would run it.

Cleanup kills. `dipaco prepare` (in a fresh run directory) and `dipaco route` (on a prepared and pretrained one)
run once uninterrupted, with a hook that counts the unlinks, rmdirs and renames done inside
`dipaco.atomic.remove_tree` (by the thread that called it): the removal of `prepare.work` and `routing.work`.
Then, for every k from 1 to that count, the same command starts from the same state with the hook set to
SIGKILL its own process just before the k-th of them, and runs again without the hook. The second run must
exit as the uninterrupted one did (0) and leave the same files under data/ and tokenizer/ (prepare) or
routing/ (route), byte for byte but for two things no two uninterrupted runs share either, which are left
out of the comparison (and the files that differed only there listed): the random `fingerprint` that
`datasets` writes into Arrow files and state.json, and in JSON files, fields that are durations or rates
(`time`, `*_s`, `*_seconds`). No work directory and no hidden leftover (`.NAME.removing.*`, `.NAME.tmp`,
`.NAME.old`, the prepare scratch directory) may remain.

Full disk on metrics.jsonl. `dipaco train` runs once uninterrupted per setup (`background`: the defaults,
background checkpoints every round; `every2_eval`: a checkpoint every 2 rounds, synchronous, and a validation
record every 2 rounds), counting its writes to metrics.jsonl (the logger's `os.write` calls). Then, for every
k, the k-th write fails with ENOSPC and the disk stays full for metrics.jsonl until the process ends (mode
`enospc`), or the k-th write is short, half its bytes landing, and the next one fails (mode `short`); the
command must fail (exit 2); `dipaco train --resume` without the failure must exit 0 and leave a metrics.jsonl
whose records, without their timing fields, equal the uninterrupted run's: each round's records exactly once,
in order, and no partial line.

``--kill-points`` and ``--write-points`` take that many points spread over each sweep (the first and last
included) instead of all of them; ``--setups``, ``--modes`` and ``--parts`` (``cleanup``, ``writes``) choose
what runs. The script exits 1 when any point does not match, or when a sweep finds no
point at all.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "dipaco"))

from dipaco import json_text  # noqa: E402

HOOK = "CRASH_SWEEP_HOOK"  # the child's hook, as JSON: {"kind": "kill" | "enospc", "at": k, "short": bool, "log": path}
CHILD = f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import crash_sweep; sys.exit(crash_sweep.child(sys.argv[1:]))"
WORK_DIRS = ("prepare.work", "routing.work")
OUTPUTS = {"prepare": ("data", "tokenizer"), "route": ("routing",)}
TRAIN_SETUPS = {
    "background": [],
    "every2_eval": ["train.checkpoint_every=2", "train.checkpoint_background=false", "eval.every=2",
                    "eval.max_docs=16"],
}
MODES = ("enospc", "short")
FINGERPRINT = re.compile(rb'"(_?fingerprint)": "[0-9a-f]+"')


# ---- the hooks, installed in the child process before dipaco's commands are imported -------------------------

def _install_kill_hook(at: int, log: Path) -> dict:
    """Counts the unlinks, rmdirs and renames that ``dipaco.atomic.remove_tree`` does (in the thread that called
    it); just before the ``at``-th, writes which one it is to ``log`` and SIGKILLs this process (0: never)."""
    import dipaco.atomic as atomic

    state: dict[str, Any] = {"ops": []}
    inside = threading.local()

    def counted(name: str):
        real = getattr(os, name)

        def op(*args, **kwargs):
            if getattr(inside, "depth", 0):
                state["ops"].append([name, *(os.fspath(a) for a in args)])
                if len(state["ops"]) == at:
                    log.write_text(json_text.dumps({**state, "killed_before": state["ops"][-1]}))
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return op

    for name in ("unlink", "remove", "rmdir", "rename", "replace"):
        setattr(os, name, counted(name))
    original = atomic.remove_tree

    def remove_tree(path):
        inside.depth = getattr(inside, "depth", 0) + 1
        try:
            original(path)
        finally:
            inside.depth -= 1

    # prepare.py and assign.py take the name at import: they are imported after this (see child)
    for module in list(sys.modules.values()):
        if getattr(module, "remove_tree", None) is original:
            module.remove_tree = remove_tree  # type: ignore[attr-defined]
    return state


def _install_enospc_hook(at: int, short: bool, log: Path) -> dict:
    """Counts the writes to metrics.jsonl (``os.write`` on a MetricsLogger's descriptor). The ``at``-th raises
    ENOSPC, or with ``short`` writes half its bytes; every later write there raises ENOSPC (0: never)."""
    import dipaco.metrics as metrics

    state: dict[str, Any] = {"writes": [], "injected": None}
    fds: set[int] = set()
    init, close, real_write = metrics.MetricsLogger.__init__, metrics.MetricsLogger.close, os.write

    def logger_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        fds.add(self._fd)

    def logger_close(self):
        fds.discard(self._fd)
        close(self)

    def full(what: str):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), what)

    def write(fd, data):
        if fd not in fds:
            return real_write(fd, data)
        if state["injected"] is not None:
            raise full("metrics.jsonl")
        state["writes"].append(len(data))
        if len(state["writes"]) != at:
            return real_write(fd, data)
        state["injected"] = {"write": at, "bytes": len(data), "landed": len(data) // 2 if short else 0}
        log.write_text(json_text.dumps(state))
        if short:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise full("metrics.jsonl")

    metrics.MetricsLogger.__init__ = logger_init  # type: ignore[method-assign]
    metrics.MetricsLogger.close = logger_close  # type: ignore[method-assign]
    os.write = write
    return state


def child(argv: list[str]) -> int:
    """`python -c CHILD COMMAND ARGS...`: `dipaco COMMAND ARGS...` with the hook ``$CRASH_SWEEP_HOOK`` installed;
    what the hook saw goes to its log when the command returns."""
    hook = json.loads(os.environ[HOOK])
    log = Path(hook["log"])
    if hook["kind"] == "kill":
        state = _install_kill_hook(hook["at"], log)
    else:
        state = _install_enospc_hook(hook["at"], hook["short"], log)
    from dipaco.cli import main

    rc = 1
    try:
        rc = main(argv)
        return rc
    finally:
        log.write_text(json_text.dumps({**state, "rc": rc}))


# ---- the sweep ---------------------------------------------------------------------------------------------------

def dipaco(args: list[str], env: dict, hook: dict | None = None) -> tuple[int, str]:
    """Runs `dipaco ARGS` (with ``hook``: through :func:`child`); its exit status (-9: SIGKILLed) and stderr's end."""
    cmd = [sys.executable, "-m", "dipaco", *args] if hook is None else [sys.executable, "-c", CHILD, *args]
    run_env = env if hook is None else {**env, HOOK: json_text.dumps(hook)}
    proc = subprocess.run(cmd, env=run_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc.returncode, proc.stderr[-2000:]


def spread(n: int, limit: int | None) -> list[int]:
    """1..n, or ``limit`` of them spread evenly (the first and the last included)."""
    if limit is None or limit >= n:
        return list(range(1, n + 1))
    if limit <= 1:
        return [1][:limit]
    return sorted({round(1 + i * (n - 1) / (limit - 1)) for i in range(limit)})


def is_timing(key: str) -> bool:
    return key == "time" or key.endswith(("_s", "_seconds"))


def without_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if not is_timing(k)}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def files(run_dir: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """Every file under ``run_dir/NAME`` for each name, by path relative to ``run_dir``."""
    found = {}
    for name in names:
        for path in sorted((run_dir / name).rglob("*")):
            if path.is_file():
                found[str(path.relative_to(run_dir))] = path.read_bytes()
    return found


def without_fingerprints(data: bytes) -> bytes:
    """``data`` with the random ids `datasets` writes into Arrow files' schemas and state.json (``fingerprint``,
    ``_fingerprint``: :func:`dipaco.data.reading.in_memory_dataset`) replaced by one placeholder."""
    return FINGERPRINT.sub(rb'"\1": "<random>"', data)


def compare_files(got: dict[str, bytes], want: dict[str, bytes]) -> tuple[list[str], list[str], list[str]]:
    """(what differs, the files equal once `datasets`' random fingerprints are left out, the JSON files equal once
    their timing fields are left out as well)."""
    differs = [f"missing {p}" for p in sorted(set(want) - set(got))] + [f"extra {p}" for p in sorted(set(got) - set(want))]
    fingerprint_only, timing_only = [], []
    for path in sorted(set(got) & set(want)):
        if got[path] == want[path]:
            continue
        a, b = without_fingerprints(got[path]), without_fingerprints(want[path])
        if a == b:
            fingerprint_only.append(path)
            continue
        if path.endswith(".json"):
            try:
                if without_timing(json.loads(a)) == without_timing(json.loads(b)):
                    timing_only.append(path)
                    continue
            except ValueError:
                pass
        differs.append(f"differs {path}")
    return differs, fingerprint_only, timing_only


def leftovers(run_dir: Path) -> list[str]:
    """Work directories and hidden temporaries (``.NAME.removing.*``, ``.NAME.tmp``, ``.NAME.old``) left in the
    run directory, and the prepare scratch directory beside it."""
    found = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
             if p.name in WORK_DIRS or p.name.startswith(".")]
    scratch = run_dir.parent / f".{run_dir.name}.prepare-scratch"
    return sorted(found) + ([scratch.name] if scratch.exists() else [])


def metrics_state(path: Path) -> tuple[list[dict] | None, str]:
    """The records of a metrics.jsonl without their timing fields (None when it cannot be read), and what is wrong
    with the file itself ("" when every line is a whole record)."""
    from dipaco.metrics import read_metrics

    if not path.is_file():
        return None, "no metrics.jsonl"
    text = path.read_text(encoding="utf-8")
    try:
        records = [without_timing(r) for r in read_metrics(path)]
    except Exception as exc:  # a line that is not a record
        return None, str(exc)
    problem = ""
    if text and not text.endswith("\n"):
        problem = "a partial last line"
    elif len([line for line in text.split("\n") if line.strip()]) != len(records):
        problem = "lines that are not records"
    return records, problem


def reset(run_dir: Path, names: tuple[str, ...]) -> None:
    """Removes ``names`` and everything hidden from ``run_dir`` (and the prepare scratch beside it)."""
    if not run_dir.exists():
        return
    for path in run_dir.iterdir():
        if path.name in names or path.name.startswith("."):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    shutil.rmtree(run_dir.parent / f".{run_dir.name}.prepare-scratch", ignore_errors=True)


def sweep_cleanup(command: str, run_dir: Path, args: list[str], env: dict, tmp: Path, limit: int | None) -> dict:
    """SIGKILL ``dipaco COMMAND`` before each unlink/rmdir/rename of its work directory's removal, then rerun it."""
    outputs = OUTPUTS[command]

    def start_over() -> None:  # prepare: a fresh run directory; route: the prepared and pretrained one, not routed
        reset(run_dir, (*outputs, *WORK_DIRS))
        if command == "prepare":
            shutil.rmtree(run_dir, ignore_errors=True)

    log = tmp / f"{command}.hook.json"
    start_over()
    started = time.perf_counter()
    rc_want, err = dipaco([command, *args], env, {"kind": "kill", "at": 0, "log": str(log)})
    seconds = time.perf_counter() - started
    if rc_want != 0:
        raise SystemExit(f"[crash_sweep] the uninterrupted `dipaco {command}` failed ({rc_want}):\n{err}")
    ops = json.loads(log.read_text())["ops"]
    want = files(run_dir, outputs)
    left = leftovers(run_dir)
    print(f"[crash_sweep] {command}: uninterrupted in {seconds:.1f} s, {len(want)} output files, "
          f"{len(ops)} unlinks/rmdirs/renames in remove_tree{f'; leftovers {left}' if left else ''}", flush=True)
    rows = []
    for k in spread(len(ops), limit):
        start_over()
        log.unlink(missing_ok=True)
        rc_killed, _ = dipaco([command, *args], env, {"kind": "kill", "at": k, "log": str(log)})
        killed = rc_killed == -signal.SIGKILL
        before = json.loads(log.read_text()).get("killed_before") if log.is_file() else None
        if before:  # paths relative to the run directory: the record names no temporary directory
            before = [a.replace(f"{run_dir}{os.sep}", "") for a in before]
        rc, err = dipaco([command, *args], env)
        differs, fingerprint_only, timing_only = compare_files(files(run_dir, outputs), want)
        left = leftovers(run_dir)
        same = killed and rc == rc_want and not differs and not left
        rows.append({"command": command, "point": k, "of": len(ops), "killed_before": before, "killed": killed,
                     "rerun_rc": rc, "differs": differs, "fingerprint_only": fingerprint_only,
                     "timing_only": timing_only, "leftovers": left, "matched": same})
        what = " ".join(before) if before else "(no kill)"
        print(f"  {command} kill {k}/{len(ops)} before {what}: rerun rc {rc}, {'identical' if same else 'MISMATCH'}"
              f"{f' (fingerprints aside: {len(fingerprint_only)} files' if fingerprint_only else ''}"
              f"{f'; timing fields aside: {timing_only}' if timing_only else ''}{')' if fingerprint_only else ''}"
              f"{f'; differs {differs[:5]}' if differs else ''}{f'; leftovers {left}' if left else ''}"
              f"{'' if killed else f'; not killed (rc {rc_killed})'}"
              f"{f'; {err.strip().splitlines()[-1]}' if rc and err.strip() else ''}", flush=True)
    return {"ops": len(ops), "uninterrupted_s": seconds, "output_files": len(want), "rows": rows}


def sweep_writes(setup: str, base: list[str], env: dict, tmp: Path, limit: int | None, modes: list[str]) -> dict:
    """Fail each write to metrics.jsonl of a `dipaco train` (ENOSPC, or short then ENOSPC), then --resume."""
    args = [*base, *TRAIN_SETUPS[setup]]
    exp_root = tmp / "run" / "train"
    log = tmp / f"train_{setup}.hook.json"
    started = time.perf_counter()
    rc, err = dipaco(["train", *args, f"train.name={setup}"], env,
                     {"kind": "enospc", "at": 0, "short": False, "log": str(log)})
    seconds = time.perf_counter() - started
    if rc != 0:
        raise SystemExit(f"[crash_sweep] the uninterrupted `dipaco train` ({setup}) failed ({rc}):\n{err}")
    writes = json.loads(log.read_text())["writes"]
    want, problem = metrics_state(exp_root / setup / "metrics.jsonl")
    assert want is not None and not problem, problem
    print(f"[crash_sweep] train {setup}: uninterrupted in {seconds:.1f} s, {len(want)} records in {len(writes)} "
          f"writes to metrics.jsonl", flush=True)
    rows = []
    for mode in modes:
        for k in spread(len(writes), limit):
            name = f"{setup}_{mode}_{k}"
            log.unlink(missing_ok=True)
            rc_failed, err_failed = dipaco(["train", *args, f"train.name={name}"], env,
                                           {"kind": "enospc", "at": k, "short": mode == "short", "log": str(log)})
            injected = json.loads(log.read_text()).get("injected") if log.is_file() else None
            rc, err = dipaco(["train", *args, f"train.name={name}", "--resume"], env)
            got, problem = metrics_state(exp_root / name / "metrics.jsonl")
            same = injected is not None and rc_failed == 2 and rc == 0 and got == want and not problem
            error = err_failed.strip().splitlines()[-1].replace(str(tmp), "W") if err_failed.strip() else ""
            rows.append({"setup": setup, "mode": mode, "write": k, "of": len(writes), "injected": injected,
                         "failed_rc": rc_failed, "failed_with": error, "resume_rc": rc,
                         "records": None if got is None else len(got), "file_problem": problem,
                         "records_equal": got == want, "matched": same})
            detail = "" if same else (f"; records {None if got is None else len(got)} of {len(want)}, equal {got == want}"
                                      f"{f', {problem}' if problem else ''}{f'; resume: {err.strip()[-300:]}' if rc else ''}")
            print(f"  train {setup} {mode} at write {k}/{len(writes)}: failed rc {rc_failed}, resumed rc {rc}, "
                  f"{'records identical' if same else 'MISMATCH'}{detail}", flush=True)
    return {"writes": len(writes), "records": len(want), "uninterrupted_s": seconds, "extra_overrides": TRAIN_SETUPS[setup],
            "rows": rows}


def sweep(args: argparse.Namespace) -> dict:
    from tiny import TINY, write_corpus_slice

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "dipaco")]),
           "OMP_NUM_THREADS": "1"}
    result: dict[str, Any] = {"command": " ".join(["python", "scripts/crash_sweep.py", *sys.argv[1:]]),
                              "rounds": args.rounds, "inner_steps": args.inner_steps, "cleanup": {}, "train": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        corpus = write_corpus_slice(tmp / "corpus.jsonl")
        run = [*TINY, f"data.corpus={corpus}", f"train.rounds={args.rounds}", f"train.inner_steps={args.inner_steps}",
               f"run.dir={tmp / 'run'}"]

        def plain(command: str) -> None:
            rc, err = dipaco([command, *run], env)
            if rc != 0:
                raise SystemExit(f"[crash_sweep] `dipaco {command}` failed ({rc}):\n{err}")

        # each point of the prepare sweep starts from an empty run directory and ends with a prepared one
        if "cleanup" in args.parts:
            result["cleanup"]["prepare"] = sweep_cleanup("prepare", tmp / "run", run, env, tmp, args.kill_points)
        else:
            plain("prepare")
        plain("pretrain")
        if "cleanup" in args.parts:
            result["cleanup"]["route"] = sweep_cleanup("route", tmp / "run", run, env, tmp, args.kill_points)
        else:
            plain("route")
        if "writes" in args.parts:
            for setup in args.setups:
                result["train"][setup] = sweep_writes(setup, run, env, tmp, args.write_points, args.modes)
    kills = [r for part in result["cleanup"].values() for r in part["rows"]]
    writes = [r for part in result["train"].values() for r in part["rows"]]
    result.update({"kill_points": len(kills), "kills_matched": sum(r["matched"] for r in kills),
                   "write_points": len(writes), "writes_matched": sum(r["matched"] for r in writes),
                   "wall_s": time.perf_counter() - started})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kill-points", type=int, help="per command, spread over its removal (default: every one)")
    parser.add_argument("--write-points", type=int, help="per setup and mode (default: every write)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--setups", nargs="+", choices=sorted(TRAIN_SETUPS), default=list(TRAIN_SETUPS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--parts", nargs="+", choices=["cleanup", "writes"], default=["cleanup", "writes"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = sweep(args)
    print(f"[crash_sweep] cleanup kills: {result['kills_matched']}/{result['kill_points']} identical to the "
          f"uninterrupted run; full disk on metrics.jsonl: {result['writes_matched']}/{result['write_points']} with "
          f"the uninterrupted run's records; {result['wall_s']:.0f} s")
    if args.out:
        args.out.write_text(json_text.dumps(result, indent=1) + "\n")
    empty = [part for part, points in (("cleanup", "kill_points"), ("writes", "write_points"))
             if part in args.parts and result[points] == 0]
    if empty:
        print(f"[crash_sweep] no point found in: {', '.join(empty)}")
    if empty or result["kills_matched"] != result["kill_points"] or result["writes_matched"] != result["write_points"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
