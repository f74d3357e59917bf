"""train.compile=true on CPU: the same bank as eager after a round, unchanged parameter names, and
one compilation shared by every path of the rank (a recompile per path or round is a defect)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from dipaco.build import build_trainer
from dipaco.comm.world import World

pytestmark = pytest.mark.slow


def experiment(cfg, compile: bool):
    cfg = replace(cfg, train=replace(cfg.train, compile=compile, rounds=2, inner_steps=3))
    return build_trainer(cfg, World(device=torch.device("cpu")))


def test_compiled_paths_match_eager_and_compile_once(run_cfg):
    torch.manual_seed(0)
    eager = experiment(run_cfg, compile=False)
    for r in range(2):
        eager.scheduler.run_round(r)

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled = experiment(run_cfg, compile=True)
    first = next(iter(compiled.loops.values()))
    first.train_step()  # compiles forward and backward once
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    compiled = experiment(run_cfg, compile=True)  # fresh loops and bank; the compile cache stays warm
    for r in range(2):
        compiled.scheduler.run_round(r)
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled for another path or round"

    for loop in compiled.loops.values():
        assert not any(n.startswith("_orig_mod") for n, _ in loop.model.named_parameters())
        assert loop.forward is not loop.model
    assert [n for n, _ in compiled.loops[0].model.named_parameters()] == \
        [n for n, _ in eager.loops[0].model.named_parameters()]
    for a, b in zip(eager.bank.params, compiled.bank.params):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    changed = max((a - b).abs().max().item() for a, b in zip(eager.bank.params, compiled.bank.params))
    assert changed < 1e-3
