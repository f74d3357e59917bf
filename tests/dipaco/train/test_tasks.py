"""The Ray driver (train.driver=ray) end to end on the tiny 2x2 run: an asynchronous run that stops,
resumes and is evaluated by `dipaco eval`; a worker and an executor killed mid-run; lock-step rounds
that reproduce per-module DiLoCo. One embedded Ray (2 CPUs) for the module."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from dipaco.checkpoint.store import CheckpointManager, load_bank_state
from dipaco.config import Config
from dipaco.metrics import read_metrics
from dipaco.run import Run, apply_overrides

ray = pytest.importorskip("ray", reason='the Ray driver needs Ray: pip install -e ".[ray]" (dev includes it)')

from dipaco.train.task_actors import ExecutorSpec, ModuleExecutor  # noqa: E402


def executor(init: dict, **spec) -> ModuleExecutor:
    """Constructed as Ray constructs it, from its spec: from its first checkpoint, or the newest after a crash."""
    spec_ = ExecutorSpec(**spec)
    if not Path(spec_.root).exists():
        ModuleExecutor.write_start(spec_, init)
    return ModuleExecutor(spec_)

ASYNC = ["train.driver=ray", "outer.sync=async_nesterov", "run.progress=false", "ray.executors=2"]


@pytest.fixture(scope="module")
def ray_session():
    import signal

    # ray.init installs a SIGTERM handler that calls sys.exit and ray.shutdown leaves it: a later test that
    # sends itself SIGTERM would end this pytest worker (tests/signal_guard.py).
    before = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    signal.signal(signal.SIGTERM, before)


def with_overrides(cfg: Config, *overrides: str) -> Config:
    return apply_overrides(cfg, [*ASYNC, *overrides])


def completed_tasks(exp_dir: Path) -> list[dict]:
    return read_metrics(exp_dir / "metrics.jsonl", "task")


def check_exactly_once(exp_dir: Path, topology_modules: dict[int, list[str]]) -> None:
    """Every completed task is in the update log of each of its path's modules exactly once, and the
    logs hold nothing else."""
    tasks = completed_tasks(exp_dir)
    applied = applied_updates(exp_dir)
    expected = {(name, t["task"]) for t in tasks for name in topology_modules[t["path"]]}
    assert set(applied) == expected
    assert set(applied.values()) == {1}


def applied_updates(exp_dir: Path) -> Counter:
    """(module, task id) -> times applied, from the executors' update logs in the newest run checkpoint."""
    from dipaco.checkpoint.store import SavedCheckpoint

    executors = SavedCheckpoint(CheckpointManager(exp_dir / "checkpoints").latest()).state()["scheduler"]["executors"]
    return Counter((module, update["task"]) for module, counters in executors.items() for update in counters["log"])


def modules_by_path(cfg: Config) -> dict[int, list[str]]:
    from dipaco.model.topology import topology_from_config

    topo = topology_from_config(cfg.topology, cfg.model.num_layers)
    return {p: [topo.modules[m].name for m in topo.path_modules(p)] for p in range(topo.num_paths)}


def test_async_run_stops_resumes_with_more_rounds_and_evaluates(ray_session, run_cfg):
    from dipaco.cli import main

    cfg = with_overrides(run_cfg, "ray.simulate_speeds=[1.0,0.5]", "train.dynamic_local_steps=true",
                         "ray.max_staleness=4")
    exp = Run(cfg).train(until_round=1)
    first = completed_tasks(exp.dir)
    assert sum(t["steps"] for t in first) == 5 * 4  # one round's worth of inner steps
    # Issue 48: `--resume train.rounds=N` with a larger N continues the run, under the Ray driver too
    cfg = with_overrides(cfg, "train.rounds=3")
    exp = Run(cfg).train(resume=True)
    tasks = completed_tasks(exp.dir)
    assert sum(t["steps"] for t in tasks) == 3 * 5 * 4  # the extended budget, nothing counted twice
    assert max(s for t in tasks for s in t["staleness"].values()) <= 4
    assert len({t["task"] for t in tasks}) == len(tasks)
    summary = read_metrics(exp.dir / "metrics.jsonl", "async")[-1]
    assert summary["inner_steps"] == 60 and summary["requeues"] == 0
    latest = CheckpointManager(exp.dir / "checkpoints").latest()
    assert latest.name == f"round_{len(tasks):06d}"

    assert main(["eval", *overrides_of(cfg)]) == 0  # the final bank, read like a synchronous run's
    report = json.loads((exp.dir / "eval.json").read_text())
    assert report["checkpoint"].endswith(latest.name) and torch.isfinite(torch.tensor(report["overall"]["ppl"]))


