"""Resuming after the run directory moved, a full disk during a checkpoint, and Ctrl-C."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from tiny import TINY

import dipaco.tensor_io as checkpoint
from dipaco.checkpoint.store import CheckpointManager, verify
from dipaco.cli import main
from dipaco.config import Config
from dipaco.run import Run

REPO = Path(__file__).resolve().parents[3]


def with_dir(cfg: Config, run_dir) -> Config:
    return replace(cfg, run=replace(cfg.run, dir=str(run_dir)))


def cli_args(cfg: Config, *extra: str) -> list[str]:
    return [*TINY, f"run.dir={cfg.run.dir}", f"data.corpus={cfg.data.corpus}", *extra]


def test_resume_with_a_relative_or_moved_run_dir(run_cfg, tmp_path, monkeypatch):
    absolute = Path(run_cfg.run.dir).resolve()
    Run(with_dir(run_cfg, absolute)).train(until_round=1)
    monkeypatch.chdir(absolute.parent.parent)  # another cwd: the same run, spelled relatively
    relative = os.path.relpath(absolute)
    assert not Path(relative).is_absolute()
    exp = Run(with_dir(run_cfg, relative)).train(resume=True, until_round=2)
    assert exp.checkpoints.latest().name == "round_000002"

    moved = tmp_path / "elsewhere" / "run"
    shutil.move(str(absolute), str(moved))
    exp = Run(with_dir(run_cfg, moved)).train(resume=True)  # continues the moved run
    assert exp.checkpoints.latest().name == "round_000002" and exp.rounds == 2  # train.rounds
    other = replace(run_cfg, run=replace(run_cfg.run, dir=str(moved)), train=replace(run_cfg.train, inner_steps=6))
    with pytest.raises(Exception, match=r"train\.inner_steps: 5 -> 6"):  # a real change is still refused
        Run(other).train(resume=True)


def test_resume_with_more_rounds_continues_the_run_on_the_longer_lr_schedule(run_cfg, capsys):
    # Issue 48: `--resume train.rounds=N` with a larger N was refused, with no alternative offered.
    from dipaco.metrics import read_metrics
    from dipaco.paths.lr_schedule import warmup_cosine

    Run(run_cfg).train()
    longer = replace(run_cfg, train=replace(run_cfg.train, rounds=3))
    exp = Run(longer).train(resume=True)
    assert exp.checkpoints.latest().name == "round_000003"
    assert "extending the run from 2 to 3 rounds" in capsys.readouterr().out
    records = read_metrics(exp.dir / "metrics.jsonl", "path")
    assert sorted({r["round"] for r in records}) == [1, 2, 3]  # rounds 1-2 kept, round 3 added, none twice
    assert len(records) == 3 * exp.topology.num_paths
    optim, steps = run_cfg.train.optim, 3 * run_cfg.train.inner_steps
    want = optim.lr * warmup_cosine(steps, optim.warmup_steps, steps, optim.min_lr_ratio)
    assert all(r["lr"] == pytest.approx(want) for r in records if r["round"] == 3)  # the new schedule's end
    shorter = replace(run_cfg, train=replace(run_cfg.train, rounds=1))
    with pytest.raises(Exception, match=r"train\.rounds: 3 -> 1.*--until-round"):
        Run(shorter).train(resume=True)


def test_disk_full_during_a_checkpoint_is_one_line_and_resume_works(run_cfg, monkeypatch, capsys):
    real_save_file = checkpoint.save_file

    def full_disk(tensors, filename, metadata=None):
        if "round_000002" in filename:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    assert main(["train", *cli_args(run_cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not write checkpoint") and "No space left on device" in err
    assert "--resume" in err and err.count("\n") == 1 and "Traceback" not in err
    root = Path(run_cfg.run.dir) / "train" / run_cfg.train.name / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["round_000001"]  # no .round_000002.tmp-* left
    verify(root / "round_000001")

    monkeypatch.setattr(checkpoint, "save_file", real_save_file)  # space freed
    assert main(["train", *cli_args(run_cfg), "--resume"]) == 0
    assert CheckpointManager(root).latest().name == "round_000002"


def test_disk_full_while_a_round_is_logged_leaves_every_rounds_records_once_after_resume(run_cfg, monkeypatch, capsys):
    # Issue 48: a round's records went to metrics.jsonl one at a time; ENOSPC between them left the round's
    # outer record without its comm record, and a resume (which checks the outer record) never logged it.
    import dipaco.metrics as metrics_module
    from dipaco.metrics import read_metrics

    real_write = os.write

    def full_at_round_2s_comm(fd, data):
        if b'"event": "comm"' in bytes(data) and b'"round": 2' in bytes(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(metrics_module.os, "write", full_at_round_2s_comm)
    assert main(["train", *cli_args(run_cfg)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.setattr(metrics_module.os, "write", real_write)
    assert main(["train", *cli_args(run_cfg), "--resume"]) == 0
    records = read_metrics(Path(run_cfg.run.dir) / "train" / run_cfg.train.name / "metrics.jsonl")
    for index in (1, 2):
        events = sorted(r["event"] for r in records if r.get("round") == index or
                        (r["event"] == "path" and r.get("step") == index * run_cfg.train.inner_steps))
        n_paths = sum(1 for r in records if r["event"] == "path" and r.get("step") == run_cfg.train.inner_steps)
        assert events == sorted(["comm", "outer", *["path"] * n_paths]), (index, events)


def test_a_failed_write_of_any_kind_removes_the_temporary_directory(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpts")

    def write(d: Path):
        (d / "a.bin").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        manager.save(1, write)
    assert list((tmp_path / "ckpts").iterdir()) == []


def _signal_masks(pid: int) -> str:
    """The child's ignored, blocked and caught signal masks (Linux), to tell a hang from an ignored SIGINT."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "unavailable"
    return " ".join(line.replace("\t", "") for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


@pytest.mark.parametrize("progress,signum", [(False, signal.SIGINT), (True, signal.SIGINT), (False, signal.SIGTERM)],
                         ids=["no_bars", "bars", "sigterm"])
def test_ctrl_c_is_one_line_and_exit_130(run_cfg, sigint_from_a_terminal, progress, signum):
    """Ctrl-C, and SIGTERM (Slurm, Kubernetes, preemption; issue 48: it ended training silently): one line, no
    traceback, 128 + the signal."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "dipaco")])}
    # -X faulthandler: if the child hangs, SIGABRT makes it print every thread's stack before it dies.
    cmd = [sys.executable, "-X", "faulthandler", "-m", "dipaco", "train",
           *cli_args(run_cfg, "train.inner_steps=100000", f"run.progress={str(progress).lower()}")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = proc.stdout.readline()  # the first [train] line: the experiment is built, training runs
        assert line.startswith("[train]"), line
        time.sleep(1.0)
        signals = _signal_masks(proc.pid)
        proc.send_signal(signum)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit within 120 s of {signum.name}; signal masks before it: {signals}\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    # split on "\n" only: a bar redraws with "\r", so the line must not carry a bar's text before it (issue 34)
    last_line = err.rstrip("\n").split("\n")[-1]
    what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    assert "Traceback" not in err and last_line == f"{what}: dipaco train stopped; continue with --resume"
    if not progress:
        assert len(err.strip().splitlines()) == 1, err


def test_a_ctrl_c_lost_inside_a_finalizer_still_stops_training_at_the_next_step(run_cfg, monkeypatch,
                                                                                 sigint_from_a_terminal):
    # Python runs the SIGINT handler between any two bytecodes; inside a finalizer or a callback from C
    # the KeyboardInterrupt is printed as "Exception ignored" and lost. Here the step swallows it the same way.
    from dipaco.paths.inner import InnerLoop
    from dipaco.runtime import sigint_stops_training

    real_step, calls = InnerLoop.train_step, []

    def step(self):
        calls.append(1)
        if len(calls) == 3:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler runs here
            except KeyboardInterrupt:
                pass
        return real_step(self)

    monkeypatch.setattr(InnerLoop, "train_step", step)
    with pytest.raises(KeyboardInterrupt), sigint_stops_training():
        Run(run_cfg).train()
    assert len(calls) == 3  # the step that lost the interrupt finished; the next one did not start
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
