"""EM-style re-sharding inside `dipaco train` (route.em_rounds), on the tiny run: the same bank as the
manual train / reroute / train --resume sequence, resumes between and at the points, and torchrun."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import dipaco.train.reroute as reroute_module
from dipaco.checkpoint.store import load_bank_state
from dipaco.config import Config, save_config
from dipaco.errors import ConfigError
from dipaco.metrics import read_metrics
from dipaco.route.provenance import current_fingerprint
from dipaco.run import Run
from dipaco.run_dir import RunDir
from dipaco.train.resharding import EM_RECORD, read_record

REPO = Path(__file__).resolve().parents[3]
POINTS = [1, 3]  # re-route after rounds 1 and 3 of 4: round 2 lies between them


def em_config(base: Config, run_dir: Path, em_rounds: list[int] = POINTS, rounds: int = 4, **train_kw) -> Config:
    return replace(base, run=replace(base.run, dir=str(run_dir)),
                   train=replace(base.train, sharding="kmeans", rounds=rounds, **train_kw),
                   route=replace(base.route, featurizer="lm_prefix", n_init=1, reroute_holdout=0.5,
                                 em_rounds=list(em_rounds)))


def final_bank(cfg: Config) -> dict[str, torch.Tensor]:
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    return load_bank_state(sorted((exp_dir / "checkpoints").glob("round_*"))[-1])


def assert_same_bank(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module")
def em_run(prepared_run, tmp_path_factory):
    """A routed copy of the tiny run kept untrained (``pristine``), and one uninterrupted EM run of it."""
    root = tmp_path_factory.mktemp("em")
    shutil.copytree(prepared_run.run.dir, root / "pristine")
    Run(em_config(prepared_run, root / "pristine")).route()
    shutil.copytree(root / "pristine", root / "em")
    cfg = em_config(prepared_run, root / "em")
    Run(cfg).train()
    return prepared_run, root, cfg


def fresh_copy(root: Path, name: str) -> Path:
    shutil.copytree(root / "pristine", root / name)
    return root / name


def test_em_run_reroutes_at_its_points_and_equals_the_manual_sequence_bit_for_bit(em_run):
    base, root, cfg = em_run
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    original = current_fingerprint(RunDir(str(root / "pristine")))
    done = read_record(exp_dir)
    assert [e["round"] for e in done] == POINTS and [e["checkpoint"] for e in done] == ["round_000001", "round_000003"]
    fingerprints = [original, *(e["fingerprint"] for e in done)]
    assert len(set(fingerprints)) == 3  # the routing changed at each point
    assert all(e["moved_train_docs_count"] > 0 for e in done)
    assert fingerprints[-1] == current_fingerprint(RunDir(cfg.run.dir))
    assert [(r["round"], r["moved_train_docs_count"]) for r in read_metrics(exp_dir / "metrics.jsonl", "em")] == [
        (e["round"], e["moved_train_docs_count"]) for e in done]
    assert [r["round"] for r in read_metrics(exp_dir / "metrics.jsonl", "outer")] == [1, 2, 3, 4]

    # The manual sequence, on an untouched copy of the same routed run, without route.em_rounds.
    manual = em_config(base, fresh_copy(root, "manual"), em_rounds=[])
    Run(manual).train(until_round=1)
    Run(manual).reroute()
    Run(manual).train(resume=True, until_round=3)
    Run(manual).reroute()
    Run(manual).train(resume=True)
    assert_same_bank(final_bank(cfg), final_bank(manual))
    assert current_fingerprint(RunDir(manual.run.dir)) == fingerprints[-1]  # the same routing, file for file


def test_em_run_prints_when_it_reroutes_and_how_many_documents_moved(em_run, capsys):
    base, root, _ = em_run
    cfg = em_config(base, fresh_copy(root, "printed"), em_rounds=[1], rounds=2)
    Run(cfg).train()
    out = capsys.readouterr().out
    moved = read_record(RunDir(cfg.run.dir).experiment(cfg.train.name))[0]["moved_train_docs_count"]
    assert "[em] round 1/2: re-routing every document on the paths' losses (route.em_rounds=[1])" in out
    assert f"[em] round 1: {moved} of " in out and "training continues on the new shards" in out
    assert "continue with `dipaco train --resume`" not in out  # one command: no manual step to suggest
    assert out.index("[em] round 1:") < out.index("[train] round 2/2")


def test_resume_between_and_at_em_points_gives_the_uninterrupted_bank(em_run, monkeypatch):
    base, root, reference = em_run
    cfg = em_config(base, fresh_copy(root, "resumed"), keep_checkpoints=4)  # keep_checkpoints: mutable on resume
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    Run(cfg).train(until_round=2)  # between the points: round 1 re-routed
    assert [e["round"] for e in read_record(exp_dir)] == [1]
    Run(cfg).train(resume=True, until_round=3)  # stops at point 3's checkpoint; its re-routing comes on resume
    assert [e["round"] for e in read_record(exp_dir)] == [1]

    # Stopped right after the re-routing replaced the routing, before it recorded it as the experiment's.
    real = reroute_module.record_routing

    def stop_after_the_swap(run_dir_, exp_dir_, routed_, rerouting=None):
        if rerouting is None:
            raise KeyboardInterrupt
        real(run_dir_, exp_dir_, routed_, rerouting=rerouting)

    monkeypatch.setattr(reroute_module, "record_routing", stop_after_the_swap)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).train(resume=True)
    monkeypatch.setattr(reroute_module, "record_routing", real)
    assert [e["round"] for e in read_record(exp_dir)] == [1]

    exp = Run(cfg).train(resume=True)  # keeps that re-routing (not redone: its moved counts are the originals)
    assert exp.checkpoints.latest().name == "round_000004"
    assert_same_bank(final_bank(reference), final_bank(cfg))
    ref_dir = RunDir(reference.run.dir).experiment(reference.train.name)
    assert read_record(exp_dir) == read_record(ref_dir)
    assert [r["round"] for r in read_metrics(exp_dir / "metrics.jsonl", "outer")] == [1, 2, 3, 4]

    # A checkpoint older than a re-routing done is refused; one at or after the last point resumes.
    with pytest.raises(ConfigError, match=r"re-routed after round 3 \(route.em_rounds\), later than this "
                                          r"checkpoint's round 2"):
        Run(cfg).train(resume_from=str(exp_dir / "checkpoints" / "round_000002"))
    exp = Run(cfg).train(resume_from=str(exp_dir / "checkpoints" / "round_000003"))
    assert exp.checkpoints.latest().name == "round_000004"
    assert_same_bank(final_bank(reference), final_bank(cfg))
    # The schedule is fixed on resume.
    with pytest.raises(ConfigError, match=r"the config changed \(route.em_rounds: \[1, 3\] -> \[1, 2\]\)"):
        Run(replace(cfg, route=replace(cfg.route, em_rounds=[1, 2]))).train(resume=True)


def test_a_fresh_em_run_forgets_the_record_of_an_experiment_without_checkpoints(em_run):
    base, root, _ = em_run
    cfg = em_config(base, fresh_copy(root, "stale"), em_rounds=[1], rounds=2)
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    exp_dir.mkdir(parents=True)
    (exp_dir / EM_RECORD).write_text(json.dumps({"done": [{"round": 1}]}))
    Run(cfg).train(until_round=1)
    assert not (exp_dir / EM_RECORD).exists()
    with pytest.raises(ConfigError, match="already has checkpoints"):
        Run(cfg).train()  # a fresh start over checkpoints is refused before anything is touched


def torchrun_train(cfg_file: Path, *overrides: str) -> tuple[int, str]:
    """A 2-rank `dipaco train` (gloo on loopback, CPU) in its own session; its exit status and output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "dipaco", "train", "--config", str(cfg_file), *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        out = proc.communicate(timeout=400)[0]
        return proc.returncode, out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing is left after a clean exit; a hung job is ended here
        except ProcessLookupError:
            pass


def test_two_ranks_reroute_on_rank_zero_and_both_resume_on_the_new_shards(em_run):
    base, root, reference = em_run
    cfg = em_config(base, fresh_copy(root, "two"))
    save_config(cfg, root / "two.yaml")
    returncode, out = torchrun_train(root / "two.yaml", "dist.timeout_s=120")
    assert returncode == 0, out[-3000:]
    assert out.count("[em] round 1/4: re-routing") == 1 and out.count("[em] round 3/4: re-routing") == 1
    exp_dir = RunDir(cfg.run.dir).experiment(cfg.train.name)
    ref = read_record(RunDir(reference.run.dir).experiment(reference.train.name))
    two = read_record(exp_dir)
    assert [e["docs_per_path"] for e in two] == [e["docs_per_path"] for e in ref]
    a, b = final_bank(reference), final_bank(cfg)
    for k in a:  # one process and two ranks differ in the order of fp32 additions only
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    comm = read_metrics(exp_dir / "metrics.jsonl", "comm")
    assert sorted(p for r in comm if r["round"] == 4 for p in r["paths"]) == [0, 1, 2, 3]