def overrides_of(cfg: Config) -> list[str]:
    """The tiny run's config as CLI overrides (eval reads the same experiment)."""
    from tiny import TINY

    return [*TINY, f"run.dir={cfg.run.dir}", f"data.corpus={cfg.data.corpus}", *ASYNC,
            "ray.simulate_speeds=[1.0,0.5]", "train.dynamic_local_steps=true", "ray.max_staleness=4", "train.rounds=3"]


def signal_mid_task(run, sent: list[str], signum) -> None:
    """Sends ``signum`` to this process once the task of every worker has done a step (a thread, from on_start),
    so that each is stopped mid-way. Counted, not timed: a fixed time after dispatch found a loaded machine's
    tasks not yet at their first step, and an idle one's nearly done."""
    import os

    def steps_done(worker) -> int:
        """Run in a path worker, beside its task (Ray's __ray_call__): the steps its task has done, read from the
        frame of its inner loop's run (0 before the loop starts)."""
        import sys

        from dipaco.paths.inner import InnerLoop

        for frame in sys._current_frames().values():
            while frame is not None:
                if frame.f_code is InnerLoop.run.__code__:
                    return int(frame.f_locals.get("i", 0))  # the step in progress: as many are done
                frame = frame.f_back
        return 0

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            running = list(run.flight.queue.running.values())
            if len(running) == len(run.flight.workers) and all(
                    ray.get(run.flight.workers[t.worker].__ray_call__.remote(steps_done), timeout=60) > 0
                    for t in running):
                sent.append(signum.name)
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.02)
        sent.append("no moment in 300 s with every worker's task a step in")

    threading.Thread(target=watch, daemon=True).start()


def stopped_by(signum, cfg: Config) -> None:
    """Trains ``cfg`` as `dipaco train` does (the signal handlers, SIGTERM's as before ray.init) until the signal."""
    import signal

    from dipaco.runtime import sigint_stops_training

    sent: list[str] = []
    ray_handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as before ray.init in a fresh `dipaco train`
    stopped = False
    try:
        with sigint_stops_training():
            Run(cfg).train(on_start=lambda run: signal_mid_task(run, sent, signum))
    except KeyboardInterrupt:
        stopped = True
    finally:
        signal.signal(signal.SIGTERM, ray_handler)
    assert stopped and sent == [signum.name], sent  # else: why no signal was sent


def test_a_signal_stops_each_task_after_its_step_in_progress_and_resume_loses_no_step(ray_session, run_cfg, capsys):
    """Issue 48: SIGTERM (as SIGINT) under the Ray driver lost every task since the last run checkpoint.
    Now each running task stops after its step in progress and is checkpointed as it is; --resume
    continues it there and finishes the budget with every update applied exactly once."""
    import signal

    from dipaco.checkpoint.store import SavedCheckpoint

    steps = 60  # long enough tasks that the signal finds one mid-way
    cfg = with_overrides(run_cfg, f"train.inner_steps={steps}", "ray.num_workers=2")  # 2 actors fewer to start
    stopped_by(signal.SIGTERM, cfg)
    out = capsys.readouterr().out
    assert "stopped after" in out and "--resume continues it there" in out and "checkpoint is" in out
    exp_dir = Path(cfg.run.dir) / "train" / cfg.train.name
    latest = CheckpointManager(exp_dir / "checkpoints").latest()
    paused = SavedCheckpoint(latest).state()["scheduler"]["paused"]
    assert paused and all(0 < task["done"] < steps for task in paused.values())  # stopped mid-task, kept there
    assert latest.name == f"round_{len(completed_tasks(exp_dir)):06d}"

    exp = Run(cfg).train(resume=True)
    tasks = completed_tasks(exp.dir)
    assert all(t["steps"] == steps for t in tasks) and len(tasks) == 2 * 4  # no task cut short
    assert len({t["task"] for t in tasks}) == len(tasks)
    check_exactly_once(exp.dir, modules_by_path(cfg))


