"""The Ray actors of the task scheduler (:mod:`dipaco.train.tasks`), as plain classes the scheduler
wraps with ``ray.remote``: a path worker runs path tasks, a module executor applies their changes."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LlamaConfig

from dipaco.checkpoint.store import CONFIG, CheckpointManager, SavedCheckpoint, Snapshot, resolve_checkpoint, write_snapshot
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model
from dipaco.model.topology import Topology
from dipaco.paths.factory import PathLoops
from dipaco.runtime import request_stop, seed_everything
from dipaco.sync.async_nesterov import ANCHOR, BUFFER, MOMENTUM, PARAMS, AsyncNesterov

SYNC_PARTS = (MOMENTUM, BUFFER, ANCHOR)  # the executors' state a run checkpoint keeps besides the bank
TASK_BASE = "task_base"  # "<path>/<module>": the modules a task a signal stopped started from (safetensors)
EXECUTORS_DIR = "executors"  # <experiment>/executors/run_<ms>/executor_NNN: each executor's own checkpoints


class PathWorker:
    """Runs path tasks: compose the path from its modules, run its inner steps, hand back its change.
    One model serves every path: the bank covers all its parameters, so composing overwrites them all."""

    def __init__(self, speed: float, path_loops: PathLoops | Callable[[], PathLoops], llama_config: LlamaConfig,
                 topology: Topology) -> None:
        """``path_loops``: the factory, or what builds it from files every node sees (the scheduler's choice:
        then Ray restarts the worker on any node without an object of the lost one)."""
        torch.set_num_threads(1)  # several workers share the machine's cores
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Ray sets the visible GPU
        if not isinstance(path_loops, PathLoops):
            path_loops = path_loops()
        seed_everything(path_loops.seed, self.device)
        self.speed, self.path_loops, self.topology = speed, path_loops, topology
        self.model = build_model(llama_config, seed=0, device=self.device)
        self.bank = ModuleBank(topology, self.model)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        return node_address()

    def stop(self) -> None:
        """The driver got a signal: the task running stops after its step in progress (a threaded actor)."""
        request_stop()

    def run(self, path: int, steps: int, inner_state: dict | None, *modules: torch.Tensor,
            params: dict[str, torch.Tensor] | None = None) -> tuple:
        """Returns (stats, AdamW/schedule/data state, the path's parameters when :meth:`stop` stopped it
        (the stats say after how many of the ``steps``; else None), one delta theta_m - theta_{p,m} per
        part). ``params``: the path's parameters mid-task, to continue a stopped task from its ``modules``."""
        model, module_ids = self.model, self.topology.path_modules(path)
        with torch.no_grad():
            for m, value in zip(module_ids, modules):
                self.bank.params[m].copy_(value)
            self.bank.load_path(path, model)
            if params is not None:
                model.load_state_dict(params, strict=False)  # parameters only: the buffers are the model's own
        loop = self.path_loops.build(path, model, self.device)
        if inner_state is not None:
            loop.load_state_dict(inner_state)
        start = time.perf_counter()
        try:
            stats = loop.run(steps, log_every=max(steps, 1))
        except KeyboardInterrupt as interrupt:  # stop(): after the step in progress, with the stats so far
            if not hasattr(interrupt, "stats"):
                raise
            stats = interrupt.stats
        if self.speed < 1.0:  # a slower machine: the same work takes 1/speed as long
            time.sleep(stats.seconds * (1.0 / self.speed - 1.0))
        seconds = time.perf_counter() - start
        deltas = [(self.bank.params[m] - self.bank.path_vector(model, part)).cpu()
                  for part, m in zip(self.topology.parts, module_ids)]
        meta = {"loss": stats.loss, "tokens": stats.tokens, "seconds": seconds, "compute_seconds": stats.seconds,
                "tokens_per_s": stats.tokens / seconds if seconds > 0 else 0.0, "lr": stats.lr, "step": loop.step,
                "steps": stats.steps, "node": self.node()}
        mid_task = None if stats.steps == steps else {n: v.detach().cpu().clone() for n, v in model.named_parameters()}
        return (meta, _to_cpu(loop.state_dict()), mid_task, *deltas)


def node_address() -> str:
    """The address of this actor's node (Ray's, else the host name)."""
    try:
        from ray.util import get_node_ip_address
    except ImportError:
        return socket.gethostname()
    return get_node_ip_address()


