"""metrics.jsonl never holds half a record: a torn last line (a crash mid-write) is left out by the reader
and cut away when the log is opened again; a line that is not a record elsewhere is an error naming it."""

import json

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


# --- Weights & Biases, in its offline mode: nothing leaves the machine -------------------------------------


def _wandb_records(run_dir):
    """The records of an offline W&B run, read back by W&B's own reader of its transaction log (.wandb)."""
    import subprocess
    import sys

    [log] = run_dir.glob("run-*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _expected_history(metrics_file):
    """What the W&B sink logs of each metrics.jsonl record: its numbers as E/K (E/K/pathP, E/K/SUB), E/step."""
    from dipaco.metrics import _scalars

    expected = []
    for record in read_metrics(metrics_file):
        values = {k: v for k, v in record.items() if k not in ("event", "time", "step")}
        item = dict(_scalars(record["event"], values))
        if "step" in record:
            item[f"{record['event']}/step"] = record["step"]
        if item:
            expected.append(item)
    return expected


def test_pretrain_and_train_log_their_metrics_and_config_to_an_offline_wandb_run(run_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # the wandb extra (dev includes it)
    import math

    from dipaco.run import Run, apply_overrides
    from dipaco.run_dir import RunDir

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = apply_overrides(run_cfg, ["metrics.wandb=true", "metrics.wandb_project=dipaco-test",
                                    "metrics.wandb_tags=[tiny,offline]", "train.rounds=2"])
    Run(cfg).pretrain()
    Run(cfg).train()

    runs = {}
    for directory in sorted((tmp_path / "wb" / "wandb").glob("offline-run-*")):
        records = _wandb_records(directory)
        [run] = [r["run"] for r in records if r.get("type") == "run"]
        runs[run["display_name"]] = (run, [r["history"]["item"] for r in records if r.get("type") == "history"])
    assert set(runs) == {"pretrain", f"train/{cfg.train.name}"}
    logs = {"pretrain": RunDir(cfg.run.dir).pretrain / "metrics.jsonl",
            f"train/{cfg.train.name}": RunDir(cfg.run.dir).experiment(cfg.train.name) / "metrics.jsonl"}
    for name, (run, history) in runs.items():
        assert run["project"] == "dipaco-test" and run["tags"] == ["tiny", "offline"]
        config = run["config"]["update"]  # the reader gives each config key's value as JSON
        assert config["train"]["name"] == cfg.train.name and config["metrics"]["wandb"] is True
        assert config["train"]["rounds"] == 2 and config["model"]["hidden_size"] == cfg.model.hidden_size
        logged = [{k: v for k, v in item.items() if not k.startswith("_")} for item in history]
        expected = _expected_history(logs[name])
        assert len(logged) == len(expected) > 0
        for got, want in zip(logged, expected):
            assert got.keys() == want.keys()
            assert all(math.isclose(got[k], want[k], rel_tol=1e-9) for k in want)
    train_keys = set().union(*(item.keys() for item in runs[f"train/{cfg.train.name}"][1]))
    assert {"outer/step", "path/step", "path/loss/path0"} <= train_keys


def test_wandb_without_the_package_is_one_clear_error(run_cfg, monkeypatch):
    import sys

    from dipaco.errors import ConfigError
    from dipaco.run import Run, apply_overrides

    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does when the package is not installed
    with pytest.raises(ConfigError, match=r"metrics\.wandb=true needs the wandb package: pip install 'dipaco\[wandb\]'"):
        Run(apply_overrides(run_cfg, ["metrics.wandb=true"])).pretrain()


@pytest.mark.parametrize("override, key", [("metrics.wandb_project=' '", "metrics.wandb_project"),
                                           (f"metrics.wandb_tags=[{'x' * 65}]", "metrics.wandb_tags"),
                                           ("metrics.wandb_mode=sometimes", "metrics.wandb_mode")])
def test_a_bad_metrics_key_is_named(override, key):
    from dipaco.errors import ConfigError
    from dipaco.run import load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_a_resumed_train_continues_its_wandb_run(run_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from dipaco.run import Run, apply_overrides
    from dipaco.run_dir import RunDir

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = apply_overrides(run_cfg, ["metrics.wandb=true", "train.rounds=2"])
    Run(cfg).train(until_round=1)
    Run(cfg).train(resume=True)
    run_id = (RunDir(cfg.run.dir).experiment(cfg.train.name) / "wandb_id").read_text().strip()
    segments = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    # offline-run-<YYYYMMDD_HHMMSS>-<id>, and "-1" after it when both segments start in the same second
    assert [d.name.split("-")[3] for d in segments] == [run_id, run_id]  # one W&B run, in two segments
    rounds = [[item["outer/step"] for r in _wandb_records(d) if r.get("type") == "history"
               for item in [r["history"]["item"]] if "outer/step" in item] for d in segments]
    assert rounds == [[1], [2]]
