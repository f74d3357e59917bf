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

from dipaco.comm.liveness import Heartbeat, RoundTimeout
from dipaco.config import DistConfig
from dipaco.errors import CheckpointError, ConfigError, DataError, DistributedError, check_range
from dipaco.runtime import resolve_device

# Config keys that may differ between ranks without changing what any rank computes.
RANK_LOCAL_KEYS = ("run.progress",)


def check_dist(dist: DistConfig) -> None:
    """The ``dist`` section: a timeout, and codec settings the transport can use."""
    if not (math.isfinite(dist.timeout_s) and dist.timeout_s > 0):
        raise ConfigError(f"dist.timeout_s: must be a finite number > 0, got {dist.timeout_s}")
    if not (math.isfinite(dist.round_timeout_factor) and dist.round_timeout_factor >= 0):
        raise ConfigError(f"dist.round_timeout_factor: must be a finite number >= 0 (0: always dist.timeout_s), "
                          f"got {dist.round_timeout_factor}")
    if not (math.isfinite(dist.round_timeout_min_s) and dist.round_timeout_min_s > 0):
        raise ConfigError(f"dist.round_timeout_min_s: must be a finite number > 0, got {dist.round_timeout_min_s}")
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
    # TORCHELASTIC_RUN_ID (torchrun's --rdzv-id): the job, the same in every attempt; "" without one, or "none"
    # (torchrun's default, which names no job)
    run_id: str = ""

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
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, restart_count=restarts,
                   run_id="" if run_id == "none" else run_id)


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
    heartbeat: Heartbeat | None = None  # names the lost peer when a collective fails (dipaco.comm.liveness)
    hosts: list[str] = field(default_factory=list)  # rank -> its host, from the config check
    groups: list[Any] = field(default_factory=list)  # the transport's process groups, whose timeout follows rounds
    round_timeout: RoundTimeout | None = None  # dist.round_timeout_*: the timeout once a round is timed
    restarts: int = 0  # the most restarts of any rank's agent (the config check): > 0 continues the run
    _writers: World | None = field(default=None, repr=False)  # writers(): its timeout follows set_timeout's

    @property
    def restarted(self) -> bool:
        """Whether this worker group is a restart: of this rank's agent, or of any peer's. A node that joins
        late is at its own agent's first attempt, while the others restarted to take it in."""
        return max(self.restarts, self.env.restart_count) > 0

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
            lost = self._who_is_lost()
            raise DistributedError(
                f"rank {self.rank}: {lost}{what} failed: {detail} (collectives wait at most "
                f"{self.timeout_s:g}s: dist.timeout_s, then dist.round_timeout_* once a round is timed)"
            ) from exc

    def _who_is_lost(self) -> str:
        """The lead of a failed collective's error: the peers whose heartbeat stopped, or that this rank
        cannot reach the job's store (it is the one cut off, or the store's host is lost)."""
        if self.heartbeat is None:
            return ""
        lost = self.heartbeat.lost_ranks()
        if lost is None:
            addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            return (f"lost contact: the job's store at {addr} does not answer either, so this host's link is down "
                    f"or the store's host is lost; ")
        if not lost:
            return ""
        named = ", ".join(f"rank {r}" + (f" ({self.hosts[r]})" if r < len(self.hosts) else "") for r in lost)
        return f"lost {named}: no heartbeat for {self.heartbeat.window_s:g}s; "

    def timed_round(self, slowest_round_s: float) -> None:
        """Rounds as slow as ``slowest_round_s`` have run: collectives now wait what ``round_timeout`` allows."""
        if self.round_timeout is not None:
            self.set_timeout(self.round_timeout.after(slowest_round_s))

    def untimed(self) -> None:
        """Work no round timed comes next (re-routing): collectives wait up to ``dist.timeout_s`` again."""
        if self.round_timeout is not None:
            self.set_timeout(self.round_timeout.ceiling_s)

    def set_timeout(self, seconds: float) -> None:
        """How long the collectives still to be issued wait, on every process group of this rank."""
        if self.size == 1 or seconds == self.timeout_s:
            return
        self.timeout_s = seconds
        if self._writers is not None:
            self._writers.timeout_s = seconds
        delta = timedelta(seconds=seconds)
        for group in {id(g): g for g in [None, *self.groups, self.writer_group]}.values():
            dist.distributed_c10d._set_pg_timeout(delta, group)

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
        if self._writers is None:
            self._writers = World(env=self.env, backend="gloo", timeout_s=self.timeout_s, device=torch.device("cpu"),
                                  token=self.token, group=self.writer_group, heartbeat=self.heartbeat, hosts=self.hosts)
        return self._writers

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
        if self.heartbeat is not None:
            self.heartbeat.stop()
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
    store = dist.TCPStore(addr, port, env.world_size, is_master=not _agent_hosts_store() and env.rank == 0,
                          timeout=timeout)
    return dist.PrefixStore(attempt_prefix(env), store)


def attempt_prefix(env: DistEnv) -> str:
    """The store keys of this attempt. A store torchrun's agent hosts outlives the attempts, so they are keyed by
    the restart count. A store rank 0 hosts (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or no agent) is new with
    every attempt, and the restart count would split it: a node that joins late is at its own agent's attempt 0
    while the others are at theirs."""
    return f"dipaco/attempt_{env.restart_count}" if _agent_hosts_store() else "dipaco/attempt"


def _agent_hosts_store() -> bool:
    """Whether torchrun's agent hosts the job's store (else rank 0 does)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_world(cfg: DistConfig, env: DistEnv, device: torch.device) -> World:
    """Joins the torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment); no-op for one rank."""
    if not env.distributed:
        return World(env=env, timeout_s=cfg.timeout_s, device=device)
    backend = resolve_backend(cfg.backend, device)
    if backend == "nccl":
        torch.cuda.set_device(device)
    world = World(env=env, backend=backend, timeout_s=cfg.timeout_s, device=device,
                  round_timeout=RoundTimeout(cfg.timeout_s, cfg.round_timeout_factor, cfg.round_timeout_min_s))
    timeout = timedelta(seconds=cfg.timeout_s)
    with world.collective("joining the process group"):
        dist.init_process_group(
            backend, store=_attempt_store(env, timeout), timeout=timeout, rank=env.rank, world_size=env.world_size
        )
        world.writer_group = dist.new_group(backend="gloo", timeout=timeout)
    world.heartbeat = Heartbeat.to_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                         attempt_prefix(env), env.rank, env.world_size).start()
    return world


def check_same_config(world: World, config: Mapping[str, Any], args: Mapping[str, Any]) -> None:
    """All ranks must run the same config and command line; the error names the differing keys.
    ``config``: the resolved config, flattened (``{"train.rounds": 4, ...}``).

    Also agrees on ``world.token`` (rank 0's pid), used to name the shared temporary checkpoint dir.
    """
    flat = {k: v for k, v in config.items() if not k.startswith(RANK_LOCAL_KEYS)}
    mine = {"config": flat, "args": dict(args), "pid": os.getpid(), "host": socket.gethostname(),
            "restarts": world.env.restart_count}
    everyone = world.all_gather_object(mine, "config check")
    world.token = str(everyone[0]["pid"])
    world.restarts = max(e["restarts"] for e in everyone)
    world.hosts = [f"{e['host']}, pid {e['pid']}" for e in everyone]
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
