"""The ranks of a job: the torchrun environment, the process group and the world-wide collectives.

DiPaCo (Douillard et al., arXiv 2403.10616, section 2.3 and 5) trains every path on its own worker.
Here a *rank* of a ``torchrun`` job trains a fixed set of paths (:mod:`dipaco.comm.placement`), and the
sync algorithm (:mod:`dipaco.sync`) exchanges module updates among the ranks that hold them
through :mod:`dipaco.comm.reduce`.

A single process is the world_size=1 case: :func:`init_world` then creates no process group and
every :class:`World` collective is a local no-op, so ``dipaco train`` runs the same code either way.

Everything that could make ranks disagree is checked before the first collective that could hang:
more ranks than paths (:func:`dipaco.comm.placement.check_world_size`, no communication needed), then a
different config or command line on some rank (:func:`check_same_config`, one all-gather); errors
that happen on one rank while setting up are shared with :meth:`World.agree`, so every rank exits
with the same clear message instead of waiting for a peer that has already given up.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dipaco.config import DistConfig
from dipaco.errors import CheckpointError, ConfigError, DataError, DistributedError, check_range
from dipaco.runtime import resolve_device

# Config keys that may differ between ranks without changing what any rank computes.
RANK_LOCAL_KEYS = ("run.progress",)


def check_dist(dist: DistConfig) -> None:
    """The ``dist`` section: a timeout, and codec settings the transport can use."""
    if not (math.isfinite(dist.timeout_s) and dist.timeout_s > 0):
        raise ConfigError(f"dist.timeout_s: must be a finite number > 0, got {dist.timeout_s}")
    if dist.chunk_size <= 0:
        raise ConfigError(f"dist.chunk_size: must be > 0, got {dist.chunk_size}")
    if dist.comm_dtype in ("int4", "fp4") and dist.chunk_size % 2:
        raise ConfigError(f"dist.chunk_size: must be even for dist.comm_dtype={dist.comm_dtype} "
                          f"(two values per byte), got {dist.chunk_size}")
    if dist.adaptive:
        if dist.comm_dtype == "fp32":
            raise ConfigError("dist.adaptive: needs a lossy dist.comm_dtype (bf16, fp16, int8, int4, fp4) for "
                              "the first sync of each module, before it has statistics; got fp32")
        if dist.chunk_size % 2:
            raise ConfigError(f"dist.chunk_size: must be even with dist.adaptive=true (its 4-bit candidates), "
                              f"got {dist.chunk_size}")
    check_range("dist.adaptive_tolerance", dist.adaptive_tolerance, 0.0, math.inf)
    if dist.adaptive_sample_chunks < 0:
        raise ConfigError(f"dist.adaptive_sample_chunks: must be >= 0 (0 = every chunk), got {dist.adaptive_sample_chunks}")


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker (https://pytorch.org/docs/stable/elastic/run.html)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: restarts of the worker group so far

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """RANK / WORLD_SIZE / LOCAL_RANK / TORCHELASTIC_RESTART_COUNT; a plain process is rank 0 of 1."""
    env = os.environ if environ is None else environ
    try:
        world_size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local_rank = int(env.get("LOCAL_RANK", "0"))
        restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError as exc:
        raise ConfigError(f"torchrun environment: {exc}") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"torchrun environment: RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, restart_count=restarts)


def rank_device(name: str, env: DistEnv) -> torch.device:
    """``run.device`` for this rank: ``auto``/``cuda`` mean this rank's GPU (LOCAL_RANK) under torchrun."""
    device = resolve_device(name)
    if env.distributed and device.type == "cuda" and device.index is None:
        if env.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"run.device: LOCAL_RANK={env.local_rank} needs its own GPU but {torch.cuda.device_count()} are "
                f"visible; use --nproc-per-node <= the GPUs per node, or run.device=cpu"
            )
        device = torch.device("cuda", env.local_rank)
    return device


