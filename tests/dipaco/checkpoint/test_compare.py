"""dipaco.checkpoint.compare and `dipaco compare`: two checkpoints, tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dipaco.checkpoint.compare import checkpoint_tensors, compare_checkpoints
from dipaco.cli import main


def write_checkpoint(root: Path, weight: torch.Tensor, step: int) -> Path:
    (root / "paths" / "path_000").mkdir(parents=True)
    save_file({"module.0/w": weight}, str(root / "bank.safetensors"))
    save_file({"w": weight * 2}, str(root / "paths" / "path_000" / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": weight + 1, "step": torch.tensor(step)}}, "rng": [torch.arange(3)]},
               root / "paths" / "path_000" / "inner.pt")
    return root


def test_every_tensor_of_safetensors_and_pt_files_is_keyed_by_file_and_name(tmp_path):
    got = checkpoint_tensors(write_checkpoint(tmp_path / "a", torch.ones(2), 3))
    assert sorted(got) == ["bank.safetensors:module.0/w", "paths/path_000/inner.pt:/rng[0]",
                           "paths/path_000/inner.pt:/state/0/exp_avg", "paths/path_000/inner.pt:/state/0/step",
                           "paths/path_000/model.safetensors:w"]


def test_a_differing_tensor_is_found_and_named_with_its_largest_difference(tmp_path):
    a = write_checkpoint(tmp_path / "a", torch.ones(2), 3)
    assert compare_checkpoints(a, write_checkpoint(tmp_path / "same", torch.ones(2), 3)) == (5, [])
    count, problems = compare_checkpoints(a, write_checkpoint(tmp_path / "b", torch.tensor([1.0, 1.5]), 4))
    assert count == 5 and len(problems) == 4  # the weight, its copy, the moment and the step
    assert "bank.safetensors:module.0/w: differs (max abs difference 0.5)" in problems
    assert compare_checkpoints(a, tmp_path / "b", ignore=("inner.pt",))[1] == [
        "bank.safetensors:module.0/w: differs (max abs difference 0.5)",
        "paths/path_000/model.safetensors:w: differs (max abs difference 1)"]


def test_the_command_exits_1_on_a_difference_and_2_on_a_missing_checkpoint(tmp_path, capsys):
    a = write_checkpoint(tmp_path / "a", torch.ones(2), 3)
    assert main(["compare", str(a), str(write_checkpoint(tmp_path / "same", torch.ones(2), 3))]) == 0
    assert "identical (5 tensors)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        main(["compare", str(a), str(write_checkpoint(tmp_path / "b", torch.zeros(2), 3))])
    assert exited.value.code == 1 and "3 differences" in capsys.readouterr().out
    assert main(["compare", str(a), str(tmp_path / "nowhere")]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err


def test_experiments_compares_the_newest_checkpoint_of_each_name(tmp_path, capsys):
    for run, weight in (("one", torch.ones(2)), ("two", torch.ones(2))):
        write_checkpoint(tmp_path / run / "train" / "exp" / "checkpoints" / "round_000001", torch.zeros(2), 1)
        write_checkpoint(tmp_path / run / "train" / "exp" / "checkpoints" / "round_000002", weight, 2)
    assert main(["compare", "--experiments", str(tmp_path / "one"), str(tmp_path / "two"), "exp"]) == 0
    assert "exp/round_000002: identical" in capsys.readouterr().out
    assert main(["compare", "--experiments", str(tmp_path / "one"), str(tmp_path / "two"), "other"]) == 2
    assert main(["compare", "--experiments", str(tmp_path / "one"), str(tmp_path / "two")]) == 2
    assert "needs the experiment names" in capsys.readouterr().err


def test_a_corrupted_file_is_named_not_a_traceback(tmp_path, capsys):
    a = write_checkpoint(tmp_path / "a", torch.ones(2), 3)
    b = write_checkpoint(tmp_path / "b", torch.ones(2), 3)
    (b / "bank.safetensors").write_bytes((b / "bank.safetensors").read_bytes()[:20])
    assert main(["compare", str(a), str(b)]) == 2
    assert "bank.safetensors: cannot be read" in capsys.readouterr().err