def _to_cpu(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state.cpu() if torch.is_tensor(state) else state


@dataclass(frozen=True)
class ExecutorSpec:
    """One executor: its modules and their outer step, by global module id; where it checkpoints itself, how often."""

    names: dict[int, str]
    path_weights: dict[int, dict[int, float]]  # module -> the weight of each path through it
    lr: float | dict[int, float]  # the outer lr (per module: embedding and head may be scaled)
    momentum: float
    delay: dict[int, int]  # arrivals per momentum step (delayed Nesterov's N)
    root: str
    every: int  # ray.executor_checkpoint_every: applied updates between checkpoints
    config_yaml: str  # the run's resolved config, written into each checkpoint
    rescale: str = "none"  # outer.rescale


class ModuleExecutor:
    """The outer executor of a group of modules: their :class:`AsyncNesterov` and update log. It checkpoints
    itself (the store's format) every ``spec.every`` updates, and it is constructed from its newest
    checkpoint, the first one :meth:`write_start` wrote: Ray constructs it again after a crash, on any
    node, from the spec alone (no argument in the object store, which a lost node could take with it)."""

    def __init__(self, spec: ExecutorSpec) -> None:
        torch.set_num_threads(1)
        self.names, self.every, self.config_yaml = dict(spec.names), spec.every, spec.config_yaml
        self.checkpoints = CheckpointManager(spec.root, keep=2)
        if self.checkpoints.latest() is None:
            raise FileNotFoundError(f"{spec.root}: no executor checkpoint (ModuleExecutor.write_start writes the first)")
        ckpt = SavedCheckpoint(resolve_checkpoint(self.checkpoints))
        parts = {part: ckpt.replicated(part, set(self.names.values())) for part in (PARAMS, *SYNC_PARTS)}
        self.sync = AsyncNesterov({m: parts[PARAMS][n] for m, n in self.names.items()}, spec.path_weights, spec.lr,
                                  spec.momentum, spec.delay, spec.rescale)
        self.sync.load(parts, ckpt.state()["counters"], self.names)
        self.restored_from = ckpt.root.name

    @staticmethod
    def write_start(spec: ExecutorSpec, init: dict[int, torch.Tensor], saved: tuple[dict, dict] | None = None) -> None:
        """The executor's first checkpoint, in ``spec.root``: each module's parameters (``init``), or the tensors by
        part and counters of a restored run checkpoint (``saved``, which win)."""
        sync = AsyncNesterov(init, spec.path_weights, spec.lr, spec.momentum, spec.delay, spec.rescale)
        if saved is not None:
            sync.load(saved[0], saved[1], spec.names)
        _save_executor(CheckpointManager(spec.root, keep=2), sync, spec.names, spec.config_yaml)

    def node(self) -> str:
        return node_address()

    def pull(self, module: int) -> torch.Tensor:
        return self.sync.params[module].clone()

    def push(self, task: str, path: int, module: int, start_version: int, delta: torch.Tensor) -> dict | None:
        """Applies one task's delta to ``module`` (None: that task was already applied to it)."""
        # After a restart, updates applied after the last checkpoint died with the previous actor and are
        # being sent again; a task that pulled them may arrive first, naming a version this actor has not
        # reached yet. Its delta is relative to what it pulled, so it applies as is, at staleness 0.
        start_version = min(start_version, self.sync.version(module))
        update = self.sync.apply(task, path, module, start_version, delta)
        if update is not None and len(self.sync.log) % self.every == 0:
            self._checkpoint()
        return None if update is None else update.__dict__

    def state(self) -> tuple[dict, dict]:
        return self.sync.tensors(self.names), self.sync.counters()

    def _checkpoint(self) -> None:
        _save_executor(self.checkpoints, self.sync, self.names, self.config_yaml)


def _save_executor(checkpoints: CheckpointManager, sync: AsyncNesterov, names: dict[int, str], config_yaml: str) -> None:
    n = len(sync.log)
    snapshot = Snapshot(parts=sync.tensors(names), texts={CONFIG: config_yaml},
                        state={"round": n, "counters": sync.counters(), "modules": names})
    checkpoints.save(n, lambda d: write_snapshot(d, 0, snapshot, n))


class ExecutorState:
    """The run checkpoint's sync component: the executors' momentum, pending changes and anchors by name,
    and the base modules of the tasks a signal stopped (:data:`TASK_BASE`, only while there are some)."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.parts: dict[str, dict[str, torch.Tensor]] = {part: {} for part in SYNC_PARTS}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.parts

    def load_state_dict(self, saved: Any) -> None:
        self.parts = {part: saved.replicated(part, self.names) for part in SYNC_PARTS}
        if base := saved.per_rank(TASK_BASE).get(0):
            self.parts[TASK_BASE] = base
