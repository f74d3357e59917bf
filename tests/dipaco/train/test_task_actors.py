"""The Ray actors as plain classes, without Ray: a path worker's tasks."""

from __future__ import annotations

import torch

from dipaco.config import ModelConfig, OptimConfig, TopologyConfig
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model, llama_config
from dipaco.model.topology import topology_from_config
from dipaco.paths.factory import LoopSettings, PathLoops
from dipaco.train.task_actors import PathWorker


def test_one_worker_model_serves_every_path_and_a_stopped_task_continues_from_its_parameters():
    """A worker keeps one model for every path (composing a path overwrites all of its parameters): path 0's
    task after one of path 3 hands back what a fresh worker's does, and ``params`` continues a task mid-way."""
    topology = topology_from_config(TopologyConfig(preset="grid:2x2", embedding="path", head="path"), 2)
    llama = llama_config(ModelConfig(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2), 128, 64, 0, 1)
    gen = torch.Generator().manual_seed(0)
    shards = {p: torch.randint(0, 128, (16, 64), generator=gen) for p in range(topology.num_paths)}
    path_loops = PathLoops(shards, LoopSettings(optim=OptimConfig(batch_size=4, warmup_steps=1), total_steps=10,
                                                precision="fp32"), seed=0)
    bank = ModuleBank(topology, build_model(llama, seed=1))
    with torch.no_grad():
        for m in range(len(topology.modules)):  # every module different, so a parameter left over from another path would show
            bank.params[m].add_(0.01 * m)

    def modules(p: int) -> list[torch.Tensor]:
        return [bank.params[m].clone() for m in topology.path_modules(p)]

    used = PathWorker(1.0, path_loops, llama, topology)
    used.run(3, 2, None, *modules(3))
    after_other = used.run(0, 2, None, *modules(0))
    fresh = PathWorker(1.0, path_loops, llama, topology).run(0, 2, None, *modules(0))
    assert after_other[0]["loss"] == fresh[0]["loss"]
    assert all(torch.equal(a, b) for a, b in zip(after_other[3:], fresh[3:]))
    assert after_other[2] is None  # not stopped: no parameters of its own

    # two steps, then one more from the first step's parameters and AdamW state: the same as three at once
    first = PathWorker(1.0, path_loops, llama, topology)
    meta, state, _, *_ = first.run(0, 1, None, *modules(0))
    params = {n: v.detach().clone() for n, v in first.model.named_parameters()}
    continued = PathWorker(1.0, path_loops, llama, topology).run(0, 1, state, *modules(0), params=params)
    straight = PathWorker(1.0, path_loops, llama, topology).run(0, 2, None, *modules(0))
    assert meta["steps"] == 1 and continued[1]["step"] == straight[1]["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(continued[3:], straight[3:]))
