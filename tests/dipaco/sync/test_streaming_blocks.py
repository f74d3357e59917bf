"""Streaming DiLoCo with sub-module fragments (outer.streaming.fragment=blocks:K): the slices, a
hand-computed schedule, the slice Nesterov step, DiLoCo bit for bit at F=1, tau=0, peak bytes and
2 ranks against one process (torch.multiprocessing + gloo), resume with a slice in flight, and the
config errors."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dipaco.comm.world import DistEnv, World
from dipaco.config import Config, DistConfig, OuterConfig, StreamingConfig, TrainConfig
from dipaco.errors import ConfigError
from dipaco.model.bank import ModuleBank
from dipaco.model.topology import Topology
from dipaco.run import Run, load_config
from dipaco.sync import SyncContext, build_sync
from dipaco.sync.nesterov import ModuleNesterov
from dipaco.sync.slices import block_slices


def model(layers: int, vocab: int, hidden: int = 4, intermediate: int = 8, heads: int = 1,
          tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=8,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


# hidden 4, intermediate 8, 1 head: a decoder block is q, k, v, o (4 x 16) + MLP (3 x 32) + 2 norms (2 x 4) = 168
BLOCK = 168


def make_sync(topo: Topology, template, by_rank=None, world=None, held=None, outer: str = "streaming",
              inner_steps: int = 8, rounds: int = 3, dist: DistConfig | None = None, **stream):
    bank = ModuleBank(topo, template, modules=held)
    cfg = Config(train=TrainConfig(inner_steps=inner_steps, rounds=rounds), dist=dist or DistConfig(),
                 outer=OuterConfig(lr=0.7, momentum=0.9, sync=outer, streaming=StreamingConfig(**stream)))
    by_rank = by_rank or [tuple(range(topo.num_paths))]
    ctx = SyncContext(cfg.outer, cfg.dist, cfg.train.inner_steps, cfg.train.rounds, cfg.run.seed, topo, bank,
                      {p: 1.0 + p for p in range(topo.num_paths)}, by_rank, world or World())
    return build_sync(ctx)


def fake_training(models, round_index: int, offset: int) -> None:
    """Every path moves by a pseudo-random step that depends on the path and the step only (not on
    the rank that trains it), so one process and two ranks see the same paths."""
    with torch.no_grad():
        for p, m in models.items():
            gen = torch.Generator().manual_seed(100_000 * p + 1000 * round_index + offset)
            for prm in m.parameters():
                prm.sub_(0.01 * torch.randn(prm.shape, generator=gen))


def drive(sync, template_fn, rounds: int, paths=None):
    """Trains ``paths`` (default: all) with :func:`fake_training` between the sync points; returns the
    path models and each call's report."""
    paths = paths if paths is not None else range(sync.topology.num_paths)
    models = {p: sync.bank.compose(p, template_fn()) for p in paths}
    reports = []
    for r in range(rounds):
        for offset in sync.sync_points():
            fake_training(models, r, offset)
            reports.append(sync.at(r, offset, models))
    return models, reports


# --- the slices and the schedule ------------------------------------------------------------------------
def test_blocks_slice_level_modules_by_blocks_and_the_other_parts_into_block_sized_pieces():
    # 4 blocks in a 2x2 grid: 2 per level module; tied embeddings: the embedding is 84 x 4 = 336 = 2 blocks,
    # the head only the final norm (4 values)
    topo = Topology.grid(4, [2, 2])
    bank = ModuleBank(topo, model(4, vocab=84, tied=True))
    assert bank.block_spans(topo.parts[1]) == [(0, BLOCK), (BLOCK, 2 * BLOCK)]
    one = [[s.name for s in pieces] for pieces in block_slices(bank, 1)]
    assert one == [["embedding.0[0:168]", "embedding.0[168:336]"],
                   ["level0.0[0:168]", "level0.0[168:336]"], ["level0.1[0:168]", "level0.1[168:336]"],
                   ["level1.0[0:168]", "level1.0[168:336]"], ["level1.1[0:168]", "level1.1[168:336]"],
                   ["head.0"]]
    # K = 2: whole level modules, and the embedding fits in one piece of at most 2 blocks
    assert [[s.name for s in pieces] for pieces in block_slices(bank, 2)] == [[m.name] for m in topo.modules]
    # untied, vocab 100: the embedding (400) and the head (4 + 400) in 3 pieces of at most 168, equal sizes
    untied = ModuleBank(topo, model(4, vocab=100))
    pieces = block_slices(untied, 1)
    assert [(s.start, s.stop) for s in pieces[0]] == [(0, 134), (134, 267), (267, 400)]
    assert [(s.start, s.stop) for s in pieces[-1]] == [(0, 135), (135, 270), (270, 404)]


