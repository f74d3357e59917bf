"""The background checkpoint writer (issue 48): the synchronous writer's files, from a copy, off the critical path."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dipaco.checkpoint.store import MANIFEST, CheckpointManager, Snapshot, verify, write_snapshot
from dipaco.checkpoint.writer import BackgroundWriter, HostBuffers
from dipaco.errors import CheckpointError


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, index: int) -> Snapshot:
    """A trainer-shaped snapshot: parts of named tensors, a path's parameters and AdamW state, the trainer state."""
    params = dict(model.named_parameters())
    return Snapshot(parts={"bank": {f"m/{k}": v for k, v in params.items()}, "outer": {"m": params["0.bias"] * 0}},
                    state={"round": index, "rng": {"torch": torch.get_rng_state()}, "scheduler": {"queue": [1, 2]}},
                    paths={0: (params, {"optimizer": optimizer.state_dict(), "step": index})},
                    texts={"config.yaml": "a: 1\n"})


def trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def files(ckpt: Path) -> dict[str, bytes]:
    return {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}


def test_the_background_writer_writes_the_synchronous_writers_files(tmp_path):
    model, optimizer = trained()
    sync = CheckpointManager(tmp_path / "sync")
    snap = snapshot(model, optimizer, 1)
    want = sync.save(1, lambda d: write_snapshot(d, 0, snap, 1))
    writer = BackgroundWriter(CheckpointManager(tmp_path / "background"))
    writer.submit(1, snap, lambda copy: lambda d: write_snapshot(d, 0, copy, 1))
    index, got = writer.wait()
    assert index == 1 and files(got) == files(want)  # byte for byte, the manifest's hashes included
    verify(got)


def test_the_written_checkpoint_is_the_state_at_submit_not_what_training_did_next(tmp_path):
    """The snapshot is copied before the write starts: the next round changes the live tensors in place
    (found by the 2-rank kill test: a snapshot that was not copied resumed from a mix of two rounds)."""
    model, optimizer = trained()
    want = files(CheckpointManager(tmp_path / "sync").save(
        1, lambda d: write_snapshot(d, 0, snapshot(model, optimizer, 1), 1)))
    writer = BackgroundWriter(CheckpointManager(tmp_path / "background"))
    next_round_done = threading.Event()

    def write(copy: Snapshot):
        def fill(directory: Path) -> list[Path]:
            # Written once the next round has changed the live tensors, however slow the machine: a fixed wait
            # here let a loaded one write first, and a snapshot that was not copied then passed.
            assert next_round_done.wait(60), "the next round did not run"
            return write_snapshot(directory, 0, copy, 1)
        return fill

    writer.submit(1, snapshot(model, optimizer, 1), write)
    with torch.no_grad():  # the next round: parameters and AdamW moments change in place
        for p in model.parameters():
            p.add_(1.0)
        for state in optimizer.state.values():
            state["exp_avg"].mul_(3.0)
    next_round_done.set()
    _, got = writer.wait()
    assert files(got) == want


def test_host_buffers_are_reused_and_pinned_only_for_cuda():
    buffers = HostBuffers()
    tensor = torch.arange(6.0)
    first = buffers.copy({"a": [tensor, (tensor, 3)]})
    again = buffers.copy({"a": [tensor + 1, (tensor, 3)]})
    assert first["a"][0].data_ptr() == again["a"][0].data_ptr() and not again["a"][0].is_pinned()
    assert torch.equal(again["a"][0], tensor + 1) and again["a"][1][1] == 3
    assert buffers.nbytes == 2 * 6 * 4
    with pytest.raises(TypeError, match="holds a set"):
        buffers.copy({"x": {1, 2}})


