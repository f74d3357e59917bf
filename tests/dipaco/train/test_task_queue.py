"""The config errors of the Ray driver, each naming its key (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from dipaco.errors import ConfigError
from dipaco.model.topology import Topology
from dipaco.run import load_config
from dipaco.sync.async_nesterov import AsyncNesterov
from dipaco.sync.async_schedule import check_staleness_bound
from dipaco.sync.nesterov import module_outer_lr
from dipaco.train.tasks import executor_groups, worker_speeds

ASYNC = ["train.driver=ray", "outer.sync=async_nesterov"]


@pytest.mark.parametrize("overrides, message", [
    (["train.driver=ray"], "train.driver: ray runs outer.sync=async_nesterov"),
    (["outer.sync=async_nesterov"], "outer.sync: async_nesterov has no rounds to run under torchrun"),
    (["train.dynamic_local_steps=true"], "train.dynamic_local_steps: needs train.driver=ray"),
    (["train.driver=slurm"], "train.driver: 'slurm' is not one of torchrun, ray"),
    ([*ASYNC, "ray.schedule=sometimes"], "ray.schedule: 'sometimes' is not one of async, rounds"),
    ([*ASYNC, "outer.nesterov_delay=0"], "outer.nesterov_delay: must be >= 1 or null"),
    ([*ASYNC, "ray.simulate_speeds=[1.0,0.0]"], r"ray.simulate_speeds\[1\]: must be in \(0, 1\]"),
    ([*ASYNC, "ray.simulate_speeds=[1.0,1.5]"], r"ray.simulate_speeds\[1\]: must be in \(0, 1\]"),
    ([*ASYNC, "ray.simulate_speeds=[]"], "ray.simulate_speeds: must list one speed per worker"),
    ([*ASYNC, "ray.simulate_speeds=[1.0,0.5]", "ray.num_workers=3"], "ray.simulate_speeds: 2 speeds for ray.num_workers=3"),
    ([*ASYNC, "ray.num_workers=0"], "ray.num_workers: must be > 0"),
    ([*ASYNC, "ray.num_cpus=0"], "ray.num_cpus: must be > 0"),
    ([*ASYNC, "ray.executors=0"], "ray.executors: must be > 0"),
    ([*ASYNC, "ray.max_staleness=-1"], "ray.max_staleness: must be >= 0"),
    ([*ASYNC, "ray.task_retries=-1"], "ray.task_retries: must be >= 0"),
    ([*ASYNC, "ray.checkpoint_every=0"], "ray.checkpoint_every: must be > 0"),
    ([*ASYNC, "ray.executor_checkpoint_every=0"], "ray.executor_checkpoint_every: must be > 0"),
    ([*ASYNC, "ray.state_sync_every=0"], "ray.state_sync_every: must be > 0, got 0"),
    ([*ASYNC, "ray.worker_cpus=0"], r"ray.worker_cpus: must be > 0 or null, got 0"),
    ([*ASYNC, "ray.worker_cpus=-0.5"], r"ray.worker_cpus: must be > 0 or null, got -0.5"),
    ([*ASYNC, "ray.worker_cpus=inf"], r"ray.worker_cpus: must be > 0 or null, got inf"),
    ([*ASYNC, "dist.comm_dtype=int8"], "dist.comm_dtype: 'int8' is not supported by train.driver=ray"),
    ([*ASYNC, "outer.drop_prob=0.5"], "outer.drop_prob: 0.5 is not supported by train.driver=ray"),
    ([*ASYNC, "train.early_stopping_holdout=0.1"], "train.early_stopping_holdout: 0.1 is not supported"),
    ([*ASYNC, "outer.nesterov=false"], "outer.nesterov: False is not supported"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_staleness_bound_must_allow_the_other_paths_of_a_module():
    topo = Topology.from_preset("grid:2x2", 2)  # the shared embedding and head: 4 paths each
    check_staleness_bound(load_config(None, [*ASYNC, "ray.max_staleness=3"]).ray.max_staleness, topo)
    with pytest.raises(ConfigError, match="ray.max_staleness: 2 is below 3"):
        check_staleness_bound(load_config(None, [*ASYNC, "ray.max_staleness=2"]).ray.max_staleness, topo)


def test_workers_and_executor_groups():
    assert worker_speeds(load_config(None, ASYNC).ray, 4) == [1.0] * 4
    assert worker_speeds(load_config(None, [*ASYNC, "ray.simulate_speeds=[1.0,0.25]"]).ray, 4) == [1.0, 0.25]
    assert worker_speeds(load_config(None, [*ASYNC, "ray.num_workers=2"]).ray, 4) == [1.0, 1.0]
    assert executor_groups(6, None) == [[0], [1], [2], [3], [4], [5]]
    assert executor_groups(6, 4) == [[0, 4], [1, 5], [2], [3]]
    assert executor_groups(2, 5) == [[0], [1]]


def test_executors_take_the_lock_step_outer_lr_and_the_rescale_on_the_gradient():
    """outer.embedding_head_lr_scale reaches each executor as its module's lr (module_outer_lr, the lock-step
    rule); outer.rescale scales the outer gradient, as the lock-step sync does. On a 2x2 grid the shared
    embedding and head have 4 paths through them, each level module 2: one round of arrivals is torch
    SGD-Nesterov at the module's lr on sqrt(paths) times the weighted mean change."""
    topo = Topology.from_preset("grid:2x2", 2)
    cfg = load_config(None, [*ASYNC, "outer.lr=0.5", "outer.embedding_head_lr_scale=1.5", "outer.rescale=sqrt_paths"])
    gen = torch.Generator().manual_seed(0)
    for module in topo.modules:
        lr = module_outer_lr(cfg.outer, topo, module.id)
        assert lr == pytest.approx(0.75 if module.part.kind in ("embedding", "head") else 0.5)
        through = topo.paths_through(module.id)
        weights = {p: 1.0 + p for p in through}
        sync = AsyncNesterov({0: torch.zeros(3)}, {0: weights}, lr, 0.9, {0: len(through)}, rescale="sqrt_paths")
        deltas = {p: torch.randn(3, generator=gen) for p in through}
        for p in through:
            sync.apply(f"p{p}", p, 0, 0, deltas[p])
        ref = torch.nn.Parameter(torch.zeros(3))
        sgd = torch.optim.SGD([ref], lr=lr, momentum=0.9, nesterov=True)
        mean = sum(weights[p] * deltas[p] for p in through) / sum(weights.values())
        ref.grad = mean * len(through) ** 0.5
        sgd.step()
        assert torch.allclose(sync.params[0], ref.detach(), atol=1e-6), module.name
