"""metrics.jsonl never holds half a record: a torn last line (a crash mid-write) is left out by the reader
and cut away when the log is opened again; a line that is not a record elsewhere is an error naming it."""

import pytest

from dipaco.errors import DataError
from dipaco.metrics import MetricsLogger, read_metrics


def test_a_torn_last_record_is_skipped_then_cut_away(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log("path", step=1, loss=2.5)
    log.close()
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"event": "outer", "step": 1, "outer_grad_no')  # a write a SIGKILL cut
    assert [r["event"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["path"]
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log("outer", step=1)
    log.close()
    assert [r["event"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["path", "outer"]
    assert (tmp_path / "metrics.jsonl").read_bytes().count(b"outer_grad_no") == 0


def test_a_broken_line_inside_the_log_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "path"}\nnot json\n{"event": "outer"}\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl:2: not a JSON record"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_a_diverged_loss_is_logged_as_null_with_its_reason(tmp_path):
    # Issue 48: a NaN loss made metrics.jsonl invalid JSON for jq and every strict parser.
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log("path", step=1, loss=float("nan"), grad_norm=float("inf"))
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["loss"] is None and record["loss_null_reason"] == "not a finite number (nan)"
    assert record["grad_norm"] is None


def test_records_logged_together_land_all_or_none(tmp_path, monkeypatch):
    import errno
    import os

    import dipaco.metrics as metrics_module
    from dipaco.errors import DipacoError

    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log("outer", step=1)
    real_write, calls = os.write, []

    def full_after_some_bytes(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:len(data) // 2]))  # part of the round lands
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics_module.os, "write", full_after_some_bytes)
    with pytest.raises(DipacoError, match="No space left on device"):
        with log.together():
            for p in range(4):
                log.log("path", step=2, path=p, loss=1.0)
            log.log("outer", step=2, round=2)
            log.log("comm", step=2, round=2)
    assert len(calls) == 2  # one append for the whole round, not one per record
    monkeypatch.setattr(metrics_module.os, "write", real_write)
    assert [r["event"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["outer"]  # none of round 2
    with log.together():
        log.log("path", step=2, path=0, loss=1.0)
        log.log("outer", step=2, round=2)
    log.close()
    assert [r["event"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["outer", "path", "outer"]
