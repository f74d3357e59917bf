"""train.checkpoint_background and train.checkpoint_every (issue 48): the same checkpoints, fewer of them,
every round's records logged exactly once."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import TINY, subprocess_env

from dipaco.checkpoint.compare import checkpoint_tensors
from dipaco.checkpoint.store import CheckpointManager
from dipaco.cli import main
from dipaco.metrics import read_metrics
from dipaco.run import Run, apply_overrides

REPO = Path(__file__).resolve().parents[3]


def outer_rounds(exp_dir: Path) -> list[int]:
    return [r["round"] for r in read_metrics(exp_dir / "metrics.jsonl", "outer")]


def test_background_checkpoints_equal_the_synchronous_ones(run_cfg):
    cfg = apply_overrides(run_cfg, ["train.rounds=3"])
    sync = Run(apply_overrides(cfg, ["train.name=sync", "train.checkpoint_background=false"])).train()
    background = Run(apply_overrides(cfg, ["train.name=background"])).train()
    for a, b in zip(sync.checkpoints.checkpoints(), background.checkpoints.checkpoints(), strict=True):
        ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
        assert a.name == b.name and set(ta) == set(tb)
        assert all(torch.equal(ta[k], tb[k]) for k in ta), a.name
    assert outer_rounds(sync.dir) == outer_rounds(background.dir) == [1, 2, 3]


def test_checkpoint_every_two_rounds_writes_the_last_and_logs_every_round_once(run_cfg):
    cfg = apply_overrides(run_cfg, ["train.rounds=3", "train.checkpoint_every=2", "train.keep_checkpoints=5"])
    exp = Run(cfg).train()
    assert [p.name for p in exp.checkpoints.checkpoints()] == ["round_000002", "round_000003"]
    assert outer_rounds(exp.dir) == [1, 2, 3]
    straight = Run(apply_overrides(cfg, ["train.name=straight", "train.checkpoint_every=1"])).train()
    a = checkpoint_tensors(CheckpointManager(exp.dir / "checkpoints").latest())
    b = checkpoint_tensors(CheckpointManager(straight.dir / "checkpoints").latest())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rounds_a_checkpoint_covers_are_logged_on_resume_when_a_kill_came_before_their_log(run_cfg):
    """A kill between a checkpoint and its log: the resumed run logs every round the checkpoint covers."""
    cfg = apply_overrides(run_cfg, ["train.rounds=3", "train.checkpoint_every=2"])
    exp = Run(cfg).train(until_round=2)
    assert outer_rounds(exp.dir) == [1, 2]
    (exp.dir / "metrics.jsonl").write_text("")  # as if killed after round_000002 landed, before its records
    resumed = Run(cfg).train(resume=True)
    assert outer_rounds(resumed.dir) == [1, 2, 3]


def train_process(args: list[str]) -> subprocess.Popen:
    env = subprocess_env()
    return subprocess.Popen([sys.executable, "-m", "dipaco", "train", *args], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 120
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)


def test_sigkill_at_random_moments_of_the_background_writes_then_resume_ends_bit_exactly(run_cfg, full_sweep):
    """`dipaco train` SIGKILLed at a random moment once its first checkpoint is in place (uniform over the time
    an uninterrupted run takes from there to its end: inner steps, background writes of later rounds in flight
    or not), then `--resume`: every tensor of the last checkpoint (bank, outer state, paths, AdamW, RNG) equals
    the uninterrupted run's, and every round is logged once. ``--sweep full``: 20 attempts (docs/results.md)."""
    attempts, rounds, steps = (20, 4, 40) if full_sweep else (2, 6, 10)
    base = [*TINY, f"run.dir={run_cfg.run.dir}", f"data.corpus={run_cfg.data.corpus}", f"train.rounds={rounds}",
            f"train.inner_steps={steps}"]

    def checkpoints(name: str) -> CheckpointManager:
        return CheckpointManager(Path(run_cfg.run.dir) / "train" / name / "checkpoints")

    proc = train_process([*base, "train.name=straight"])
    wait_for(checkpoints("straight").root / "round_000001", proc)
    started = time.perf_counter()
    assert proc.wait() == 0, proc.stderr.read() if proc.stderr else ""
    straight_s = time.perf_counter() - started
    want = checkpoint_tensors(checkpoints("straight").latest())
    rng, failed = random.Random(0), []
    for attempt in range(attempts):
        name = f"killed{attempt:02d}"
        proc = train_process([*base, f"train.name={name}"])
        wait_for(checkpoints(name).root / "round_000001", proc)
        delay = rng.uniform(0.0, straight_s)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        landed = [p.name for p in checkpoints(name).checkpoints()]
        assert main(["train", *base, f"train.name={name}", "--resume"]) in (0, None)
        got = checkpoint_tensors(checkpoints(name).latest())
        exact = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        once = outer_rounds(checkpoints(name).root.parent) == list(range(1, rounds + 1))
        print(f"{name}: killed {delay:.2f} s of {straight_s:.2f} after round 1's checkpoint, with {landed}; "
              f"bit-exact {exact}, every round logged once {once}")
        if not (exact and once):
            failed.append(name)
    assert not failed, f"{len(failed)}/{attempts} attempts did not end as the uninterrupted run: {failed}"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_mid_round_loses_a_step_not_the_round(run_cfg, sigint_from_a_terminal, signum):
    """One process, lock-step: the signal lets the inner step in progress finish, a step checkpoint of the
    round in progress is written, and `--resume` ends bit-exactly as an uninterrupted run, every round
    logged once with all its steps."""
    rounds = ["train.rounds=3", "train.inner_steps=40"]
    straight = Run(apply_overrides(run_cfg, [*rounds, "train.name=straight"])).train()
    want = checkpoint_tensors(CheckpointManager(straight.dir / "checkpoints").latest())
    env = subprocess_env()
    args = [*TINY, f"run.dir={run_cfg.run.dir}", f"data.corpus={run_cfg.data.corpus}", *rounds, "train.name=stopped"]
    proc = subprocess.Popen([sys.executable, "-m", "dipaco", "train", *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = Path(run_cfg.run.dir) / "train" / "stopped" / "checkpoints" / "round_000001"
    try:
        assert proc.stdout.readline().startswith("[train]")
        deadline = time.time() + 120
        while not first.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # round 2 is under way (160 inner steps): stop it mid-way
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert "[train] stopped in round" in out and "Traceback" not in err, (out, err)
    exp_dir = Path(run_cfg.run.dir) / "train" / "stopped"
    assert CheckpointManager(exp_dir / "step_checkpoint").latest() is not None
    assert main(["train", *args]) == 2  # without --resume: refused, nothing lost
    assert main(["train", *args, "--resume"]) in (0, None)
    got = checkpoint_tensors(CheckpointManager(exp_dir / "checkpoints").latest())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not (exp_dir / "step_checkpoint").exists()
    assert outer_rounds(exp_dir) == [1, 2, 3]
    tokens = [(r["round"], r["path"], r["tokens"]) for r in read_metrics(exp_dir / "metrics.jsonl", "path")]
    assert tokens == [(r["round"], r["path"], r["tokens"]) for r in read_metrics(straight.dir / "metrics.jsonl", "path")]
