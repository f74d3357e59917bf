"""Write-to-temporary-then-rename: old or new content, never half."""

import pytest

from dipaco.atomic import replacing, write_text


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
