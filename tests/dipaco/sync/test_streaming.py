"""Streaming DiLoCo (outer.sync=streaming): the fragment schedule, alpha mixing, equivalence with
DiLoCo, resume with a fragment in flight, and its config errors."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.comm.world import World
from dipaco.config import Config, DelayedConfig, OuterConfig, StreamingConfig, TrainConfig
from dipaco.errors import ConfigError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.run import Run, load_config
from dipaco.sync import SyncContext, build_sync
from dipaco.sync.streaming import StreamingDiLoCo, assign_fragments


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=7, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=8)
    return LlamaForCausalLM(cfg)


def streaming(topo: Topology, inner_steps: int, rounds: int = 3, lr: float = 0.7, momentum: float = 0.9,
              **stream) -> StreamingDiLoCo:
    bank = ModuleBank(topo, tiny_model())
    cfg = Config(train=TrainConfig(inner_steps=inner_steps, rounds=rounds),
                 outer=OuterConfig(lr=lr, momentum=momentum, sync="streaming", streaming=StreamingConfig(**stream)))
    ctx = SyncContext(cfg.outer, cfg.dist, cfg.train.inner_steps, cfg.train.rounds, cfg.run.seed, topo, bank,
                      {p: 1.0 for p in range(topo.num_paths)}, [tuple(range(topo.num_paths))],
                      World())
    sync = build_sync(ctx)
    assert isinstance(sync, StreamingDiLoCo)
    return sync


def test_a_hand_computed_schedule_says_which_module_syncs_at_which_step():
    # grid 2x2 over 2 blocks: modules 0 embedding.0, 1 level0.0, 2 level0.1, 3 level1.0, 4 level1.1, 5 head.0
    topo = Topology.grid(2, [2, 2])
    sync = streaming(topo, inner_steps=6, num_fragments=3, fragment="module", pattern="strided", overlap_steps=1)
    assert sync.fragments == [(0, 3), (1, 4), (2, 5)]  # unit i -> fragment i mod 3
    # fragment f leaves at f * H / F (fragment 0 at H) and lands tau = 1 step later
    assert sync.schedule(0) == [(2, 1, (0, 3)), (4, 2, (0, 5)), (6, 0, (1, 1))]
    assert sync.sync_points() == (1, 2, 3, 4, 5, 6)
    # in the last round, fragment 0 cannot land in a next round: it lands at once
    assert sync.schedule(2)[-1] == (6, 0, (2, 6))

    # Drive it: a path's modules move only when their fragment lands (alpha = 0: set to the bank).
    paths = {p: sync.bank.compose(p, tiny_model()) for p in range(topo.num_paths)}
    changed_at = {}
    for r in range(2):
        for offset in sync.sync_points():
            for model in paths.values():  # "training": every parameter moves by one step
                with torch.no_grad():
                    for prm in model.parameters():
                        prm.sub_(0.01)
            before = [sync.bank.params[m].clone() for m in range(len(topo.modules))]
            sync.at(r, offset, paths)
            for m in range(len(topo.modules)):
                if not torch.equal(before[m], sync.bank.params[m]):
                    changed_at.setdefault(m, []).append((r, offset))
    assert changed_at == {0: [(1, 1)], 3: [(1, 1)], 1: [(0, 3), (1, 3)], 4: [(0, 3), (1, 3)],
                          2: [(0, 5), (1, 5)], 5: [(0, 5), (1, 5)]}
    assert sync.in_flight is not None and sync.in_flight.slices == (0, 3)  # round 1's fragment 0


def test_fragment_patterns():
    assert assign_fragments([1] * 6, 4, "strided") == [0, 1, 2, 3, 0, 1]
    assert assign_fragments([1] * 6, 4, "sequential") == [0, 0, 1, 2, 2, 3]
    # balanced: largest first, to the fragment with the fewest parameters
    assert assign_fragments([5, 9, 9, 9, 9, 5], 4, "balanced") == [0, 0, 1, 2, 3, 1]
    levels = streaming(Topology.grid(2, [2, 2]), inner_steps=4, num_fragments=2, fragment="level")
    assert levels.fragments == [(0, 3, 4), (1, 2, 5)]  # parts embedding, level0, level1, head, strided


def test_alpha_mixes_local_and_global_when_a_fragment_lands():
    topo = Topology.grid(2, [1])  # one path: every module its own
    sync = streaming(topo, inner_steps=4, lr=1.0, momentum=0.0, num_fragments=1, overlap_steps=2, mix_alpha=0.5)
    (path,) = range(1)
    model = sync.bank.compose(path, tiny_model())
    bank0 = [p.clone() for p in sync.bank.params]
    vec = lambda: torch.cat([sync.bank.path_vector(model, part) for part in topo.parts])  # noqa: E731

    def shift(delta: float) -> None:
        with torch.no_grad():
            for prm in model.parameters():
                prm.sub_(delta)

    shift(1.0)  # theta_local = theta_0 - 1 when the fragment leaves (offset 4 of round 0)
    sync.at(0, 4, {path: model})
    assert all(torch.equal(a, b) for a, b in zip(bank0, sync.bank.params))  # in flight: nothing applied yet
    shift(0.5)  # two more local steps: theta_0 - 1.5 when it lands (offset 2 of round 1)
    sync.at(1, 2, {path: model})
    # lr 1, no momentum: the bank becomes the path's value when it left; the path mixes 0.5 / 0.5
    want_bank = torch.cat([b - 1.0 for b in bank0])
    got_bank = torch.cat(list(sync.bank.params))
    torch.testing.assert_close(got_bank, want_bank, rtol=0, atol=1e-6)
    torch.testing.assert_close(vec(), 0.5 * (want_bank - 0.5) + 0.5 * want_bank, rtol=0, atol=1e-6)


def test_config_errors_name_the_key():
    base = ["outer.sync=streaming", "train.inner_steps=12"]
    with pytest.raises(ConfigError, match=r"outer.streaming.overlap_steps: tau=3 must be < train.inner_steps / "
                                          r"outer.streaming.num_fragments = 12/4 = 3"):
        load_config(None, [*base, "outer.streaming.num_fragments=4", "outer.streaming.overlap_steps=3"])
    with pytest.raises(ConfigError, match="train.inner_steps: 12 is not a multiple of outer.streaming.num_fragments=5"):
        load_config(None, [*base, "outer.streaming.num_fragments=5"])
    with pytest.raises(ConfigError, match="outer.streaming.mix_alpha"):
        load_config(None, [*base, "outer.streaming.mix_alpha=1.5"])
    with pytest.raises(ConfigError, match="outer.streaming.pattern: 'zigzag' is not one of"):
        load_config(None, [*base, "outer.streaming.pattern=zigzag"])
    with pytest.raises(ConfigError, match="outer.streaming.num_fragments: 8 fragments but outer.streaming.fragment"
                                          "=module gives only 6 units"):
        streaming(Topology.grid(2, [2, 2]), inner_steps=8, num_fragments=8)
    # num_fragments null: one fragment per unit (6 modules), checked once the topology is known
    with pytest.raises(ConfigError, match="outer.streaming.overlap_steps: tau=1 must be < .* = 6/6 = 1"):
        streaming(Topology.grid(2, [2, 2]), inner_steps=6, overlap_steps=1, num_fragments=None)
    with pytest.raises(ConfigError, match="dist.chunk_size: must be even for dist.comm_dtype=fp4"):
        load_config(None, ["dist.comm_dtype=fp4", "dist.chunk_size=15"])
    with pytest.raises(ConfigError, match="dist.adaptive: needs a lossy dist.comm_dtype"):
        load_config(None, ["dist.adaptive=true"])
    with pytest.raises(ConfigError, match="outer.delayed.delay: must be >= 0"):
        load_config(None, ["outer.sync=delayed", "outer.delayed.delay=-1"])


# --- end to end on the tiny run ---------------------------------------------------------------------
def banks_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.bank.params, b.bank.params))


@pytest.mark.slow
def test_one_fragment_without_overlap_is_diloco_bit_for_bit_and_delay_zero_too(run_cfg):
    cfg = replace(run_cfg, train=replace(run_cfg.train, rounds=2, inner_steps=4))
    diloco = Run(replace(cfg, train=replace(cfg.train, name="diloco"))).train()
    one = Run(replace(cfg, train=replace(cfg.train, name="one"), outer=replace(
        cfg.outer, sync="streaming", streaming=StreamingConfig(num_fragments=1, overlap_steps=0, mix_alpha=0.0)))).train()
    zero = Run(replace(cfg, train=replace(cfg.train, name="zero"), outer=replace(
        cfg.outer, sync="delayed", delayed=replace(cfg.outer.delayed, delay=0)))).train()
    assert banks_equal(diloco, one) and banks_equal(diloco, zero)
    # and the syncs are not all the same thing: two overlapped fragments move the bank differently
    two = Run(replace(cfg, train=replace(cfg.train, name="two"), outer=replace(
        cfg.outer, sync="streaming", streaming=StreamingConfig(num_fragments=2, overlap_steps=1)))).train()
    assert not banks_equal(diloco, two)


@pytest.mark.slow
@pytest.mark.parametrize("outer", [
    {"sync": "streaming", "streaming": StreamingConfig(num_fragments=2, overlap_steps=1, mix_alpha=0.5)},
    {"sync": "delayed"},
    {"sync": "delayed", "delayed": DelayedConfig(eager=True)},
])
def test_resume_with_an_outer_gradient_in_flight_is_bit_exact(run_cfg, outer):
    cfg = replace(run_cfg, train=replace(run_cfg.train, rounds=3, inner_steps=4), outer=replace(run_cfg.outer, **outer))
    whole = Run(replace(cfg, train=replace(cfg.train, name="whole"))).train()
    part = replace(cfg, train=replace(cfg.train, name="part"))
    first = Run(part).train(until_round=1)
    assert first.sync.in_flight  # stopped with an outer gradient in flight (a fragment, or round 1's)
    resumed = Run(part).train(resume=True)
    assert banks_equal(whole, resumed)
    for p, loop in whole.loops.items():  # the paths too: mixing and restarts continued exactly
        assert all(torch.equal(a, b) for a, b in zip(loop.model.parameters(), resumed.loops[p].model.parameters()))
