"""`dipaco pretrain`: what it reports of the run."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import TINY

from dipaco.cli import main
from dipaco.run import Run
from dipaco.run_dir import RunDir

REPO = Path(__file__).resolve().parents[3]


def test_the_reported_loss_says_it_is_the_mean_over_the_run(run_cfg, capsys):
    """Issue 34: `[pretrain] loss 6.4` was a mean over every step, and did not say so."""
    capsys.readouterr()
    Run(run_cfg).pretrain()
    out = capsys.readouterr().out
    steps = run_cfg.pretrain.steps
    assert re.search(rf"^\[pretrain\] mean loss over the {steps} steps \d+\.\d{{3}}, ", out, re.MULTILINE), out


# --- issue 48: a stopped pretraining loses a step, not the run ---------------------------------------------------
def pretrained_tensors(cfg) -> dict[str, torch.Tensor]:
    return load_file(str(RunDir(cfg.run.dir).pretrain / "model.safetensors"))


def cli_args(cfg, *extra: str) -> list[str]:
    return [*TINY, f"run.dir={cfg.run.dir}", f"data.corpus={cfg.data.corpus}", *extra]


def copy_of(cfg, tmp_path: Path, name: str):
    dst = tmp_path / name
    shutil.copytree(cfg.run.dir, dst)
    return replace(cfg, run=replace(cfg.run, dir=str(dst)))


@pytest.mark.parametrize("how", ["sigterm", "sigkill_after_a_step_checkpoint"])
def test_a_stopped_pretraining_resumes_bit_exactly(run_cfg, tmp_path, how):
    """SIGTERM: the step in progress finishes, a step checkpoint is written, exit 143; SIGKILL with
    pretrain.checkpoint_every: the last step checkpoint. `dipaco pretrain --resume` then ends with the weights
    of an uninterrupted pretraining."""
    steps = ["pretrain.steps=400", "pretrain.checkpoint_every=25" if how != "sigterm" else "pretrain.checkpoint_every=0"]
    straight = copy_of(run_cfg, tmp_path, "straight")
    assert main(["pretrain", *cli_args(straight, *steps)]) in (0, None)
    want = pretrained_tensors(straight)
    stopped = copy_of(run_cfg, tmp_path, "stopped")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dipaco", "pretrain", *cli_args(stopped, *steps)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work = RunDir(stopped.run.dir).pretrain_work / "stopped"
    try:
        line = proc.stdout.readline()
        assert line.startswith("[pretrain] dense model"), line
        if how == "sigterm":
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
        else:
            deadline = time.time() + 60
            while not work.is_dir() and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            proc.kill()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "sigterm":
        assert proc.returncode == 143, err
        assert "[pretrain] stopped after step" in out and "Traceback" not in err
        assert err.strip().splitlines()[-1] == "terminated (SIGTERM): dipaco pretrain stopped; continue with --resume"
    assert work.is_dir(), (out, err)
    assert main(["pretrain", *cli_args(stopped, *steps)]) == 2  # without --resume: refused, nothing lost
    assert work.is_dir()
    assert main(["pretrain", *cli_args(stopped, *steps), "--resume"]) in (0, None)
    got = pretrained_tensors(stopped)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not RunDir(stopped.run.dir).pretrain_work.exists()


def test_pretrain_resume_refuses_a_changed_config_and_a_missing_checkpoint(run_cfg, capsys):
    assert main(["pretrain", *cli_args(run_cfg), "--resume"]) == 2
    assert "no stopped pretraining to resume" in capsys.readouterr().err
    work = RunDir(run_cfg.run.dir).pretrain_work / "stopped"
    work.mkdir(parents=True)
    (work / "config.yaml").write_text("pretrain:\n  steps: 30\n  optim:\n    lr: 0.5\n")
    assert main(["pretrain", *cli_args(run_cfg), "--resume"]) == 2
    assert "pretrain.optim.lr: 0.5 ->" in capsys.readouterr().err
