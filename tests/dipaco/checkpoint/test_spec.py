"""The experiment spec (issue 50): written by training, read by serving, export and eval; old runs converted once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dipaco.checkpoint.migrate import convert_experiment
from dipaco.checkpoint.spec import SPEC, ExperimentSpec, read_spec
from dipaco.checkpoint.store import MANIFEST, CheckpointManager, read_manifest
from dipaco.cli import main
from dipaco.errors import CheckpointError, ConfigError, DipacoError
from dipaco.model.pretrained import path_llama_config
from dipaco.run import Run, apply_overrides
from dipaco.run_dir import RunDir
from dipaco.serve.pipeline import Pipeline


def copy_run(cfg, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(cfg.run.dir, dst)
    return dst


def as_before_specs(exp_dir: Path) -> None:
    """The experiment as dipaco wrote it before issue 50: no spec, in the experiment or its checkpoints."""
    (exp_dir / SPEC).unlink()
    for ckpt in CheckpointManager(exp_dir / "checkpoints").checkpoints():
        (ckpt / SPEC).unlink()
        manifest = read_manifest(ckpt)
        del manifest[SPEC]
        (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_training_writes_the_spec_into_the_experiment_and_every_checkpoint(served_run):
    exp_dir = RunDir(served_run.run.dir).experiment(served_run.train.name)
    spec = read_spec(exp_dir)
    for ckpt in CheckpointManager(exp_dir / "checkpoints").checkpoints():
        assert ExperimentSpec.from_json((ckpt / SPEC).read_text()) == spec
        assert SPEC in read_manifest(ckpt)  # covered by the checkpoint's hashes
    prepared = Run(served_run).prepared()
    want = path_llama_config(served_run.model, prepared.tokenizer, served_run.data.seq_len)
    assert spec.llama_config().to_dict() == want.to_dict()
    assert spec.build_topology().to_dict() == Run(served_run).topology().to_dict()
    assert (spec.seq_len, spec.prefix_tokens, spec.sharding.rule) == (
        served_run.data.seq_len, served_run.data.prefix_tokens, "kmeans")
    # the shards' sizes: every training document counted once, by its first path
    paths = np.asarray(prepared.train["path"])
    assert spec.sharding.docs == np.bincount(paths, minlength=4).tolist()
    assert sum(spec.sharding.tokens) == sum(prepared.train["num_tokens"])


def test_a_malformed_spec_is_one_error_naming_it(tmp_path):
    good = {"name": "x", "model": {"num_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2},
            "topology": {"levels": [{"blocks": 2, "modules": 2, "path_specific": False}], "replicas": 1,
                         "embedding": "shared", "head": "shared"},
            "tokenizer": {"dir": "tokenizer", "vocab_size": 300, "eos_token_id": 0, "pad_token_id": 1},
            "seq_len": 64, "prefix_tokens": 16,
            "sharding": {"rule": "iid", "column": "", "seed": 0, "routing": None},
            "precision": {"train": "auto"}, "version": 1}
    spec = ExperimentSpec.from_json(json.dumps(good))
    assert ExperimentSpec.from_json(spec.to_json()) == spec
    assert spec.build_topology().num_paths == 2
    for bad, reason in [({**good, "version": 7}, "version 7"), ({**good, "extra": 1}, "unknown keys"),
                        ({**good, "model": {"num_layerz": 2}}, "num_layerz"),
                        ({**good, "topology": {**good["topology"], "num_paths": 5}}, "num_paths 5")]:
        with pytest.raises(CheckpointError, match=f"where.json: not a valid experiment spec.*{reason}"):
            ExperimentSpec.from_json(json.dumps(bad), "where.json")
    with pytest.raises(CheckpointError, match="not a valid experiment spec"):
        ExperimentSpec.from_json("{garbage", "where.json")


def test_an_old_run_without_a_spec_is_converted_once(served_run, tmp_path, capsys):
    """A run trained before specs existed: serving names the fix; the CLI converts it from config.yaml."""
    run = copy_run(served_run, tmp_path)
    exp_dir = RunDir(run).experiment(served_run.train.name)
    trained = read_spec(exp_dir)
    as_before_specs(exp_dir)
    with pytest.raises(DipacoError, match="convert-spec"):
        Pipeline.from_run(run)
    assert main(["convert-spec", "--run", str(run)]) in (0, None)
    assert read_spec(exp_dir) == trained  # the same record training wrote: shard sizes derived once
    written = (exp_dir / SPEC).stat().st_mtime_ns
    convert_experiment(run, served_run.train.name)  # once: an existing spec is kept as it is
    assert (exp_dir / SPEC).stat().st_mtime_ns == written
    pipe = Pipeline.from_run(run)
    assert [row["train_docs"] for row in pipe.paths()] == trained.sharding.docs


def test_generate_converts_an_old_run_itself(served_run, tmp_path, capsys):
    run = copy_run(served_run, tmp_path)
    exp_dir = RunDir(run).experiment(served_run.train.name)
    as_before_specs(exp_dir)
    assert main(["generate", "--run", str(run), "--max-new-tokens", "2", "hello"]) in (0, None)
    assert (exp_dir / SPEC).is_file() and "path:" in capsys.readouterr().out


def test_eval_refuses_a_config_that_is_not_the_trained_experiments(served_run):
    changed = apply_overrides(served_run, ["data.prefix_tokens=8"])
    with pytest.raises(ConfigError, match="data.prefix_tokens=8 against data.prefix_tokens=16"):
        Run(changed).evaluate()
