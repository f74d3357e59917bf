"""Write-to-temporary-then-rename: old or new content, never half."""

from pathlib import Path

import pytest

import dipaco.atomic as atomic
from dipaco.atomic import recover, remove_tree, replacing, write_text


def test_a_directory_is_swapped_only_when_complete(tmp_path):
    final = tmp_path / "data"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with replacing(final) as tmp:
            tmp.mkdir()
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("disk full")
    assert [p.name for p in final.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no temporary left behind
    with replacing(final) as tmp:
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in final.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_a_file_is_replaced_whole(tmp_path):
    target = tmp_path / "report.json"
    write_text(target, "{}")
    write_text(target, '{"ppl": 1.0}')
    assert target.read_text() == '{"ppl": 1.0}'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_killed_removal_leaves_the_directory_gone_not_half(tmp_path, monkeypatch):
    # Issue 48: a work directory deleted in place could lose its data and keep its marker, and every
    # later run "resumed" from files that were not there.
    work = tmp_path / "routing.work"
    work.mkdir()
    (work / "train.npy").write_bytes(b"x" * 100)
    (work / "record.json").write_text("{}")
    real = atomic.shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        (Path(path) / "train.npy").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        remove_tree(work)
    assert not work.exists()  # gone at once: whatever remains is out of its way
    monkeypatch.setattr(atomic.shutil, "rmtree", real)
    remove_tree(work)  # the next removal (of the same name) deletes what the killed one left
    assert list(tmp_path.iterdir()) == []
    remove_tree(work)  # nothing there: nothing to do


def test_a_kill_between_the_two_renames_of_a_swap_keeps_the_old_directory(tmp_path, monkeypatch):
    """Found by pretrain's kill test: a swap renames the old directory aside, then the new one in; a kill in
    between left neither at the final path, and a resume found nothing to resume."""
    final = tmp_path / "stopped"
    with replacing(final) as tmp:
        tmp.mkdir()
        (tmp / "step").write_text("10")
    real = Path.rename

    def killed_before_the_new_one_is_in(self, target):
        if Path(target) == final:
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed_before_the_new_one_is_in)
    with pytest.raises(KeyboardInterrupt):
        with replacing(final) as tmp:
            tmp.mkdir()
            (tmp / "step").write_text("20")
    monkeypatch.setattr(Path, "rename", real)
    assert not final.exists()  # the kill's moment
    assert (recover(final) / "step").read_text() == "10"  # the previous complete one
    with replacing(final) as tmp:  # and the next swap works
        tmp.mkdir()
        (tmp / "step").write_text("30")
    assert (final / "step").read_text() == "30" and sorted(p.name for p in tmp_path.iterdir()) == ["stopped"]
