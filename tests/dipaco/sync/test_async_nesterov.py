"""AsyncNesterov (delayed Nesterov, arXiv 2401.09135) on hand-computable arrivals; dynamic local steps;
the task queue's staleness bound. Plain torch and Python: no Ray."""

from __future__ import annotations

import pytest
import torch

from dipaco.errors import CheckpointError
from dipaco.model.topology import Topology
from dipaco.sync.async_nesterov import AsyncNesterov, default_delay, dynamic_local_steps, staleness_summary
from dipaco.sync.async_schedule import TaskQueue


def one_module(delay: int, weights=None, lr=0.5, momentum=0.5, start=(1.0, 2.0)) -> AsyncNesterov:
    return AsyncNesterov({0: torch.tensor(start)}, {0: weights or {0: 1.0, 1: 1.0}}, lr, momentum, {0: delay})


def test_delayed_nesterov_by_hand():
    """N=2, eta=0.5, beta=0.5, uniform weights: plain half-steps, the momentum moves every 2nd arrival."""
    sync = one_module(delay=2)
    sync.apply("a", 0, 0, 0, torch.tensor([0.4, 0.0]))  # plain: theta -= 0.5 * g / 2
    assert torch.allclose(sync.params[0], torch.tensor([0.9, 2.0]))
    assert torch.equal(sync.momentum[0], torch.zeros(2))
    # 2nd: mom = 0.5*0 + (0.4+0.2, 0+0.8)/2 = (0.3, 0.4); theta -= 0.5*((0.2,0.8)/2 + 0.5*(0.3,0.4))
    u = sync.apply("b", 1, 0, 0, torch.tensor([0.2, 0.8]))
    assert torch.allclose(sync.momentum[0], torch.tensor([0.3, 0.4]))
    assert torch.allclose(sync.params[0], torch.tensor([0.9 - 0.125, 2.0 - 0.3]))
    assert u.momentum_step and u.staleness == 1 and u.version == 2
    # 3rd, plain again from version 2: buffer was reset, momentum unchanged
    sync.apply("c", 0, 0, 2, torch.tensor([0.0, 0.4]))
    assert torch.allclose(sync.params[0], torch.tensor([0.775, 1.7 - 0.1]))
    assert torch.allclose(sync.momentum[0], torch.tensor([0.3, 0.4]))
    assert [u.staleness for u in sync.log] == [0, 1, 0]


def test_plain_nesterov_is_delay_one():
    """N=1: every arrival is a full torch SGD-Nesterov step."""
    sync = one_module(delay=1, lr=0.7, momentum=0.9)
    ref = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for i, g in enumerate([torch.tensor([0.3, -0.1]), torch.tensor([0.2, 0.5]), torch.tensor([-0.4, 0.1])]):
        sync.apply(f"t{i}", i % 2, 0, i, g)
        ref.grad = g.clone()
        sgd.step()
        assert torch.allclose(sync.params[0], ref.detach(), atol=1e-6)


def test_one_round_of_arrivals_is_diloco():
    """N arrivals from one start version, token-weighted, = torch SGD-Nesterov on DiLoCo's weighted mean."""
    weights = {0: 3.0, 1: 1.0, 2: 2.0}
    sync = AsyncNesterov({0: torch.zeros(4)}, {0: weights}, 0.7, 0.9, {0: 3})
    ref = torch.nn.Parameter(torch.zeros(4))
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(0)
    for r in range(3):
        deltas = {p: torch.randn(4, generator=gen) for p in weights}
        for p in (2, 0, 1):  # any arrival order within the round
            sync.apply(f"p{p}-r{r}", p, 0, 3 * r, deltas[p])
        ref.grad = sum(weights[p] * deltas[p] for p in weights) / sum(weights.values())
        sgd.step()
        assert torch.allclose(sync.params[0], ref.detach(), atol=1e-6)


