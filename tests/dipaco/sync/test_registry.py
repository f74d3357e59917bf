"""A new outer-sync algorithm is one class plus one registry entry; the driver calls it at its sync points."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dipaco.config import OuterConfig
from dipaco.errors import ConfigError
from dipaco.run import Run, load_config
from dipaco.sync import SYNCS, OuterSync, build_sync
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.schedule import Schedule


class TwiceARound(OuterSync):
    """DiLoCo's step, taken twice per round (after half the inner steps and at the end)."""

    name = "twice_a_round"

    def __init__(self, ctx) -> None:
        self.inner_steps = ctx.inner_steps
        # every module leaves (and lands) at both sync points
        self.diloco = DiLoCo(ctx, Schedule.diloco(ctx.inner_steps, ctx.rounds, len(ctx.topology.modules),
                                                  at=self.sync_points()))
        self.calls: list[tuple[int, int, list[int]]] = []

    def sync_points(self) -> tuple[int, ...]:
        return (self.inner_steps // 2, self.inner_steps)

    def at(self, round_index, offset, paths):
        self.calls.append((round_index, offset, sorted(paths)))
        return self.diloco.at(round_index, offset, paths)

    def state_dict(self):
        return self.diloco.state_dict()

    def load_state_dict(self, saved) -> None:
        self.diloco.load_state_dict(saved)


@pytest.mark.slow
def test_a_registered_sync_is_called_at_its_sync_points_with_every_path_at_the_same_step(run_cfg, monkeypatch):
    monkeypatch.setitem(SYNCS, TwiceARound.name, TwiceARound)
    cfg = replace(run_cfg, outer=replace(run_cfg.outer, sync=TwiceARound.name),
                  train=replace(run_cfg.train, name="twice", rounds=2, inner_steps=6))
    exp = Run(cfg).train()
    assert exp.sync.calls == [(r, o, [0, 1, 2, 3]) for r in range(2) for o in (3, 6)]
    assert all(loop.step == 12 for loop in exp.loops.values())
    # Two outer steps a round move the bank differently from DiLoCo's one.
    diloco = Run(replace(cfg, outer=replace(cfg.outer, sync="diloco"), train=replace(cfg.train, name="once"))).train()
    assert any(not torch.equal(a, b) for a, b in zip(exp.bank.params, diloco.bank.params))


def test_an_unknown_sync_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="outer.sync: 'nope' is not one of diloco"):
        load_config(None, ["outer.sync=nope"])
    with pytest.raises(ConfigError, match="outer.sync"):
        build_sync(SimpleNamespace(outer=OuterConfig(sync="nope")))
