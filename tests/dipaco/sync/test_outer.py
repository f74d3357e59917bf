"""The per-module outer step (the production DiLoCo sync of a single process) on a hand-computable example."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.comm.world import World
from dipaco.config import Config, OuterConfig
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Level, Topology
from dipaco.sync import SyncContext
from dipaco.sync.diloco import DiLoCo
from dipaco.sync.nesterov import ModuleNesterov

LR, MOMENTUM = 0.7, 0.9


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=7, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=8)
    return LlamaForCausalLM(cfg)


def path_with_delta(bank: ModuleBank, path: int, delta: float) -> LlamaForCausalLM:
    """A path model whose every parameter is its bank value minus ``delta``."""
    model = bank.compose(path, tiny_model())
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(delta)
    return model


class OuterOptimizer:
    """One process's DiLoCo sync over ``bank``, stepped with the trained ``paths`` of a round."""

    def __init__(self, bank: ModuleBank, cfg: OuterConfig) -> None:
        self.bank, self.cfg, self.sync = bank, cfg, None

    def step(self, paths, weights) -> dict[str, float]:
        if self.sync is None:  # the weights w_p are fixed for a run: the sync is built with the first ones
            everyone = [tuple(range(self.bank.topology.num_paths))]
            defaults = Config()
            ctx = SyncContext(self.cfg, defaults.dist, defaults.train.inner_steps, defaults.train.rounds, 0,
                              self.bank.topology, self.bank, weights, everyone, World())
            self.sync = DiLoCo(ctx)
        assert weights == self.sync.weights
        return self.sync.at(0, self.sync.sync_points()[-1], paths).norms

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sync.nesterov.state_dict() if self.sync else {}


def module(bank: ModuleBank, name: str) -> torch.Tensor:
    return next(bank.params[m.id] for m in bank.topology.modules if m.name == name)


@pytest.fixture
def setup():
    # One level of 3 modules x 2 replicas = 6 paths: paths 0,1 -> level0.0; 2,3 -> level0.1; 4,5 -> level0.2.
    # Only paths 0, 1, 2 contribute: paths 0 and 1 share level0.0, path 2 has level0.1 to itself,
    # and level0.2 is in no contributing path.
    topo = Topology([Level(1, 3)], replicas=2)
    bank = ModuleBank(topo, tiny_model())
    outer = OuterOptimizer(bank, OuterConfig(lr=LR, momentum=MOMENTUM, nesterov=True))
    return topo, bank, outer


def test_each_module_averages_only_its_paths_with_weights(setup):
    topo, bank, outer = setup
    before = {m.name: bank.params[m.id].clone() for m in topo.modules}
    weights = {0: 1.0, 1: 3.0, 2: 2.0}
    deltas = {0: 1.0, 1: 2.0, 2: 5.0}
    paths = {p: path_with_delta(bank, p, d) for p, d in deltas.items()}

    norms = outer.step(paths, weights)

    expected_grad = {
        "level0.0": (1 * 1.0 + 3 * 2.0) / 4,  # paths 0 and 1 only
        "level0.1": 5.0,  # path 2 alone
        "embedding.0": (1 * 1.0 + 3 * 2.0 + 2 * 5.0) / 6,  # shared by all three
        "head.0": (1 * 1.0 + 3 * 2.0 + 2 * 5.0) / 6,
    }
    for name, g in expected_grad.items():
        # First Nesterov step: buf = g, update = g + momentum * buf.
        want = before[name] - LR * (g + MOMENTUM * g)
        torch.testing.assert_close(module(bank, name), want, rtol=0, atol=1e-6)
        n = module(bank, name).numel()
        assert norms[name] == pytest.approx(g * math.sqrt(n), rel=1e-5)
    # level0.2 is in no contributing path: untouched, and it has no momentum either.
    assert torch.equal(module(bank, "level0.2"), before["level0.2"])
    assert "level0.2" not in norms
    assert "level0.2" not in outer.state_dict()


