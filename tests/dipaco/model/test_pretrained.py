"""The pretrained model is loaded strictly, through safetensors only: a missing or unexpected tensor, a
truncated file, or pickled weights in its place stop every job that reads it with one `error:` line
(issue 34: they ran on partly random weights, or ended in a traceback)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import TINY

from dipaco.cli import main


def args(cfg) -> list[str]:
    return [*TINY, f"run.dir={cfg.run.dir}", f"data.corpus={cfg.data.corpus}"]


def damage(weights: Path, how: str) -> None:
    tensors = load_file(str(weights))
    if how == "missing":
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(weights))
    elif how == "unexpected":
        save_file({**tensors, "model.extra.weight": torch.zeros(2)}, str(weights))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:  # pickled weights in place of the safetensors file
        torch.save(tensors, weights.with_name("pytorch_model.bin"))
        weights.unlink()


@pytest.mark.parametrize("how, message", [
    ("missing", "model parameters do not match the path model"),
    ("unexpected", "model parameters do not match the path model"),
    ("truncated", "not a readable safetensors file"),
    ("pickle", r"no model\.safetensors \(pytorch_model\.bin found: pickled weights are never loaded\)"),
])
def test_a_damaged_pretrained_model_is_one_error_line(run_cfg, capsys, how, message):
    damage(Path(run_cfg.run.dir) / "pretrain" / "model.safetensors", how)
    capsys.readouterr()
    for command in (["train"], ["eval", "--pretrained"]):
        assert main([*command, *args(run_cfg)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert re.search(message, err), err


def test_loading_models_draws_no_library_bar(run_cfg, served_run, capsys):
    """Issue 34: transformers' "Loading weights" bars leaked into generate, export and eval. The models are
    now read through safetensors, so the only bar left is eval's own (run.progress=true)."""
    assert main(["eval", "--pretrained", *args(run_cfg), "run.progress=true"]) == 0
    err = capsys.readouterr().err
    bars = [piece for piece in re.split(r"[\r\n]", err) if "%|" in piece]
    assert bars and all(bar.startswith("eval ") for bar in bars), err[-2000:]
    assert "Loading" not in err

    assert main(["generate", "--run", served_run.run.dir, "hello", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert "completion:" in out and "%|" not in err and "Loading" not in err, err