def test_each_module_steps_at_its_own_lr():
    """A per-module lr: one round of arrivals is torch SGD-Nesterov at that module's lr, for each module."""
    lrs, weights = {0: 0.7, 1: 1.4}, {0: 1.0, 1: 3.0}
    sync = AsyncNesterov({m: torch.zeros(3) for m in lrs}, {m: weights for m in lrs}, lrs, 0.9, {m: 2 for m in lrs})
    refs = {m: torch.nn.Parameter(torch.zeros(3)) for m in lrs}
    sgds = {m: torch.optim.SGD([refs[m]], lr=lrs[m], momentum=0.9, nesterov=True) for m in lrs}
    gen = torch.Generator().manual_seed(1)
    for r in range(3):
        for m in lrs:
            deltas = {p: torch.randn(3, generator=gen) for p in weights}
            for p in (1, 0):
                sync.apply(f"p{p}-r{r}", p, m, 2 * r, deltas[p])
            refs[m].grad = sum(weights[p] * deltas[p] for p in weights) / sum(weights.values())
            sgds[m].step()
            assert torch.allclose(sync.params[m], refs[m].detach(), atol=1e-6)
    assert not torch.allclose(sync.params[0], sync.params[1])


def test_each_task_is_applied_once_and_state_round_trips():
    sync = one_module(delay=2)
    assert sync.apply("a", 0, 0, 0, torch.ones(2)) is not None
    before = sync.params[0].clone()
    assert sync.apply("a", 0, 0, 0, torch.ones(2)) is None  # re-sent: refused
    assert torch.equal(sync.params[0], before) and sync.version(0) == 1
    names = {0: "level0.0"}
    copy = one_module(delay=2)
    copy.load(sync.tensors(names), sync.counters(), names)
    for s in (sync, copy):  # both continue identically, buffer and pending count included
        s.apply("b", 1, 0, 0, torch.tensor([0.5, -1.0]))
    assert torch.equal(sync.params[0], copy.params[0]) and torch.equal(sync.momentum[0], copy.momentum[0])
    assert copy.apply("a", 0, 0, 0, torch.ones(2)) is None  # the restored log still refuses it
    with pytest.raises(CheckpointError, match="level0.0"):
        copy.load({"bank": {}}, sync.counters(), names)


def test_bad_arrivals_are_refused():
    sync = one_module(delay=2)
    with pytest.raises(ValueError, match="does not go through"):
        sync.apply("a", 5, 0, 0, torch.ones(2))
    with pytest.raises(ValueError, match="start version"):
        sync.apply("a", 0, 0, 3, torch.ones(2))
    with pytest.raises(ValueError, match="shape"):
        sync.apply("a", 0, 0, 0, torch.ones(3))


def test_dynamic_local_steps_and_delay_defaults():
    assert [dynamic_local_steps(v, 100.0, 20) for v in (100.0, 50.0, 26.0, 1.0)] == [20, 10, 5, 1]
    assert dynamic_local_steps(30.0, 40.0, 7) == 5  # floor(0.75 * 7)
    assert dynamic_local_steps(0.0, 40.0, 7) == 7  # not measured yet: the full H
    assert default_delay(4, None) == 4 and default_delay(4, 1) == 1
    assert staleness_summary([0, 1, 1, 3])["max"] == 3 and staleness_summary([0, 1, 1, 3])["mean"] == 1.25


def test_queue_bounds_staleness_and_budget():
    """Simulated arrivals with one fast worker and one slow: no update ever staler than S."""
    topo = Topology.from_preset("grid:2x2", 2)
    bound = 3  # the embedding and head are shared by all 4 paths: 3 others at least
    queue = TaskQueue(topo, inner_steps=4, budget=4 * 4 * 6, max_staleness=bound)
    version = {m.id: 0 for m in topo.modules}
    worst, clock, running = 0, 0.0, []
    speeds = [1.0, 1.0, 0.5, 0.2]
    free = list(range(4))
    while not queue.done():
        for w in list(free):
            task = queue.dispatch(w)
            if task is not None:
                free.remove(w)
                running.append((clock + task.steps / speeds[w], task))
        running.sort(key=lambda x: x[0])
        clock, task = running.pop(0)
        queue.sent(task, speeds[task.worker])
        for m, start in task.start.items():
            worst = max(worst, version[m] - start)
            version[m] += 1
        queue.applied(task)
        free.append(task.worker)
    assert worst <= bound and queue.steps_done == 96
    assert sum(queue.next_index.values()) == queue.completed