def test_a_hand_computed_schedule_says_which_slice_syncs_at_which_step():
    topo = Topology.grid(4, [2, 2])
    make = lambda: model(4, vocab=84, tied=True)  # noqa: E731
    sync = make_sync(topo, make(), inner_steps=8, num_fragments=4, fragment="blocks:1", overlap_steps=1)
    names = [s.name for s in sync.slices]
    # slice ids in model order: 0, 1 embedding halves; 2..9 the level modules' blocks; 10 the head
    assert names[:3] == ["embedding.0[0:168]", "embedding.0[168:336]", "level0.0[0:168]"] and names[10] == "head.0"
    assert sync.fragments == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7)]  # slice i -> fragment i mod 4
    assert sync.schedule(0) == [(2, 1, (0, 3)), (4, 2, (0, 5)), (6, 3, (0, 7)), (8, 0, (1, 1))]
    assert sync.sync_points() == (1, 2, 3, 4, 5, 6, 7, 8)

    # Drive it: which slices of the bank change at which step; the paths change only there, to the
    # bank's values (alpha = 0), and keep their trained values everywhere else.
    models = {p: sync.bank.compose(p, make()) for p in range(topo.num_paths)}
    changed_at: dict[str, list] = {}
    for r in range(2):
        for offset in sync.sync_points():
            fake_training(models, r, offset)
            before = [prm.clone() for prm in sync.bank.params]
            trained = {p: [sync.bank.path_vector(mdl, part) for part in topo.parts] for p, mdl in models.items()}
            sync.at(r, offset, models)
            landed = torch.zeros(sum(prm.numel() for prm in before), dtype=torch.bool)
            starts = [0]
            for prm in before:
                starts.append(starts[-1] + prm.numel())
            for s in sync.slices:
                now, then = sync.bank.params[s.module], before[s.module]
                if not torch.equal(now[s.start:s.stop], then[s.start:s.stop]):
                    changed_at.setdefault(s.name, []).append((r, offset))
                    landed[starts[s.module] + s.start: starts[s.module] + s.stop] = True
            assert torch.equal(torch.cat(list(sync.bank.params))[~landed], torch.cat(before)[~landed])
            for p, mdl in models.items():
                for k, (part, m) in enumerate(zip(topo.parts, topo.path_modules(p))):
                    inside = landed[starts[m]: starts[m + 1]]
                    now = sync.bank.path_vector(mdl, part)
                    assert torch.equal(now[inside], sync.bank.params[m][inside])
                    assert torch.equal(now[~inside], trained[p][k][~inside])
    lands = {0: [(1, 1)], 1: [(0, 3), (1, 3)], 2: [(0, 5), (1, 5)], 3: [(0, 7), (1, 7)]}
    want = {names[i]: lands[f] for f, ids in enumerate(sync.fragments) for i in ids}
    assert changed_at == want
    assert sync.in_flight is not None and sync.in_flight.slices == (0, 4, 8)  # round 1's fragment 0


# --- the Nesterov step of a slice -----------------------------------------------------------------------
def test_a_slice_step_equals_the_same_elements_of_the_whole_module_step():
    topo = Topology.grid(2, [1])
    whole = ModuleBank(topo, model(2, vocab=7))
    sliced = ModuleBank(topo, model(2, vocab=7))
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=True)
    a, b = ModuleNesterov(whole, cfg), ModuleNesterov(sliced, cfg)
    m = topo.parts[1].first_module  # the level module: 2 blocks
    n = whole.params[m].numel()
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        g = torch.randn(n, generator=gen)
        a.step({m: g})
        # the same gradient as three slices at different times: elements [100, 200), then the rest
        b.step({m: g}, {m: [(100, 200)]})
        partial_param = sliced.params[m].clone()
        assert torch.equal(partial_param[100:200], whole.params[m][100:200])
        if step == 0:  # the rest has not moved yet, parameters and momentum
            assert torch.equal(partial_param[:100], ModuleBank(topo, model(2, vocab=7)).params[m][:100])
            assert torch.all(b.momentum(m)[:100] == 0) and torch.all(b.momentum(m)[200:] == 0)
        b.step({m: g}, {m: [(0, 100), (200, 250)]})
        b.step({m: g}, {m: [(250, n)]})
        assert torch.equal(sliced.params[m], whole.params[m]), step
        assert torch.equal(b.momentum(m), a.momentum(m)), step
    # a module given no gradient stays as it was, whatever the spans
    before = sliced.params[0].clone()
    b.step({0: None}, {0: [(0, 3)]})
    assert torch.equal(sliced.params[0], before) and b.momentum(0) is None


