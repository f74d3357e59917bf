"""The one-step-delay sync (outer.sync=delayed) on a hand-computable single path, plain and eager."""

import pytest
import torch
from test_streaming import tiny_model

from dipaco.comm.world import World
from dipaco.config import Config, DelayedConfig, OuterConfig, TrainConfig
from dipaco.errors import ConfigError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.run import load_config
from dipaco.sync import SyncContext, build_sync
from dipaco.sync.delayed import DelayedDiLoCo


def delayed(rounds: int, eager: bool, lr: float = 1.0, momentum: float = 0.0,
            lr_delayed: float | None = None, momentum_delayed: float | None = None) -> DelayedDiLoCo:
    topo = Topology.grid(2, [1])  # one path through every module
    step = DelayedConfig(delay=1, eager=eager, lr=lr_delayed, momentum=momentum_delayed)
    cfg = Config(train=TrainConfig(inner_steps=4, rounds=rounds),
                 outer=OuterConfig(lr=lr, momentum=momentum, sync="delayed", delayed=step))
    sync = build_sync(SyncContext(cfg.outer, cfg.dist, cfg.train.inner_steps, cfg.train.rounds, cfg.run.seed, topo,
                                  ModuleBank(topo, tiny_model()), {0: 1.0}, [(0,)], World()))
    assert isinstance(sync, DelayedDiLoCo)
    return sync


@pytest.mark.parametrize("eager", [False, True])
def test_each_round_lands_one_round_late_and_eager_paths_keep_their_own_progress(eager):
    sync = delayed(rounds=4, eager=eager)
    model = sync.bank.compose(0, tiny_model())
    b0 = torch.cat(list(sync.bank.params)).clone()
    vec = lambda: torch.cat([sync.bank.path_vector(model, part) for part in sync.topology.parts])  # noqa: E731
    bank = lambda: torch.cat(list(sync.bank.params))  # noqa: E731
    expected_path, expected_bank = [], []
    for r in range(4):
        with torch.no_grad():  # a round of "training": every parameter moves by -1
            for prm in model.parameters():
                prm.sub_(1.0)
        sync.at(r, 4, {0: model})
        expected_path.append(vec().clone())
        expected_bank.append(bank().clone())
    # lr 1, no momentum: the bank moves by the path's delta of the round before (round 0: not at all);
    # the last round lands the one still in flight
    if eager:  # the path trains as if alone: -1 a round; the bank lags a round behind, then catches up
        wants = [(b0 - 1, b0), (b0 - 2, b0 - 1), (b0 - 3, b0 - 2), (b0 - 4, b0 - 4)]
    else:  # the path restarts from the stale bank, so each round re-does the same step from there
        wants = [(b0, b0), (b0 - 1, b0 - 1), (b0 - 2, b0 - 2), (b0 - 4, b0 - 4)]
    for r, (want_path, want_bank) in enumerate(wants):
        torch.testing.assert_close(expected_bank[r], want_bank, rtol=0, atol=1e-5, msg=f"bank, round {r}")
        torch.testing.assert_close(expected_path[r], want_path, rtol=0, atol=1e-5, msg=f"path, round {r}")


def test_eager_needs_a_delay_of_one():
    with pytest.raises(ConfigError, match="outer.delayed.eager: needs outer.delayed.delay=1"):
        load_config(None, ["outer.sync=delayed", "outer.delayed.eager=true", "outer.delayed.delay=2"])



def run_rounds(sync: DelayedDiLoCo, rounds: int) -> torch.Tensor:
    model = sync.bank.compose(0, tiny_model())
    for r in range(rounds):
        with torch.no_grad():  # a round of "training": every parameter moves by -1
            for prm in model.parameters():
                prm.sub_(1.0)
        sync.at(r, 4, {0: model})
    return torch.cat(list(sync.bank.params)).clone()


@pytest.mark.parametrize("eager", [False, True])
def test_the_delayed_outer_step_keys_replace_outer_lr_and_momentum(eager):
    b0 = torch.cat(list(delayed(rounds=3, eager=eager).bank.params)).clone()
    # outer.lr=1, momentum=0.9 would move the bank by 1, then 1.9 + ...; the delayed keys make it lr 0.5, no momentum
    damped = run_rounds(delayed(rounds=3, eager=eager, momentum=0.9, lr_delayed=0.5, momentum_delayed=0.0), 3)
    plain = run_rounds(delayed(rounds=3, eager=eager, lr=0.5, momentum=0.0), 3)
    assert torch.equal(damped, plain)
    # every round's delta is 1 (non-eager: each round re-does the step from the stale bank; eager: the path
    # trains as if alone); 3 deltas land at lr 0.5
    torch.testing.assert_close(damped, b0 - 1.5, rtol=0, atol=1e-5)
    full = run_rounds(delayed(rounds=3, eager=eager, momentum=0.9), 3)
    assert not torch.allclose(full, plain)


@pytest.mark.parametrize("key,value", [("outer.delayed.lr", "-0.1"), ("outer.delayed.momentum", "1.0"),
                                       ("outer.delayed.momentum", "-0.5")])
def test_bad_delayed_outer_step_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["outer.sync=delayed", f"{key}={value}"])


def test_a_delay_damps_the_default_outer_momentum_and_a_zero_delay_keeps_diloco_s():
    from dipaco.sync.delayed import DELAYED_MOMENTUM, delayed_outer_step

    def step(**over):
        cfg = load_config(None, ["outer.sync=delayed", *[f"{k}={v}" for k, v in over.items()]])
        return delayed_outer_step(cfg.outer)

    assert DELAYED_MOMENTUM == 0.5
    assert (step().lr, step().momentum) == (0.7, 0.5)  # DiLoCo's 0.9 damped
    assert step(**{"outer.delayed.delay": 0}).momentum == 0.9  # delay 0 is DiLoCo
    assert step(**{"outer.momentum": 0.3}).momentum == 0.3  # a smaller outer momentum is kept
    assert step(**{"outer.delayed.momentum": 0.8, "outer.delayed.lr": 1.0}).momentum == 0.8
    assert step(**{"outer.delayed.lr": 1.0}).lr == 1.0
    sync = delayed(rounds=2, eager=True, momentum=0.9)
    assert sync.nesterov.sgd.param_groups[0]["momentum"] == 0.5