def test_rounds_schedule_is_lock_step():
    topo = Topology.from_preset("grid:2x2", 2)
    queue = TaskQueue(topo, inner_steps=5, budget=2 * 5 * 4, schedule="rounds")
    first = [queue.dispatch(w) for w in range(4)]
    assert {t.path for t in first} == {0, 1, 2, 3} and all(t.index == 0 for t in first)
    queue.sent(first[0], 1.0)
    queue.applied(first[0])
    assert queue.dispatch(0) is None  # path 0's round 2 waits for the others
    for t in first[1:]:
        queue.sent(t, 1.0)
        queue.applied(t)
    assert queue.dispatch(0).index == 1


def test_dispatch_among_a_workers_own_paths_then_any():
    """Path affinity (issue 72): a worker asks first for a path whose AdamW state it made."""
    topo = Topology.from_preset("grid:2x2", 2)
    queue = TaskQueue(topo, inner_steps=5, budget=5 * 4 * 2)
    assert queue.dispatch(0, among={2}).path == 2
    assert queue.dispatch(1, among={2}) is None  # path 2 is running: nothing else of "its own"
    assert queue.dispatch(1, among=set()) is None
    assert queue.dispatch(1).path != 2


def test_lost_deltas_run_the_task_again_first_in_line():
    """A sent task whose deltas went with their node: the module clocks go back and the same task id runs
    again, before new work (an executor that took it refuses it then)."""
    topo = Topology.from_preset("grid:2x2", 2)
    queue = TaskQueue(topo, inner_steps=5, budget=5 * 4 * 2)
    task = queue.dispatch(0)
    before = dict(queue.clock)
    queue.sent(task, 1.0)
    assert queue.clock != before
    queue.lost(task)
    assert queue.clock == before and not queue.sending and queue.completed == 0
    again = queue.dispatch(1)
    assert again is task and again.id == task.id and again.worker == 1
    queue.sent(again, 1.0)
    queue.applied(again)
    assert queue.completed == 1 and queue.steps_done == 5


def test_a_round_of_arrivals_in_path_order_is_the_lock_step_step_bit_for_bit():
    """The executors' outer step is the lock-step kernel: a 2x2 grid's round of arrivals (every path once,
    in path order, token weights, outer.rescale and a larger embedding/head step) gives the bank and the
    momentum DiLoCo gives, tensor for tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dipaco.comm.world import World
    from dipaco.config import DistConfig, OuterConfig
    from dipaco.model.bank import ModuleBank
    from dipaco.sync import SyncContext
    from dipaco.sync.diloco import DiLoCo
    from dipaco.sync.nesterov import module_outer_lr

    torch.manual_seed(0)
    template = LlamaForCausalLM(LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8))
    topo = Topology.from_preset("grid:2x2", 2)
    outer = OuterConfig(lr=0.7, momentum=0.9, rescale="sqrt_paths", embedding_head_lr_scale=1.5)
    weights = {0: 1234.0, 1: 987.0, 2: 1500.0, 3: 1111.0}
    bank = ModuleBank(topo, template)
    diloco = DiLoCo(SyncContext(outer, DistConfig(), 4, 3, 0, topo, bank, weights, [(0, 1, 2, 3)], World()))
    through = {m.id: topo.paths_through(m.id) for m in topo.modules}
    executors = {m: AsyncNesterov({m: bank.params[m].detach()}, {m: {p: weights[p] for p in through[m]}},
                                  module_outer_lr(outer, topo, m), outer.momentum, {m: len(through[m])},
                                  rescale=outer.rescale)
                 for m in through}
    gen = torch.Generator().manual_seed(1)
    for r in range(3):
        paths = {p: bank.compose(p, LlamaForCausalLM(template.config)) for p in range(4)}
        with torch.no_grad():
            for model in paths.values():  # a "round of training"
                for prm in model.parameters():
                    prm.add_(torch.randn(prm.shape, generator=gen) * 0.01)
        start = {m.id: executors[m.id].version(m.id) for m in topo.modules}  # every task starts from the round's modules
        for p in range(4):  # the executors take each path's change, in path order
            for part, m in zip(topo.parts, topo.path_modules(p)):
                delta = bank.params[m] - bank.path_vector(paths[p], part)
                executors[m].apply(f"p{p}-r{r}", p, m, start[m], delta)
        diloco.at(r, 4, paths)
        for m in topo.modules:
            assert torch.equal(executors[m.id].params[m.id], bank.params[m.id]), (r, m.name)
            assert torch.equal(executors[m.id].momentum[m.id], diloco.nesterov.momentum(m.id)), (r, m.name)
