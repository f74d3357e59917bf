"""`dipaco pretrain`: what it reports of the run."""

from __future__ import annotations

import json
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
from open_model import SAMPLE_TEXT, build_checkpoint
from safetensors.torch import load_file, save_file
from tiny import TINY

import dipaco.model.llama as llama_module
import dipaco.model.source as source_module
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


# --- issue 76: pretraining from an open model refuses a damaged or oversized checkpoint before it builds ------------
def imported_run(root: Path, damage=None) -> list[str]:
    """A run prepared from a tiny open checkpoint (in ``root``); ``damage(tensors)`` edits its weights first.
    Returns the command line's overrides."""
    checkpoint = root / "llama"
    build_checkpoint(checkpoint)
    if damage is not None:
        tensors = load_file(str(checkpoint / "model.safetensors"))
        damage(tensors)
        save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    corpus = root / "corpus.jsonl"
    sentences = SAMPLE_TEXT.split(". ")
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": ". ".join(sentences[i % 5:] * 3)}) + "\n"
                              for i in range(30)))
    args = [f"model.init_from={checkpoint}", f"data.corpus={corpus}", f"run.dir={root / 'run'}", "data.seq_len=64",
            "data.prefix_tokens=16", "topology.preset=dense", "pretrain.optim.batch_size=4",
            "pretrain.optim.warmup_steps=1", "run.progress=false", "run.device=cpu"]
    assert main(["prepare", *args]) == 0
    return args


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> list[str]:
    return imported_run(tmp_path_factory.mktemp("imported"))


def moved(args: list[str], run_dir: Path) -> list[str]:
    """The overrides of a copy of the run in ``run_dir`` (run.dir may change; the prepared data still matches)."""
    old = next(a for a in args if a.startswith("run.dir=")).split("=", 1)[1]
    shutil.copytree(old, run_dir)
    return [a for a in args if not a.startswith("run.dir=")] + [f"run.dir={run_dir}"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_pretrain_steps_0_says_it_kept_the_checkpoint(imported, tmp_path, capsys):
    args = moved(imported, tmp_path / "run")
    capsys.readouterr()
    assert main(["pretrain", *args, "pretrain.steps=0"]) == 0
    out = capsys.readouterr().out
    checkpoint = next(a for a in args if a.startswith("model.init_from=")).split("=", 1)[1]
    assert f"[pretrain] pretrain.steps=0: kept the checkpoint {checkpoint} as it is -> {tmp_path / 'run' / 'pretrain'}" \
        in out.splitlines(), out
    assert "mean loss" not in out and "tok/s" not in out
    assert (tmp_path / "run" / "pretrain" / "model.safetensors").is_file()


def test_a_checkpoint_larger_than_the_available_memory_is_refused_before_the_model_is_built(imported, tmp_path,
                                                                                             capsys, monkeypatch):
    args = moved(imported, tmp_path / "run")
    built = []
    monkeypatch.setattr(source_module, "available_memory", lambda: 2**20)
    monkeypatch.setattr(llama_module.LlamaForCausalLM, "__init__", lambda *a, **k: built.append(1))
    capsys.readouterr()
    assert main(["pretrain", *args, "pretrain.steps=2"]) == 2
    line = one_error_line(capsys)
    assert re.fullmatch(r"error: model.init_from=\S+: its [\d,]+ parameters need at least \d+\.\d MiB to train "
                        r"\(fp32 weights, gradients and AdamW's two moments\), and this machine has 1.0 MiB available "
                        r"\(MemAvailable in /proc/meminfo\)", line), line
    assert not built and not (tmp_path / "run" / "pretrain").exists()


def test_a_checkpoint_with_nan_weights_is_refused_and_no_nan_model_is_saved(tmp_path, capsys):
    def nan(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"][0, 0] = float("nan")

    args = imported_run(tmp_path, damage=nan)
    capsys.readouterr()
    assert main(["pretrain", *args, "pretrain.steps=0"]) == 2
    line = one_error_line(capsys)
    assert line.endswith("model.safetensors: model.layers.0.self_attn.k_proj.weight holds 1 non-finite values (NaN or "
                         "inf) of 2,048; a damaged checkpoint trains a NaN model"), line
    assert not (tmp_path / "run" / "pretrain").exists()