def test_a_signal_then_resume_ends_bit_exactly_where_arrivals_are_deterministic(ray_session, run_cfg,
                                                                               sigint_from_a_terminal):
    """ray.schedule=rounds with one worker: its arrivals come in one order, so an uninterrupted run is
    reproducible, and a run stopped by SIGINT mid-task and resumed must end with every tensor equal to it."""
    import signal

    from dipaco.checkpoint.compare import compare_checkpoints
    from dipaco.checkpoint.store import SavedCheckpoint

    lockstep = ["ray.schedule=rounds", "ray.num_workers=1", "train.inner_steps=80"]  # tasks of about half a second
    straight = Run(with_overrides(run_cfg, *lockstep, "train.name=straight")).train()
    cfg = with_overrides(run_cfg, *lockstep, "train.name=stopped")
    stopped_by(signal.SIGINT, cfg)
    exp_dir = Path(cfg.run.dir) / "train" / "stopped"
    paused = SavedCheckpoint(CheckpointManager(exp_dir / "checkpoints").latest()).state()["scheduler"]["paused"]
    assert len(paused) == 1 and 0 < next(iter(paused.values()))["done"] < 80  # its one worker's task, mid-way
    exp = Run(cfg).train(resume=True)
    a, b = (CheckpointManager(e.dir / "checkpoints").latest() for e in (straight, exp))
    assert a.name == b.name
    assert compare_checkpoints(a, b)[1] == []


def test_ray_init_keeps_the_trainers_sigterm_handler():
    """ray.init makes SIGTERM call sys.exit: under `dipaco train` that ended a Ray run with no checkpoint."""
    import signal
    import sys
    from types import SimpleNamespace

    from dipaco.train.tasks import init_ray

    def ours(signum, frame) -> None:
        pass

    fake = SimpleNamespace(init=lambda **_: signal.signal(signal.SIGTERM, lambda *a: sys.exit(a[0])))
    before = signal.signal(signal.SIGTERM, ours)
    try:
        init_ray(fake, num_cpus=1)
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


def test_killed_worker_and_executor_lose_no_update(ray_session, run_cfg):
    """A slow worker is killed mid-task and an executor is killed mid-run: the task is re-queued, the
    executor restarts from its own checkpoint, and every update is applied exactly once."""
    # speed 0.1: worker 1 spends ~10x its compute time in each task, so the drill finds it busy on an idle machine too
    cfg = with_overrides(run_cfg, "ray.simulate_speeds=[1.0,0.1]", "train.rounds=2")
    killed: dict[str, int] = {"worker": 0, "executor": 0}

    def drill(run) -> None:
        def kill() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not killed["worker"]:
                running = list(run.flight.queue.running.values())
                busy = [t for t in running if t.worker == 1 and time.monotonic() - t.started > 0.2]
                if busy:
                    ray.kill(run.flight.workers[1], no_restart=False)
                    killed["worker"] += 1
                time.sleep(0.05)
            while time.monotonic() < deadline and run.flight.queue.completed < 2:
                time.sleep(0.05)
            ray.kill(run.flight.executors[1], no_restart=False)  # level0.0 or the like: a shared module
            killed["executor"] += 1

        threading.Thread(target=kill, daemon=True).start()

    exp = Run(cfg).train(on_start=drill)
    assert killed == {"worker": 1, "executor": 1}
    assert read_metrics(exp.dir / "metrics.jsonl", "requeue")
    tasks = completed_tasks(exp.dir)
    assert sum(t["steps"] for t in tasks) == 2 * 5 * 4
    check_exactly_once(exp.dir, modules_by_path(cfg))


def test_an_executor_killed_as_a_run_checkpoint_starts_loses_nothing(ray_session, run_cfg):
    """An executor restarting while the driver reads the executors' states for a run checkpoint is asked
    again once it is back (CI found ActorUnavailableError raised out of checkpoint() instead)."""
    cfg = with_overrides(run_cfg, "train.rounds=2", "ray.num_workers=2")
    killed: list[str] = []

    def drill(run) -> None:
        write = run.checkpoint

        def killed_first():
            if not killed:
                ray.kill(run.flight.actors[0], no_restart=False)
                killed.append(run.flight.checkpoint_due and "due" or "final")
            return write()

        run.checkpoint = killed_first

    exp = Run(cfg).train(on_start=drill)
    assert killed
    tasks = completed_tasks(exp.dir)
    assert sum(t["steps"] for t in tasks) == 2 * 5 * 4
    check_exactly_once(exp.dir, modules_by_path(cfg))
    latest = CheckpointManager(exp.dir / "checkpoints").latest()
    assert latest.name == f"round_{len(tasks):06d}"


