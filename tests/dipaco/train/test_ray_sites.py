"""The Ray driver across two sites (network namespaces with a shaped link each, bench.netns), as a lab runs it on
two machines: a Ray head and the driver on site 0, a node started with ``ray start --address`` on site 1 mid-run.
The path worker the head had no room for (``ray.worker_cpus=1``) starts on the new node and takes tasks there; the
site is then lost outright (every process on it killed), its task goes back to the queue, and the run goes on at
site 0. Every update is applied exactly once throughout (issue 72).

Needs root (CI runs as root); a machine that cannot make namespaces skips with the reason."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from bench.netns import PROFILES, RayCluster, Sites, unavailable
from dipaco.config import Config, save_config
from dipaco.metrics import read_metrics

pytest.importorskip("ray", reason='the Ray driver needs Ray: pip install -e ".[ray]" (dev includes it)')

from test_tasks import check_exactly_once, modules_by_path  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
# The budget is far more than the test needs: it stops the run with SIGTERM (which checkpoints every applied
# task) once the joiner has come and gone.
TRAIN = ("train.name=ray_sites", "train.rounds=400", "ray.num_workers=2", "ray.state_sync_every=4",
         "ray.checkpoint_every=2")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]


ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _copied_run(prepared_run, tmp_path: Path) -> tuple[Config, Path]:
    """A copy of the prepared tiny run, and its config file for the driver."""
    shutil.copytree(prepared_run.run.dir, tmp_path / "run")
    cfg = replace(prepared_run, run=replace(prepared_run.run, dir=str(tmp_path / "run")))
    save_config(cfg, tmp_path / "cfg.yaml")
    return cfg, tmp_path / "cfg.yaml"


def _driver(sites: Sites, cluster: RayCluster, cfg_file: Path, *overrides: str) -> list[str]:
    """`dipaco train` on Ray, on site 0 (the head's machine)."""
    return sites[0].command([sys.executable, "-m", "dipaco", "train", "--config", str(cfg_file), "train.driver=ray",
                             "outer.sync=async_nesterov", "ray.executors=2", "ray.worker_cpus=1", *overrides,
                             f"ray.address={cluster.address}"])


def _tasks(exp: Path) -> list[dict]:
    return read_metrics(exp / "metrics.jsonl", "task") if (exp / "metrics.jsonl").exists() else []


def _until(what: str, check: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:g}s\n{log.read_text(errors='replace')[-4000:]}")


def test_a_node_that_joins_takes_tasks_and_its_loss_loses_no_update(prepared_run, tmp_path):
    cfg, cfg_file = _copied_run(prepared_run, tmp_path)
    exp, log = tmp_path / "run" / "train" / "ray_sites", tmp_path / "driver.log"
    with Sites(2, PROFILES["wan"]) as sites, RayCluster(sites, ENV) as cluster:
        head, joiner = sites[0].address, sites[1].address
        cluster.start(0)
        with log.open("w") as out:
            driver = subprocess.Popen(_driver(sites, cluster, cfg_file, *TRAIN), stdout=out, stderr=subprocess.STDOUT,
                                      cwd=REPO, env=cluster.environment(0))
        _until("a first task", lambda: bool(_tasks(exp)), driver, log)
        cluster.start(1)
        _until("a task on the joiner", lambda: any(t["node"] == joiner for t in _tasks(exp)), driver, log)
        sites.kill(1)  # the machine is gone: its raylet, its object store, the worker and the states it made
        lost_at = len(_tasks(exp))
        _until("6 more tasks", lambda: len(_tasks(exp)) >= lost_at + 6, driver, log)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=180)
    text = log.read_text(errors="replace")
    assert driver.returncode == 143, text[-4000:]  # stopped by SIGTERM after checkpointing

    tasks = _tasks(exp)
    nodes = {t["node"] for t in tasks}
    assert nodes == {head, joiner}, nodes
    assert f"node {joiner} joined" in text
    joined = [e["node"] for e in read_metrics(exp / "metrics.jsonl", "worker")]
    assert joined[:1] == [head] and joiner in joined
    # after the loss every task ran on site 0 (Ray restarts the lost worker once a node has room: none has)
    assert {t["node"] for t in tasks[lost_at + 4:]} == {head}, [t["node"] for t in tasks]
    assert "re-queued" in text or read_metrics(exp / "metrics.jsonl", "state_lost"), text[-4000:]
    check_exactly_once(exp, modules_by_path(cfg))
    assert "actor restart will fail" not in text  # ray-project/ray#53727: no constructor argument in the store


def test_the_module_executors_run_beside_the_driver(prepared_run, tmp_path):
    """Both nodes up before the run, the head's one CPU taken by the path worker: Ray placed the 0-CPU executors on
    the other node (the least used), where they made every other node's tasks cross its link. They are pinned to the
    driver's node (found by python -m bench ray_sites: a path's parameters more per task than the count)."""
    _, cfg_file = _copied_run(prepared_run, tmp_path)
    exp, log = tmp_path / "run" / "train" / "beside", tmp_path / "driver.log"
    with Sites(2, PROFILES["wan"]) as sites, RayCluster(sites, ENV) as cluster:
        head = sites[0].address
        for i in range(len(sites)):
            cluster.start(i)
        cmd = _driver(sites, cluster, cfg_file, "train.name=beside", "train.rounds=1", "ray.num_workers=1")
        with log.open("w") as out:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=cluster.environment(0),
                                  timeout=300)
    assert done.returncode == 0, log.read_text(errors="replace")[-4000:]
    placed = {e["executor"]: e["node"] for e in read_metrics(exp / "metrics.jsonl", "executor")}
    assert placed == {0: head, 1: head}, placed
