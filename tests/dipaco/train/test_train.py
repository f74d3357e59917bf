"""End-to-end training on a tiny model over a slice of real multi-domain text."""

from dataclasses import replace

import pytest
import torch

from dipaco.config import Config
from dipaco.errors import CheckpointError, ConfigError
from dipaco.metrics import read_metrics
from dipaco.run import Run
from dipaco.run_dir import RunDir
from dipaco.tensor_io import load_state, load_tensors
from dipaco.train.trainer import check_train


def with_train(cfg: Config, **kw) -> Config:
    return replace(cfg, train=replace(cfg.train, **kw))


def assert_same_tree(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_resume_is_bit_exact(run_cfg):
    straight = Run(with_train(run_cfg, name="straight", rounds=4)).train()
    cfg = with_train(run_cfg, name="resumed", rounds=4)
    Run(cfg).train(until_round=2)
    resumed = Run(cfg).train(resume=True)

    for a, b in zip(straight.bank.params, resumed.bank.params):
        assert torch.equal(a, b)
    assert_same_tree(straight.sync.state_dict(), resumed.sync.state_dict(), "sync")
    for p in straight.loops:
        assert_same_tree(straight.loops[p].state_dict(), resumed.loops[p].state_dict(), f"path{p}")
        for x, y in zip(straight.loops[p].model.parameters(), resumed.loops[p].model.parameters()):
            assert torch.equal(x, y)
    # The metrics of the resumed experiment continue where they stopped: one record per path per round.
    rounds = [r["round"] for r in read_metrics(resumed.dir / "metrics.jsonl", "path")]
    assert rounds == [r for r in (1, 2, 3, 4) for _ in range(4)]


def test_training_lowers_validation_perplexity(run_cfg):
    pretrained = Run(run_cfg).evaluate_pretrained()
    random_init = with_train(run_cfg, name="from_random", init="random", rounds=1, inner_steps=1)
    Run(random_init).train(until_round=0)  # builds the experiment, runs no round: no checkpoint
    cfg = with_train(run_cfg, rounds=3, inner_steps=10)
    Run(cfg).train()
    report = Run(cfg).evaluate()
    assert report["overall"]["ppl"] < pretrained["overall"]["ppl"]
    assert report["overall"]["ppl"] < run_cfg.tokenizer.vocab_size  # far below a uniform guess
    # Every validation doc is routed to exactly one path, and per-path counts add up.
    assert sum(r["docs"] for r in report["paths"]) == report["overall"]["docs"]
    assert sum(r["scored_tokens"] for r in report["paths"]) == report["overall"]["scored_tokens"]
    assert all(r["scored_tokens"] > 0 for r in report["paths"])


def test_metrics_log_loss_throughput_and_outer_norms_per_module(run_cfg):
    cfg = replace(run_cfg, train=replace(run_cfg.train, log_every=2))  # 5 inner steps: windows of 2, 2, 1
    exp = Run(cfg).train()
    paths = read_metrics(exp.dir / "metrics.jsonl", "path")
    assert {(r["round"], r["path"]) for r in paths} == {(r, p) for r in (1, 2) for p in range(4)}
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in paths)
    for r in paths:  # issue 48: the inner loss per train.log_every steps, not only on the progress bar
        first = (r["round"] - 1) * 5
        assert r["inner_loss_steps"] == [first + 2, first + 4, first + 5]
        assert sum(w * n for w, n in zip(r["inner_loss"], (2, 2, 1))) / 5 == pytest.approx(r["loss"], rel=1e-5)
    outer = read_metrics(exp.dir / "metrics.jsonl", "outer")
    assert len(outer) == 2
    assert set(outer[0]["outer_grad_norm"]) == {m.name for m in exp.topology.modules}
    assert (exp.dir / "config.yaml").is_file()


def test_diagnostics_log_each_modules_path_agreement_and_change_nothing(run_cfg):
    plain = Run(with_train(run_cfg, name="plain", rounds=1)).train()
    exp = Run(with_train(run_cfg, name="diagnosed", rounds=1, diagnostics=True)).train()
    for a, b in zip(plain.bank.params, exp.bank.params):  # logging only: the same bits
        assert torch.equal(a, b)
    [outer] = read_metrics(exp.dir / "metrics.jsonl", "outer")
    names = [m.name for m in exp.topology.modules]
    assert list(outer["path_cosine"]) == names
    through = {m.name: len(exp.topology.paths_through(m.id)) for m in exp.topology.modules}
    assert outer["path_cosine_paths"] == through
    for name in names:
        assert outer["path_delta_norm"][name] > 0
        assert -1.0 <= outer["path_cosine"][name] <= 1.0
    assert "path_cosine" not in read_metrics(plain.dir / "metrics.jsonl", "outer")[0]
    with pytest.raises(ConfigError, match="train.diagnostics"):
        check_train(replace(run_cfg.train, diagnostics=True, driver="ray"))