# --- F = 1, tau = 0, alpha = 0 is DiLoCo, bit for bit ---------------------------------------------------
@pytest.mark.parametrize("fragment", ["blocks:1", "blocks:2"])
def test_one_block_fragment_without_overlap_is_diloco_bit_for_bit(fragment):
    topo = Topology.grid(4, [2, 2])
    make = lambda: model(4, vocab=100)  # noqa: E731  (the embedding and the head are cut too)
    diloco = make_sync(topo, make(), outer="diloco", inner_steps=4)
    stream = make_sync(topo, make(), inner_steps=4, num_fragments=1, fragment=fragment, overlap_steps=0)
    assert len(stream.slices) > len(topo.modules)  # the modules really are cut
    a, _ = drive(diloco, make, rounds=3)
    b, _ = drive(stream, make, rounds=3)
    assert all(torch.equal(x, y) for x, y in zip(diloco.bank.params, stream.bank.params))
    assert all(torch.equal(diloco.nesterov.momentum(m), stream.nesterov.momentum(m)) for m in range(len(topo.modules)))
    for p in a:
        assert all(torch.equal(x, y) for x, y in zip(a[p].parameters(), b[p].parameters()))


@pytest.mark.slow
def test_one_block_fragment_without_overlap_trains_the_diloco_bank_end_to_end(run_cfg):
    cfg = replace(run_cfg, train=replace(run_cfg.train, rounds=2, inner_steps=4))
    diloco = Run(replace(cfg, train=replace(cfg.train, name="diloco"))).train()
    blocks = Run(replace(cfg, train=replace(cfg.train, name="blocks"), outer=replace(
        cfg.outer, sync="streaming", streaming=StreamingConfig(num_fragments=1, overlap_steps=0, fragment="blocks:1")))).train()
    assert len(blocks.sync.slices) == 8  # embedding and head in 2 pieces each, 4 one-block modules
    assert all(torch.equal(x, y) for x, y in zip(diloco.bank.params, blocks.bank.params))


# --- resume with a slice in flight ----------------------------------------------------------------------
@pytest.mark.slow
def test_resume_with_a_slice_in_flight_is_bit_exact(run_cfg):
    stream = StreamingConfig(num_fragments=2, overlap_steps=1, mix_alpha=0.5, fragment="blocks:1")
    cfg = replace(run_cfg, train=replace(run_cfg.train, rounds=3, inner_steps=4),
                  outer=replace(run_cfg.outer, sync="streaming", streaming=stream))
    whole = Run(replace(cfg, train=replace(cfg.train, name="whole"))).train()
    part = replace(cfg, train=replace(cfg.train, name="part"))
    first = Run(part).train(until_round=1)
    flying = first.sync.in_flight
    assert flying is not None
    pieces = [first.sync.slices[i] for i in flying.slices]
    assert any(s.numel < first.bank.params[s.module].numel() for s in pieces)  # part of a module is in flight
    resumed = Run(part).train(resume=True)
    assert all(torch.equal(a, b) for a, b in zip(whole.bank.params, resumed.bank.params))
    for p, loop in whole.loops.items():
        assert all(torch.equal(a, b) for a, b in zip(loop.model.parameters(), resumed.loops[p].model.parameters()))


# --- config errors --------------------------------------------------------------------------------------
def test_config_errors_name_the_key():
    base = ["outer.sync=streaming", "train.inner_steps=12"]
    for bad in ("blocks:0", "blocks:x", "blocks", "block:1", "blocks:-1", "blocks:1.5"):
        with pytest.raises(ConfigError, match=rf"outer.streaming.fragment: '{bad}' is not one of level, module, "
                                              r"blocks:K"):
            load_config(None, [*base, f"outer.streaming.fragment={bad}"])
    with pytest.raises(ConfigError, match="outer.streaming.fragment"):  # YAML reads "blocks:" as a mapping
        load_config(None, [*base, "outer.streaming.fragment=blocks:"])
    assert load_config(None, [*base, "outer.streaming.fragment=blocks:3"]).outer.streaming.fragment == "blocks:3"
    topo = Topology.grid(4, [2, 2])  # 2 blocks per module
    with pytest.raises(ConfigError, match=r"outer.streaming.fragment: blocks:3 but the modules of level0 have only "
                                          r"2 block\(s\)"):
        make_sync(topo, model(4, vocab=84), num_fragments=2, fragment="blocks:3")
    # 11 slices (tied embedding in 2 pieces, 8 one-block level slices, the head's norm)
    with pytest.raises(ConfigError, match="outer.streaming.num_fragments: 12 fragments but outer.streaming.fragment"
                                          "=blocks:1 gives only 11 units"):
        make_sync(topo, model(4, vocab=84, tied=True), inner_steps=12, num_fragments=12, fragment="blocks:1")