def resolve_backend(backend: str, device: torch.device) -> str:
    """``dist.backend``: auto -> nccl for CUDA tensors, gloo otherwise."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"dist.backend: nccl needs CUDA, but run.device resolves to {device}; use gloo")
    return backend


_ERRORS = {cls.__name__: cls for cls in (ConfigError, DataError, CheckpointError, DistributedError)}


@dataclass
class World:
    """The ranks of one job and the few world-wide collectives the trainer needs.

    With ``size == 1`` every method is a local no-op. Failures of a collective (a peer died, or did
    not answer within ``dist.timeout_s``) become :class:`DistributedError` naming the operation.
    """

    env: DistEnv = field(default_factory=DistEnv)
    backend: str = "none"
    timeout_s: float = 1800.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    token: str = field(default_factory=lambda: str(os.getpid()))  # rank 0's pid: names shared temp dirs
    group: Any = None  # the process group of the collectives (None: the default group)
    writer_group: Any = None  # a gloo group of its own for the background checkpoint writers (several ranks)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def size(self) -> int:
        return self.env.world_size

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: gloo works on CPU tensors, nccl on this rank's GPU."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # torch.distributed.DistError and gloo/nccl errors are RuntimeErrors
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(
                f"rank {self.rank}: {what} failed: {detail} (a peer rank that died or stopped answering "
                f"makes this fail; collectives time out after dist.timeout_s={self.timeout_s:g}s)"
            ) from exc

    def barrier(self, what: str) -> None:
        if self.size == 1:
            return
        with self.collective(f"barrier ({what})"):
            device = torch.device("cpu") if self.group is not None else self.comm_device
            dist.all_reduce(torch.zeros(1, device=device), group=self.group)

    def all_gather_object(self, obj: Any, what: str) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        with self.collective(f"all-gather ({what})"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def writers(self) -> World:
        """The same ranks over the writer group: what a background checkpoint writer coordinates with, while
        the training collectives go on in the default group from another thread."""
        if self.size == 1:
            return self
        return World(env=self.env, backend="gloo", timeout_s=self.timeout_s, device=torch.device("cpu"),
                     token=self.token, group=self.writer_group)

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raises on every rank when ``what`` failed on any rank: the rank's own error, or the first one."""
        if self.size == 1:
            if error is not None:
                raise error
            return
        gathered = self.all_gather_object(None if error is None else (type(error).__name__, str(error)), what)
        if error is not None:
            raise error
        for r, item in enumerate(gathered):
            if item is not None:
                name, message = item
                raise _ERRORS.get(name, DistributedError)(f"rank {r} failed {what}: {message}")

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The job's key-value store (MASTER_ADDR:MASTER_PORT), with keys private to this restart attempt.

    Under torchrun the agent hosts the store and keeps it across restarts of the worker group;
    with the default (static) rendezvous, keys written by the previous attempt (e.g. gloo's peer
    addresses) would be read by the new one and point at dead processes (pytorch/pytorch#135712).
    Prefixing every key with TORCHELASTIC_RESTART_COUNT isolates the attempts.
    """
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ConfigError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT; launch with torchrun") from None
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(addr, port, env.world_size, is_master=not agent_hosts_store and env.rank == 0,
                          timeout=timeout)
    return dist.PrefixStore(f"dipaco/attempt_{env.restart_count}", store)


def init_world(cfg: DistConfig, env: DistEnv, device: torch.device) -> World:
    """Joins the torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment); no-op for one rank."""
    if not env.distributed:
        return World(env=env, timeout_s=cfg.timeout_s, device=device)
    backend = resolve_backend(cfg.backend, device)
    if backend == "nccl":
        torch.cuda.set_device(device)
    world = World(env=env, backend=backend, timeout_s=cfg.timeout_s, device=device)
    timeout = timedelta(seconds=cfg.timeout_s)
    with world.collective("joining the process group"):
        dist.init_process_group(
            backend, store=_attempt_store(env, timeout), timeout=timeout, rank=env.rank, world_size=env.world_size
        )
        world.writer_group = dist.new_group(backend="gloo", timeout=timeout)
    return world


def check_same_config(world: World, config: Mapping[str, Any], args: Mapping[str, Any]) -> None:
    """All ranks must run the same config and command line; the error names the differing keys.
    ``config``: the resolved config, flattened (``{"train.rounds": 4, ...}``).

    Also agrees on ``world.token`` (rank 0's pid), used to name the shared temporary checkpoint dir.
    """
    flat = {k: v for k, v in config.items() if not k.startswith(RANK_LOCAL_KEYS)}
    mine = {"config": flat, "args": dict(args), "pid": os.getpid(), "host": socket.gethostname()}
    everyone = world.all_gather_object(mine, "config check")
    world.token = str(everyone[0]["pid"])
    ref = {**everyone[0]["config"], **{f"--{k}": v for k, v in everyone[0]["args"].items()}}
    for r, other in enumerate(everyone[1:], start=1):
        theirs = {**other["config"], **{f"--{k}": v for k, v in other["args"].items()}}
        diff = [f"{k}: {ref.get(k)!r} (rank 0) vs {theirs.get(k)!r} (rank {r})"
                for k in sorted(set(ref) | set(theirs)) if ref.get(k) != theirs.get(k)]
        if diff:
            raise ConfigError(
                f"dist: the config differs between ranks ({'; '.join(diff[:5])}"
                f"{'; ...' if len(diff) > 5 else ''}); every rank must run the same config and arguments"
            )
