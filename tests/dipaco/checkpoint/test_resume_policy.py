"""The resume policy on its own: configs written as a checkpoint keeps them, no training needed."""

from dataclasses import replace

import pytest

from dipaco.checkpoint.resume import check_resume
from dipaco.config import Config, to_yaml
from dipaco.errors import ConfigError


@pytest.fixture
def saved(tmp_path):
    """A checkpoint directory whose config.yaml says 4 rounds of 5 inner steps."""
    cfg = Config()
    cfg = replace(cfg, train=replace(cfg.train, rounds=4, inner_steps=5))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    return tmp_path, cfg


def test_the_same_config_and_a_mutable_key_resume(saved):
    ckpt, cfg = saved
    check_resume(ckpt, to_yaml(cfg))
    check_resume(ckpt, to_yaml(replace(cfg, run=replace(cfg.run, dir="elsewhere", progress=False))))


def test_a_changed_key_is_refused_by_name(saved):
    ckpt, cfg = saved
    with pytest.raises(ConfigError, match=r"cannot resume .*train\.inner_steps: 5 -> 6"):
        check_resume(ckpt, to_yaml(replace(cfg, train=replace(cfg.train, inner_steps=6))))


def test_more_rounds_extend_the_run_and_fewer_point_to_until_round(saved, capsys):
    ckpt, cfg = saved
    check_resume(ckpt, to_yaml(replace(cfg, train=replace(cfg.train, rounds=6))))
    assert "extending the run from 4 to 6 rounds" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"train\.rounds: 4 -> 2\); a run is shortened with --until-round"):
        check_resume(ckpt, to_yaml(replace(cfg, train=replace(cfg.train, rounds=2))))


def test_a_longer_run_with_another_change_is_still_refused(saved):
    ckpt, cfg = saved
    with pytest.raises(ConfigError, match=r"train\.inner_steps: 5 -> 7") as err:
        check_resume(ckpt, to_yaml(replace(cfg, train=replace(cfg.train, rounds=6, inner_steps=7))))
    assert "train.rounds" not in str(err.value)


def test_a_checkpoint_without_its_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config.yaml"):
        check_resume(tmp_path, to_yaml(Config()))
