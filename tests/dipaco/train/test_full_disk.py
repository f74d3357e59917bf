"""A full disk at any point of a round: the run stops with one error and nothing already written is
lost; once space is freed, --resume continues to the bank of a run that never stopped.

The run directory is a small tmpfs (mounted here: root only; the test is skipped where mounting is not
allowed). A filler file leaves a chosen number of bytes free, and the free space is swept across the
bytes a round writes: inside its checkpoint, and page by page (tmpfs allocates 4 KiB pages) around
the end of the checkpoint, where the config's replacement and the metrics records are written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dipaco.errors import DipacoError
from dipaco.metrics import read_metrics
from dipaco.run import Run
from dipaco.tensor_io import load_tensors

PAGE = 4096


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def leave_free(mount: Path, free: int) -> None:
    """Fills the tmpfs with a filler file so that ``free`` bytes (rounded to pages) stay available."""
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, free_bytes(mount) - free))


def final_bank(exp_dir: Path) -> dict[str, torch.Tensor]:
    return load_tensors(sorted((exp_dir / "checkpoints").glob("round_*"))[-1] / "bank.safetensors")


def test_a_full_disk_anywhere_in_a_round_loses_nothing_and_resume_is_exact(tmpfs, request):
    run_cfg = request.getfixturevalue("run_cfg")  # after the mount: a skip here is not an end-to-end skip
    cfg = replace(run_cfg, train=replace(run_cfg.train, name="full", rounds=3, keep_checkpoints=5))
    straight = Run(replace(cfg, train=replace(cfg.train, name="straight"))).train()
    reference = final_bank(straight.dir)
    shutil.rmtree(straight.dir)  # not copied to the small disk
    exp = Run(cfg).train(until_round=1)
    log = exp.dir / "metrics.jsonl"
    pad = PAGE - log.stat().st_size % PAGE - 100  # round 2's first record crosses into a new page
    with open(log, "a") as f:
        f.write("\n" * pad)  # blank lines: read as nothing
    pristine = Path(run_cfg.run.dir)  # round 1 done, on an ordinary disk

    def fresh_copy() -> Path:
        for child in tmpfs.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        shutil.copytree(pristine, tmpfs / "run")
        return tmpfs / "run"

    on_tmpfs = replace(cfg, run=replace(cfg.run, dir=str(fresh_copy())))
    before = free_bytes(tmpfs)
    Run(on_tmpfs).train(resume=True, until_round=2)
    round_bytes = before - free_bytes(tmpfs)  # what round 2 needs, in whole pages
    assert round_bytes > 100 * PAGE

    budgets = sorted({*(int(round_bytes * q) // PAGE * PAGE for q in (0.0, 0.3, 0.6, 0.9)),
                      *(round_bytes + k * PAGE for k in (-3, -2, -1, 0))})
    outcomes = []
    for free in budgets:
        run_dir = fresh_copy()
        leave_free(tmpfs, free)
        try:
            Run(on_tmpfs).train(resume=True, until_round=2)
            outcomes.append("ok")
        except DipacoError as exc:  # the CLI prints it as one `error:` line (exit 2)
            assert "\n" not in str(exc) and ("No space left" in str(exc) or "disk full" in str(exc)), exc
            outcomes.append(type(exc).__name__)
        (tmpfs / "filler").unlink()
        exp = Run(on_tmpfs).train(resume=True)  # space freed: continue to the end
        records = read_metrics(run_dir / "train" / "full" / "metrics.jsonl")
        assert [r["round"] for r in records if r["event"] == "outer"] == [1, 2, 3], free
        assert sorted((r["round"], r["path"]) for r in records if r["event"] == "path") == \
            [(r, p) for r in (1, 2, 3) for p in range(4)], free
        bank = final_bank(exp.dir)
        assert all(torch.equal(bank[k], v) for k, v in reference.items()), free
    assert outcomes[-1] == "ok" and {"CheckpointError", "DipacoError"} <= set(outcomes), outcomes