def test_nesterov_formula_over_two_steps(setup):
    topo, bank, outer = setup
    theta0 = module(bank, "level0.1").clone()
    outer.step({2: path_with_delta(bank, 2, 5.0)}, {2: 1.0})
    outer.step({2: path_with_delta(bank, 2, -1.0)}, {2: 1.0})
    buf1 = 5.0
    theta1 = theta0 - LR * (5.0 + MOMENTUM * buf1)
    buf2 = MOMENTUM * buf1 + (-1.0)
    theta2 = theta1 - LR * (-1.0 + MOMENTUM * buf2)
    torch.testing.assert_close(module(bank, "level0.1"), theta2, rtol=0, atol=1e-5)
    # A module that sat out both steps has never moved.
    assert "level0.0" not in outer.state_dict()


def test_uniform_average_with_unit_lr_and_no_momentum_replaces_by_path_mean():
    topo = Topology([Level(1, 1)], replicas=2)
    bank = ModuleBank(topo, tiny_model())
    outer = OuterOptimizer(bank, OuterConfig(lr=1.0, momentum=0.0))
    before = module(bank, "level0.0").clone()
    outer.step({0: path_with_delta(bank, 0, 1.0), 1: path_with_delta(bank, 1, 3.0)}, {0: 1.0, 1: 1.0})
    torch.testing.assert_close(module(bank, "level0.0"), before - 2.0, rtol=0, atol=1e-6)


def test_path_specific_modules_step_on_their_own_delta():
    topo = Topology([Level(1, 1)], replicas=2, embedding="path")
    bank = ModuleBank(topo, tiny_model())
    outer = OuterOptimizer(bank, OuterConfig(lr=1.0, momentum=0.0))
    e0, e1 = module(bank, "embedding.0").clone(), module(bank, "embedding.1").clone()
    outer.step({0: path_with_delta(bank, 0, 1.0), 1: path_with_delta(bank, 1, 3.0)}, {0: 1.0, 1: 5.0})
    torch.testing.assert_close(module(bank, "embedding.0"), e0 - 1.0, rtol=0, atol=1e-6)
    torch.testing.assert_close(module(bank, "embedding.1"), e1 - 3.0, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rescale,factor", [("sqrt_paths", math.sqrt(3)), ("inv_sqrt_paths", 1 / math.sqrt(3))])
def test_rescale_by_sqrt_of_paths_through_module(rescale, factor):
    topo = Topology([Level(1, 1)], replicas=3)
    bank = ModuleBank(topo, tiny_model())
    outer = OuterOptimizer(bank, OuterConfig(lr=1.0, momentum=0.0, rescale=rescale))
    before = module(bank, "level0.0").clone()
    outer.step({p: path_with_delta(bank, p, 2.0) for p in range(3)}, {p: 1.0 for p in range(3)})
    torch.testing.assert_close(module(bank, "level0.0"), before - 2.0 * factor, rtol=0, atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 2.0, 0.5])
def test_embedding_and_head_step_at_their_own_lr(scale):
    topo = Topology([Level(1, 2)])  # 2 paths: level0.0 and level0.1 each in one, embedding and head in both
    bank = ModuleBank(topo, tiny_model())
    outer = OuterOptimizer(bank, OuterConfig(lr=LR, momentum=MOMENTUM, embedding_head_lr_scale=scale))
    before = {m.name: bank.params[m.id].clone() for m in topo.modules}
    for _ in range(2):  # two steps: the momentum buffers carry the same per-part step
        outer.step({0: path_with_delta(bank, 0, 1.0), 1: path_with_delta(bank, 1, 1.0)}, {0: 1.0, 1: 1.0})
    moved = 1.0 * (1 + MOMENTUM) + (1.0 + MOMENTUM * (MOMENTUM + 1.0))  # Nesterov, gradient 1 twice
    for name, lr in [("level0.0", LR), ("level0.1", LR), ("embedding.0", LR * scale), ("head.0", LR * scale)]:
        torch.testing.assert_close(module(bank, name), before[name] - lr * moved, rtol=0, atol=1e-5)


def test_momentum_state_round_trips(setup):
    topo, bank, outer = setup
    outer.step({0: path_with_delta(bank, 0, 1.0)}, {0: 1.0})
    state = outer.state_dict()
    fresh = ModuleNesterov(bank, OuterConfig(lr=LR, momentum=MOMENTUM))
    fresh.load_state_dict(state)
    assert set(fresh.state_dict()) == set(state)
    for k in state:
        assert torch.equal(fresh.state_dict()[k], state[k])