def test_a_failed_write_is_raised_at_wait_and_leaves_the_previous_checkpoint(tmp_path):
    model, optimizer = trained()
    manager = CheckpointManager(tmp_path / "ckpts")
    writer = BackgroundWriter(manager)
    writer.submit(1, snapshot(model, optimizer, 1), lambda copy: lambda d: write_snapshot(d, 0, copy, 1))
    writer.wait()

    def full_disk(directory: Path):
        raise OSError(28, "No space left on device")

    writer.submit(2, snapshot(model, optimizer, 2), lambda copy: full_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are intact"):
        writer.wait()
    assert [p.name for p in manager.checkpoints()] == ["round_000001"] and not writer.in_flight
    assert not list(manager.root.glob(".round_*"))
    with pytest.raises(RuntimeError, match="not waited for"):
        writer.submit(3, snapshot(model, optimizer, 3), lambda copy: lambda d: write_snapshot(d, 0, copy, 3))
        writer.submit(4, snapshot(model, optimizer, 4), lambda copy: lambda d: write_snapshot(d, 0, copy, 4))
    writer.wait()


KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    from dipaco.checkpoint.store import CheckpointManager, Snapshot, write_snapshot
    from dipaco.checkpoint.writer import BackgroundWriter
    writer = BackgroundWriter(CheckpointManager(sys.argv[1], keep=2))
    big = torch.zeros(4_000_000)
    for index in range(1, 10_000):
        big.fill_(float(index))  # every checkpoint's tensor holds its own index
        snap = Snapshot(parts={"bank": {"m": big}, "outer": {"m": big[:4]}}, state={"round": index},
                        texts={"config.yaml": "a: 1\\n"})
        writer.wait()
        writer.submit(index, snap, lambda copy, i=index: lambda d: write_snapshot(d, 0, copy, i))
        print(index, flush=True)
""")


def test_a_kill_at_any_moment_of_a_background_write_leaves_a_complete_checkpoint(tmp_path):
    """SIGKILL at random moments of a stream of background writes of 16 MB checkpoints: the newest complete
    checkpoint always verifies against its manifest and holds the state it was written for."""
    from safetensors.torch import load_file

    rng = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "OMP_NUM_THREADS": "1"}
    root = tmp_path / "ckpts"
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        proc.stdout.readline()  # the first write is under way
        # The second: the first write is done (each waits for the last), so every attempt has a checkpoint to find,
        # however long a loaded machine takes to write it; the kill comes at a random moment of the later ones.
        proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done = CheckpointManager(root).checkpoints()
        assert done, f"attempt {attempt}: no checkpoint"
        for ckpt in done:
            verify(ckpt)
            index = int(ckpt.name.split("_")[-1])
            assert torch.all(load_file(str(ckpt / "bank.safetensors"))["m"] == float(index))
            assert json.loads((ckpt / MANIFEST).read_text())


def test_a_kill_while_an_old_checkpoint_is_pruned_leaves_no_checkpoint_without_its_manifest(tmp_path, monkeypatch):
    """Found by the kill test above: pruning deleted an old round_* directory file by file, so a kill in
    between left a round_* directory without MANIFEST.json. It is renamed away first now."""
    import shutil

    model, optimizer = trained()
    manager = CheckpointManager(tmp_path / "ckpts", keep=1)
    manager.save(1, lambda d: write_snapshot(d, 0, snapshot(model, optimizer, 1), 1))
    real = shutil.rmtree

    def killed_after_the_manifest(path, *args, **kwargs):
        manifest = Path(path) / MANIFEST
        if manifest.is_file():
            manifest.unlink()
            raise KeyboardInterrupt  # the kill, one file into the removal
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_after_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        manager.save(2, lambda d: write_snapshot(d, 0, snapshot(model, optimizer, 2), 2))
    monkeypatch.setattr(shutil, "rmtree", real)
    for ckpt in manager.checkpoints():
        verify(ckpt)
    assert [p.name for p in manager.checkpoints()] == ["round_000002"]
    manager.save(3, lambda d: write_snapshot(d, 0, snapshot(model, optimizer, 3), 3))
    assert sorted(p.name for p in manager.root.iterdir()) == ["round_000003"]  # the leftover is gone too