# --- two ranks (torch.multiprocessing + gloo) against one process; the peak bytes of a sync -------------
TINY_RUN = dict(hidden=32, intermediate=64, heads=2)  # tests/dipaco/tiny.py's model: blocks of 10,304 values
CASES = {  # name -> (outer.sync, streaming keys, dist keys)
    "diloco": ("diloco", {}, {}),
    "modules": ("streaming", dict(num_fragments=4, overlap_steps=1, mix_alpha=0.5), {}),
    "blocks": ("streaming", dict(num_fragments=4, overlap_steps=1, mix_alpha=0.5, fragment="blocks:1"), {}),
    "blocks_fp4": ("streaming", dict(num_fragments=4, overlap_steps=1, fragment="blocks:1"),
                   dict(comm_dtype="fp4", chunk_size=64, adaptive=True)),
}
BY_RANK = [(0, 3), (1, 2)]  # on a 2x2 grid both ranks then hold every module: everything is communicated


def _tiny_run_model() -> LlamaForCausalLM:
    return model(2, vocab=512, **TINY_RUN)


def _run_case(name: str, world: World, by_rank) -> dict:
    outer, stream, dist = CASES[name]
    topo = Topology.grid(2, [2, 2])
    mine = by_rank[world.rank]
    held = sorted({m for p in mine for m in topo.path_modules(p)})
    sync = make_sync(topo, _tiny_run_model(), by_rank=by_rank, world=world, held=held, outer=outer,
                     rounds=2, dist=DistConfig(**dist), **stream)
    models, reports = drive(sync, _tiny_run_model, rounds=2, paths=mine)
    residuals = sorted(sync.transport.feedback.state_dict()) if sync.transport.feedback is not None else []
    codecs = sorted(sync.transport.adaptive.state_dict()) if sync.transport.adaptive is not None else []
    return {"bank": {m: sync.bank.params[m].clone() for m in held}, "bytes": [r.stats.bytes_sent for r in reports],
            "residuals": residuals, "codecs": codecs, "slices": [s.name for s in sync.slices]}


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    world = World(env=DistEnv(rank=rank, world_size=2), backend="gloo", timeout_s=60.0)
    results = {name: _run_case(name, world, BY_RANK) for name in CASES}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    root = tmp_path_factory.mktemp("blocks_spawn")
    mp.spawn(_worker, args=(str(root / "store"), str(root)), nprocs=2, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_ranks_sync_block_fragments_as_one_process(two_ranks):
    for name in ("diloco", "modules", "blocks"):
        single = _run_case(name, World(), [(0, 1, 2, 3)])
        for rank in range(2):
            for m, value in two_ranks[rank][name]["bank"].items():
                # equal up to the order of the fp32 additions (docs/guide.md: Multi-worker training)
                torch.testing.assert_close(value, single["bank"][m], rtol=0, atol=1e-6)
    # fp4, error-fed, adaptive slices: every holder gets the same bits; residuals are per slice
    a, b = two_ranks[0]["blocks_fp4"], two_ranks[1]["blocks_fp4"]
    assert all(torch.equal(a["bank"][m], b["bank"][m]) for m in a["bank"])
    assert a["residuals"] == sorted(a["slices"]) and "embedding.0[0:8192]" in a["residuals"]
    assert a["codecs"] == sorted(a["slices"])  # an adaptive codec choice per slice


def test_block_fragments_cut_the_peak_sync_to_a_quarter_of_diloco(two_ranks):
    for rank in range(2):
        diloco = max(two_ranks[rank]["diloco"]["bytes"])
        modules = max(two_ranks[rank]["modules"]["bytes"])
        blocks = two_ranks[rank]["blocks"]["bytes"]
        # the modules of the 2x2 grid of 2 blocks cannot make 4 fragments of a quarter each ...
        assert modules / diloco > 0.3
        # ... one-block units can: 4 syncs a round, each a quarter of the model (plus its slices' meta values)
        assert max(blocks) / diloco <= 0.25 * 1.001
        # and a round still sends everything once (bytes are counted when an exchange lands)
        assert sum(blocks) == pytest.approx(2 * diloco, rel=1e-3) and sum(b > 0 for b in blocks) == 8