def test_checkpoints_keep_last_k_and_refuse_silent_overwrite(run_cfg):
    cfg = with_train(run_cfg, rounds=3, keep_checkpoints=2)
    exp = Run(cfg).train()
    assert [p.name for p in exp.checkpoints.checkpoints()] == ["round_000002", "round_000003"]
    with pytest.raises(ConfigError, match="already has checkpoints"):
        Run(cfg).train()


def test_a_worker_group_torchrun_restarts_for_a_joining_node_continues_its_job(run_cfg, monkeypatch, capsys):
    # torchrun restarts the group when a node joins without counting a restart (TORCHELASTIC_RESTART_COUNT=0 on
    # every rank): a site killed and back before its loss was noticed. The experiment is this job's: continue it.
    cfg = with_train(run_cfg, rounds=3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    exp = Run(cfg).train(until_round=2)
    capsys.readouterr()
    again = Run(cfg).train()
    assert "a new attempt (for a node that joined) of the worker group: continuing from round_000002" in (
        capsys.readouterr().out)
    assert again.checkpoints.latest().name == "round_000003"
    assert [r["round"] for r in read_metrics(exp.dir / "metrics.jsonl", "outer")] == [1, 2, 3]
    # another job (or none: torchrun's default id) on the same experiment is still refused
    for other in ("job-b", "none"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", other)
        with pytest.raises(ConfigError, match="already has checkpoints"):
            Run(cfg).train()


def test_corrupted_checkpoint_is_named_and_previous_stays_usable(run_cfg):
    cfg = with_train(run_cfg, rounds=3)
    exp = Run(cfg).train(until_round=2)
    latest = exp.checkpoints.latest()
    bank_file = latest / "bank.safetensors"
    data = bytearray(bank_file.read_bytes())
    data[-10] ^= 0xFF
    bank_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"bank\.safetensors: corrupted.*round_000001"):
        Run(cfg).train(resume=True)
    resumed = Run(cfg).train(resume_from=str(exp.checkpoints.root / "round_000001"))
    assert resumed.checkpoints.latest().name == "round_000003"


def test_truncated_checkpoint_file_is_reported(run_cfg):
    exp = Run(run_cfg).train(until_round=1)
    inner = exp.checkpoints.latest() / "paths" / "path_002" / "inner.pt"
    inner.write_bytes(inner.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"path_002/inner\.pt: truncated"):
        Run(run_cfg).train(resume=True)


def test_resume_with_a_changed_config_is_refused(run_cfg):
    Run(run_cfg).train(until_round=1)
    changed = replace(run_cfg, outer=replace(run_cfg.outer, lr=0.5))
    with pytest.raises(ConfigError, match=r"outer\.lr: 0\.7 -> 0\.5"):
        Run(changed).train(resume=True)


def test_checkpoint_holds_bank_outer_paths_and_state(run_cfg):
    exp = Run(run_cfg).train()
    ckpt = exp.checkpoints.latest()
    bank = load_tensors(ckpt / "bank.safetensors")
    assert any(k.startswith("level1.1/") for k in bank)
    assert set(load_tensors(ckpt / "outer.safetensors")) == {m.name for m in exp.topology.modules}
    state = load_state(ckpt / "paths" / "path_003" / "inner.pt")
    assert state["step"] == 2 * run_cfg.train.inner_steps and "optimizer" in state and "sampler" in state
    assert load_state(ckpt / "trainer_state.pt")["round"] == 2


def test_empty_shard_is_a_clear_error(run_cfg):
    cfg = replace(run_cfg, topology=replace(run_cfg.topology, preset="moe:4096"))
    with pytest.raises(Exception, match="shard of path .* is empty"):
        Run(cfg).train()
    assert not RunDir(cfg.run.dir).experiment(cfg.train.name).joinpath("checkpoints").exists()


def test_a_round_checkpointed_but_not_yet_logged_is_logged_on_resume(run_cfg):
    # A worker killed after the checkpoint is renamed into place but before rank 0 logs the round
    # (the SIGKILL restart test hits this under load): the resumed run logs it from the checkpoint.
    cfg = with_train(run_cfg, name="unlogged", rounds=3)
    exp = Run(cfg).train(until_round=2)
    log = exp.dir / "metrics.jsonl"
    kept = [line for line in log.read_text().splitlines() if '"round": 2' not in line]
    log.write_text("".join(line + "\n" for line in kept))
    Run(cfg).train(resume=True)
    outer = [r["round"] for r in read_metrics(log, "outer")]
    assert outer == [1, 2, 3]
    assert sorted(r["round"] for r in read_metrics(log, "path")) == [1] * 4 + [2] * 4 + [3] * 4
    # A run resumed after a complete log does not log the round again.
    Run(cfg).train(resume=True)
    assert [r["round"] for r in read_metrics(log, "outer")] == [1, 2, 3]
