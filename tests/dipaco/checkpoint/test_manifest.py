"""The checkpoint manifest: its structure is checked, and no file it does not list is read."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import TINY

from dipaco.checkpoint.store import MANIFEST, CheckpointManager, verify
from dipaco.cli import main
from dipaco.errors import CheckpointError

GOOD = {"sha256": "0" * 64, "bytes": 1}


def checkpoint(tmp_path: Path) -> Path:
    """A complete single-writer checkpoint with the files every reader needs."""

    def write(d: Path):
        for name in ("bank.safetensors", "outer.safetensors", "trainer_state.pt", "config.yaml"):
            (d / name).write_bytes(name.encode())
        (d / "paths" / "path_000").mkdir(parents=True)
        (d / "paths" / "path_000" / "inner.pt").write_bytes(b"inner")

    ckpt = CheckpointManager(tmp_path / "ckpts").save(1, write)
    verify(ckpt)
    return ckpt


@pytest.mark.parametrize(
    "content,match",
    [
        ("[]", "expected a JSON object"),
        ('"bank.safetensors"', "expected a JSON object"),
        ("null", "expected a JSON object"),
        ('{"bank.safetensors": 5}', "'bank.safetensors': expected"),
        ('{"bank.safetensors": {"sha256": "' + "0" * 64 + '"}}', "'bank.safetensors': expected"),
        ('{"bank.safetensors": {"sha256": "xyz", "bytes": 1}}', "sha256 is not 64"),
        ('{"bank.safetensors": {"sha256": 7, "bytes": 1}}', "sha256 is not 64"),
        ('{"bank.safetensors": {"sha256": "' + "A" * 64 + '", "bytes": 1}}', "sha256 is not 64"),
        ('{"bank.safetensors": {"sha256": "' + "0" * 64 + '", "bytes": -1}}', "bytes is not a non-negative"),
        ('{"bank.safetensors": {"sha256": "' + "0" * 64 + '", "bytes": "16"}}', "bytes is not a non-negative"),
        ('{"bank.safetensors": {"sha256": "' + "0" * 64 + '", "bytes": true}}', "bytes is not a non-negative"),
        ('{"bank.safetensors": {"sha256": "' + "0" * 64 + '", "bytes": 1.5}}', "bytes is not a non-negative"),
        ('{"../../etc/passwd": ' + json.dumps(GOOD) + "}", "not a relative path"),
        ('{"/etc/passwd": ' + json.dumps(GOOD) + "}", "not a relative path"),
        ('{"paths/../bank.safetensors": ' + json.dumps(GOOD) + "}", "not a relative path"),
        ('{"": ' + json.dumps(GOOD) + "}", "not a relative path"),
        ("{not json", "unreadable manifest"),
    ],
)
def test_malformed_manifest_is_a_checkpoint_error(tmp_path, content, match):
    ckpt = checkpoint(tmp_path)
    (ckpt / MANIFEST).write_text(content)
    with pytest.raises(CheckpointError, match=match):
        verify(ckpt)


def test_non_utf8_manifest_is_a_checkpoint_error(tmp_path):
    ckpt = checkpoint(tmp_path)
    (ckpt / MANIFEST).write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match="unreadable manifest"):
        verify(ckpt)


def test_every_file_read_must_be_listed(tmp_path):
    ckpt = checkpoint(tmp_path)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    (ckpt / MANIFEST).write_text("{}")
    with pytest.raises(CheckpointError, match=r"bank\.safetensors: not listed in .*MANIFEST\.json"):
        verify(ckpt)
    # A path file the manifest does not list is refused too, unless the reader does not read it.
    del manifest["paths/path_000/inner.pt"]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"path_000/inner\.pt: not listed"):
        verify(ckpt)
    verify(ckpt, select=lambda rel: not rel.startswith("paths/"))
    # A listed core file that the reader needs cannot be dropped from the manifest with its file.
    del manifest["outer.safetensors"]
    (ckpt / "outer.safetensors").unlink()
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"outer\.safetensors: not listed"):
        verify(ckpt, select=lambda rel: not rel.startswith("paths/"))


def test_empty_manifest_with_a_zeroed_bank_is_refused_by_the_cli(run_cfg, capsys):
    args = [*TINY, f"run.dir={run_cfg.run.dir}", f"data.corpus={run_cfg.data.corpus}"]
    assert main(["train", *args, "--until-round", "1"]) == 0
    ckpt = Path(run_cfg.run.dir) / "train" / run_cfg.train.name / "checkpoints" / "round_000001"
    bank = ckpt / "bank.safetensors"
    from safetensors.torch import load_file

    save_file({k: torch.zeros_like(v) for k, v in load_file(str(bank)).items()}, str(bank))
    (ckpt / MANIFEST).write_text("{}")
    capsys.readouterr()
    for command in (["eval"], ["train", "--resume"]):
        assert main([*command, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "bank.safetensors: not listed" in err and "Traceback" not in err
    (ckpt / MANIFEST).write_text('{"bank.safetensors": []}')
    assert main(["eval", *args]) == 2
    assert "malformed manifest" in capsys.readouterr().err
