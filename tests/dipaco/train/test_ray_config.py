"""The config errors of the Ray driver, each naming its key (no Ray needed)."""

from __future__ import annotations

import pytest

from dipaco.config import load_config
from dipaco.errors import ConfigError
from dipaco.model.topology import Topology
from dipaco.train.ray_driver import check_staleness_bound, executor_groups, executor_outer_lr, worker_speeds

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
    check_staleness_bound(load_config(None, [*ASYNC, "ray.max_staleness=3"]), topo)
    with pytest.raises(ConfigError, match="ray.max_staleness: 2 is below 3"):
        check_staleness_bound(load_config(None, [*ASYNC, "ray.max_staleness=2"]), topo)


def test_workers_and_executor_groups():
    assert worker_speeds(load_config(None, ASYNC), 4) == [1.0] * 4
    assert worker_speeds(load_config(None, [*ASYNC, "ray.simulate_speeds=[1.0,0.25]"]), 4) == [1.0, 0.25]
    assert worker_speeds(load_config(None, [*ASYNC, "ray.num_workers=2"]), 4) == [1.0, 1.0]
    assert executor_groups(6, None) == [[0], [1], [2], [3], [4], [5]]
    assert executor_groups(6, 4) == [[0, 4], [1, 5], [2], [3]]
    assert executor_groups(2, 5) == [[0], [1]]


def test_executors_step_at_the_lock_step_outer_lr_of_their_module():
    """outer.embedding_head_lr_scale and outer.rescale reach the executors as each module's lr; on a 2x2
    grid the shared embedding and head have 4 paths through them, each level module 2."""
    topo = Topology.from_preset("grid:2x2", 2)
    kinds = {m.id: m.part.kind for m in topo.modules}
    cfg = load_config(None, [*ASYNC, "outer.lr=0.5", "outer.embedding_head_lr_scale=1.5", "outer.rescale=sqrt_paths"])
    lrs = {m: executor_outer_lr(cfg, topo, m) for m in kinds}
    for m, kind in kinds.items():
        expected = 0.5 * 1.5 * 2.0 if kind in ("embedding", "head") else 0.5 * 2 ** 0.5
        assert lrs[m] == pytest.approx(expected), (kind, lrs[m])
    inverse = load_config(None, [*ASYNC, "outer.lr=0.5", "outer.rescale=inv_sqrt_paths"])
    assert sorted({executor_outer_lr(inverse, topo, m) for m in kinds}) == pytest.approx([0.25, 0.5 / 2 ** 0.5])
    assert {executor_outer_lr(load_config(None, ASYNC), topo, m) for m in kinds} == {0.7}
