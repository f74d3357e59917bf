"""`dipaco export`: a path as a standalone HF model directory that loads offline with identical logits."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from open_model import SAMPLE_TEXT, build_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from dipaco.cli import main
from dipaco.errors import DipacoError
from dipaco.model.llama import build_model
from dipaco.model.source import SPECIAL_IDS
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


# --- issue 76: an export of a run from an open model keeps the model's special-token ids ---------------------------
def _trained_from_an_open_model(root: Path) -> tuple[Path, Path]:
    """(the checkpoint, a run started from it and trained for one step), as a user runs it: its config.json sets
    every special-token id, the BOS and UNK ones (which dipaco's training config has no use for) included."""
    checkpoint = root / "llama"
    build_checkpoint(checkpoint, unk_token_id=2, pad_token_id=3)
    corpus = root / "corpus.jsonl"
    sentences = SAMPLE_TEXT.split(". ")
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": ". ".join(sentences[i % 5:] * 3)}) + "\n"
                              for i in range(30)))
    args = [f"model.init_from={checkpoint}", f"data.corpus={corpus}", f"run.dir={root / 'run'}", "data.seq_len=64",
            "data.prefix_tokens=16", "topology.preset=dense", "pretrain.steps=0", "train.rounds=1",
            "train.inner_steps=1", "train.optim.batch_size=2", "train.optim.warmup_steps=1", "run.progress=false",
            "run.device=cpu"]
    for job in ("prepare", "pretrain", "train"):
        assert main([job, *args]) == 0
    return checkpoint, root / "run"


def test_an_export_keeps_the_special_token_ids_of_the_open_model(tmp_path):
    checkpoint, run = _trained_from_an_open_model(tmp_path)
    source = json.loads((checkpoint / "config.json").read_text())
    assert (source["bos_token_id"], source["eos_token_id"], source["unk_token_id"], source["pad_token_id"]) == (0, 1, 2, 3)
    assert main(["export", "--run", str(run), "--path", "0", "--out", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: exported.get(k) for k in SPECIAL_IDS} == {k: source[k] for k in SPECIAL_IDS}
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (0, 1, 3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert (loaded.config.bos_token_id, loaded.config.unk_token_id) == (0, 2)

    # the checkpoint gone from this machine: BOS and UNK from the run's tokenizer, which is the checkpoint's
    shutil.rmtree(checkpoint)
    assert main(["export", "--run", str(run), "--path", "0", "--out", str(tmp_path / "out")]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(run / "tokenizer", local_files_only=True)
    assert tokenizer.bos_token_id == 0 and exported["bos_token_id"] == 0
    assert exported.get("unk_token_id") == tokenizer.unk_token_id