def test_rounds_schedule_reproduces_diloco(ray_session, run_cfg, tmp_path):
    """ray.schedule=rounds with the default delay applies the same outer steps as outer.sync=diloco,
    per-module outer lrs included (a larger embedding/head step, the sqrt(paths) rescale), and a path step
    accumulated over micro-batches on the Ray workers as in one process."""

    per_module = ["outer.embedding_head_lr_scale=1.5", "outer.rescale=sqrt_paths", "train.optim.micro_batch_size=2"]
    ray_exp = Run(with_overrides(run_cfg, "ray.schedule=rounds", "train.name=on_ray", *per_module)).train()
    sync_exp = Run(apply_overrides(run_cfg, ["train.name=diloco", *per_module])).train()
    on_ray = load_bank_state(CheckpointManager(ray_exp.dir / "checkpoints").latest())
    diloco = load_bank_state(CheckpointManager(sync_exp.dir / "checkpoints").latest())
    assert set(on_ray) == set(diloco)
    round_1 = load_bank_state(CheckpointManager(sync_exp.dir / "checkpoints").checkpoints()[0])
    moved = max(float((diloco[k] - round_1[k]).abs().max()) for k in diloco)
    worst = max(float((on_ray[k] - diloco[k]).abs().max()) for k in diloco)
    assert moved > 1e-3 and worst < 1e-4, (moved, worst)  # fp32 sums in another order, nothing more


def test_executor_restores_its_checkpoint(tmp_path):
    """Constructed again (as Ray does after a crash), an executor continues from its newest checkpoint."""
    args = dict(names={0: "level0.0"}, init={0: torch.zeros(3)}, path_weights={0: {0: 2.0, 1: 1.0}}, lr=0.7,
                momentum=0.9, delay={0: 2}, root=str(tmp_path / "executor_000"), every=1, config_yaml="{}\n")
    first = executor(**args)
    first.push("p000-t0000", 0, 0, 0, torch.tensor([0.1, 0.2, 0.3]))
    first.push("p001-t0000", 1, 0, 0, torch.tensor([0.3, -0.2, 0.0]))
    first.push("p000-t0001", 0, 0, 2, torch.tensor([0.0, 0.1, 0.1]))
    again = executor(**args)
    assert again.restored_from == "round_000003" and len(again.sync.log) == 3
    tensors, counters = again.state()
    want, _ = first.state()
    for stem in want:
        assert torch.equal(tensors[stem]["level0.0"], want[stem]["level0.0"])
    assert again.push("p000-t0001", 0, 0, 2, torch.tensor([9.0, 9.0, 9.0])) is None  # already applied
    assert counters["pending"] == {0: 1}


def test_a_restarted_executor_takes_a_task_that_started_after_its_lost_updates(tmp_path):
    """Killed between an update and its checkpoint, an executor restarts one version back; a task that
    pulled the lost version can arrive before the driver's resend of it (found by the kill test)."""
    args = dict(names={0: "level0.0"}, init={0: torch.zeros(3)}, path_weights={0: {0: 1.0, 1: 1.0}}, lr=0.7,
                momentum=0.9, delay={0: 2}, root=str(tmp_path / "executor_000"), every=2, config_yaml="{}\n")
    first = executor(**args)
    first.push("p000-t0000", 0, 0, 0, torch.tensor([0.1, 0.2, 0.3]))
    first.push("p001-t0000", 1, 0, 0, torch.tensor([0.3, -0.2, 0.0]))  # checkpointed at version 2
    first.push("p000-t0001", 0, 0, 2, torch.tensor([0.0, 0.1, 0.1]))  # version 3: lost with the actor
    again = executor(**args)
    assert again.restored_from == "round_000002" and again.sync.version(0) == 2
    update = again.push("p001-t0001", 1, 0, 3, torch.tensor([0.1, 0.0, 0.0]))  # pulled version 3
    assert update is not None and update["staleness"] == 0
    assert again.push("p000-t0001", 0, 0, 2, torch.tensor([0.0, 0.1, 0.1])) is not None  # the resend
    assert len(again.sync.log) == 4
    assert {u["task"] for u in again.sync.counters()["log"]} == {"p000-t0000", "p001-t0000", "p000-t0001", "p001-t0001"}



def test_the_gpu_checks_ray_task_runs_the_path_worker_of_today(ray_session):
    """The GPU check's Ray task built PathWorker with the arguments of an older version (a TypeError on the first
    lent GPU): tests/dipaco/test_device_paths.py's task, run here on CPU, in the module's Ray."""
    from test_device_paths import TINY, path_worker_task

    got = path_worker_task(TINY, torch.device("cpu"))
    assert got["worker_device"] == "cpu" and got["meta"]["tokens"] == 2 * TINY.batch * TINY.seq_len
    assert got["moved"] > 0 and got["meta"]["loss"] > 0 and got["state"]["step"] == 2
