"""`dipaco export`: a path as a standalone HF model directory that loads offline with identical logits."""

import json
import os
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dipaco.cli import main
from dipaco.errors import DipacoError
from dipaco.model.llama import build_model
from dipaco.serve.export import PATH_INFO, export
from dipaco.serve.pipeline import load_experiment

TEXT = "The minister told reporters that the new rules would take effect next year."


def composed_logits(loaded, path: int, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(loaded.llama_config(), seed=0)
    loaded.bank.compose(path, model).eval()
    with torch.no_grad():
        return model(ids).logits


def test_exported_path_loads_offline_with_identical_logits(served_run, tmp_path):
    out = tmp_path / "path2"
    assert main(["export", "--run", served_run.run.dir, "--path", "2", "--out", str(out)]) == 0
    info = json.loads((out / PATH_INFO).read_text())
    assert info["path"] == 2 and info["experiment"] == served_run.train.name
    assert info["modules"] == ["embedding.0", "level0.1", "level1.0", "head.0"]
    assert info["checkpoint"].startswith("round_")
    assert (out / "model.safetensors").is_file()

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    loaded = load_experiment(served_run.run.dir)
    assert tokenizer(TEXT)["input_ids"] == loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        exported = model(ids).logits
    assert torch.equal(exported, composed_logits(loaded, 2, ids))


def test_export_all_writes_one_directory_per_path(served_run, tmp_path):
    written = export(served_run.run.dir, tmp_path / "all", all_paths=True)
    assert [p.name for p in written] == ["path_000", "path_001", "path_002", "path_003"]
    loaded = load_experiment(served_run.run.dir)
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"]])
    logits = []
    for p, directory in enumerate(written):
        assert json.loads((directory / PATH_INFO).read_text())["path"] == p
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
        assert torch.equal(logits[-1], composed_logits(loaded, p, ids))
    assert not torch.equal(logits[0], logits[3])  # different paths, different models


def test_export_refuses_bad_requests(served_run, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(DipacoError, match="not a dipaco export"):
        export(served_run.run.dir, tmp_path / "taken", path=0)
    assert (tmp_path / "taken" / "notes.txt").is_file()
    with pytest.raises(DipacoError, match="0..3"):
        export(served_run.run.dir, tmp_path / "x", path=4)
    assert main(["export", "--run", str(tmp_path / "nope"), "--path", "0", "--out", str(tmp_path / "y")]) == 2
    assert "run directory not found" in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_get_the_mode_of_a_normal_file(served_run, tmp_path, umask):
    old = os.umask(umask)
    try:
        out = export(served_run.run.dir, tmp_path / "path1", path=1)[0]
    finally:
        os.umask(old)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()}
    assert "model.safetensors" in modes and PATH_INFO in modes
    # 0644 under the usual umask 022 (safetensors alone would leave the weights 0600), 0600 under 077.
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
