"""Lock-step training across two sites (network namespaces with a shaped link each, bench.netns): torchrun one
node per site with the elastic c10d rendezvous, one site cut mid-round, the survivor continuing alone, the
site back as a late joiner that takes its paths again, and the final bank against a single process (issue 72).

Needs root (CI runs as root); a machine that cannot make namespaces skips with the reason."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from bench.netns import PROFILES, Sites, unavailable
from dipaco.checkpoint.store import load_bank_state
from dipaco.config import save_config
from dipaco.metrics import read_metrics

REPO = Path(__file__).resolve().parents[3]
ROUNDS = 16  # enough left after the cut for a new torchrun to start and join while the survivor trains
# round_timeout_min_s: a lost site is noticed within 10 s of its last beat here, not 60 (the default)
TRAIN = ("train.name=sites", f"train.rounds={ROUNDS}", "train.inner_steps=20", "dist.timeout_s=120",
         "dist.round_timeout_min_s=10")
RDZV = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]


def _start(sites: Sites, i: int, cfg_file: Path, log: Path) -> subprocess.Popen:
    cmd = sites.torchrun(i, ["-m", "dipaco", "train", "--config", str(cfg_file), *TRAIN], nnodes="1:2", job="sites",
                         rdzv_conf=RDZV)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **sites.environment(i)}
    with log.open("w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {log.name} within {timeout:g}s:\n{log.read_text(errors='replace')[-4000:]}")


def _errors(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error:")]


def test_a_cut_site_is_named_the_survivor_continues_and_the_site_rejoins(prepared_run, tmp_path):
    shutil.copytree(prepared_run.run.dir, tmp_path / "run")
    cfg = replace(prepared_run, run=replace(prepared_run.run, dir=str(tmp_path / "run")))
    save_config(cfg, tmp_path / "cfg.yaml")
    logs = [tmp_path / "site0.log", tmp_path / "site1.log", tmp_path / "site1_again.log"]
    with Sites(2, PROFILES["wan"]) as sites:
        procs = [_start(sites, 0, tmp_path / "cfg.yaml", logs[0]), _start(sites, 1, tmp_path / "cfg.yaml", logs[1])]
        try:
            _wait_for(logs[0], "round 2/", procs[0])
            sites.cut(1)  # mid-round 3 or 4: packets vanish, no connection is reset
            _wait_for(logs[0], "lost rank 1", procs[0])
            _wait_for(logs[0], "restart 1 of the worker group", procs[0])
            _wait_for(logs[1], "lost contact", procs[1])
            sites.kill(1)  # what is left on the site (its agent, waiting on a store it cannot reach); a new one starts
            sites.restore(1)
            procs.append(_start(sites, 1, tmp_path / "cfg.yaml", logs[2]))
            procs[0].wait(timeout=300)
        finally:
            for proc in procs:
                _kill(proc)
    site0 = logs[0].read_text(errors="replace")
    assert procs[0].returncode == 0, site0[-4000:]

    # one line each, naming the lost rank (site 0) or saying this site is the one cut off (site 1)
    lost = [e for e in _errors(logs[0]) if "lost rank 1" in e]
    assert len(lost) == 1 and "wait at most 10s" in lost[0], _errors(logs[0])
    assert any("lost contact" in e and "does not answer" in e for e in _errors(logs[1])), _errors(logs[1])
    # two ranks at the start, one after the cut, two again once the site rejoined
    placements = [line for line in site0.splitlines() if line.startswith("[train] sites:")]
    assert ["rank 1: paths" in line for line in placements] == [True, False, True], placements

    exp = tmp_path / "run" / "train" / "sites"
    outer = Counter(r["round"] for r in read_metrics(exp / "metrics.jsonl", "outer"))
    assert outer == Counter(range(1, ROUNDS + 1)), outer  # every round logged once
    last = [r for r in read_metrics(exp / "metrics.jsonl", "comm") if r["round"] == ROUNDS]
    assert sorted(r["rank"] for r in last) == [0, 1]

    single = subprocess.run([sys.executable, "-m", "dipaco", "train", "--config", str(tmp_path / "cfg.yaml"),
                             *TRAIN[1:], "train.name=single"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    ours = load_bank_state(exp / "checkpoints" / f"round_{ROUNDS:06d}")
    alone = load_bank_state(tmp_path / "run" / "train" / "single" / "checkpoints" / f"round_{ROUNDS:06d}")
    assert ours.keys() == alone.keys()
    worst = max(float((ours[k] - alone[k]).abs().max()) for k in ours)
    # fp32 sums in another order at each change of ranks, carried through 16 rounds of AdamW and Nesterov: the
    # guide's 1e-6 holds for a few rounds; CI saw 1.6e-6 here once. A lost or doubled round is orders larger.
    assert worst <= 1e-5, worst
