"""Process-wide setup shared by every job: seeding, determinism, math backends, device choice."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from dipaco.config import RunConfig
from dipaco.errors import ConfigError

SEED_LIMIT = 2**32  # numpy's generator takes seeds in [0, 2**32)


def seed_everything(seed: int, device: torch.device | str = "cpu", deterministic: bool | None = None) -> None:
    """Seeds every generator and sets up the math backends for ``device`` (:func:`configure_backends`)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    configure_backends(torch.device(device), deterministic)


def configure_backends(device: torch.device, deterministic: bool | None = None) -> bool:
    """Deterministic algorithms (``None``: on for CPU, off for CUDA), and TF32 matmuls on CUDA.

    On CPU determinism costs nothing measurable and every CPU run is bit-exact, so it is the
    default there. On CUDA the deterministic kernels (and cuBLAS's fixed workspace) are slower, so
    it is opt-in (``run.deterministic=true``). TF32 keeps fp32 master weights and only rounds the
    matmul inputs; it is deterministic too. Returns whether determinism is on.
    """
    if deterministic is None:
        deterministic = device.type != "cuda"
    if deterministic and device.type == "cuda":
        # cuBLAS is only reproducible with a fixed workspace; it must be set before its first call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: a few CUDA kernels have no deterministic variant; warn rather than fail the run.
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = not deterministic
    return deterministic


def check_run(run: RunConfig) -> None:
    """The ``run`` section: a seed every generator takes, and a device this machine has."""
    if not 0 <= run.seed < SEED_LIMIT:
        raise ConfigError(f"run.seed: must be in [0, 2**32), got {run.seed}")
    resolve_device(run.device)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device: {name!r} is not auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"run.device: {name!r} is not auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {name!r} requested but CUDA is not available")
    return device


def rng_state() -> dict:
    """torch's global RNG state. Training draws from no other global generator (numpy and
    Python's are only seeded), and data order comes from per-shard generators in the sampler."""
    state: dict = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def quiet_library_progress_bars() -> None:
    """Silences datasets' and transformers' own bars (for run.progress=false, logs and CI)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm, Kubernetes, cloud preemption): stops training as Ctrl-C does, so every handler of
    KeyboardInterrupt runs; the CLI exits 143 (128 + SIGTERM) instead of 130."""


_interrupted: type[KeyboardInterrupt] | None = None  # set by the handlers of sigint_stops_training
_finish_the_step = False  # inside finish_the_step(): the first signal waits for the step in progress


def _on_signal(signum, frame) -> None:
    global _interrupted
    first = _interrupted is None
    _interrupted = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    if first and _finish_the_step:
        return  # raised by raise_if_interrupted() before the next step: the step in progress completes
    raise _interrupted


@contextmanager
def finish_the_step() -> Iterator[None]:
    """Inside this block the first SIGINT or SIGTERM does not interrupt the step in progress: it is raised
    by :func:`raise_if_interrupted` (called before every inner step) once that step is done, so the job can
    write a checkpoint of a whole number of steps. A second signal raises at once, as outside the block."""
    global _finish_the_step
    before, _finish_the_step = _finish_the_step, True
    try:
        yield
    finally:
        _finish_the_step = before


@contextmanager
def sigint_stops_training() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt, as Python's own handler does, and is also remembered; SIGTERM
    raises :class:`Terminated`, a KeyboardInterrupt.

    Python runs a signal handler between bytecodes, wherever they are: a KeyboardInterrupt raised
    inside a finalizer or a callback called from C is printed as "Exception ignored" and lost, and
    training would go on. :func:`raise_if_interrupted`, called every inner step, raises it again.
    A SIGINT that the process inherited as ignored (a background job) stays ignored."""
    global _interrupted
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIGTERM is handled the same way where nobody else handles it (the default would end the process
    # silently, with no checkpoint line and no hint to resume).
    handled = [s for s in (signal.SIGINT, signal.SIGTERM)
               if signal.getsignal(s) is not signal.SIG_IGN
               and (s == signal.SIGINT or signal.getsignal(s) is signal.SIG_DFL)]
    previous = {s: signal.signal(s, _on_signal) for s in handled}
    _interrupted = None
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _interrupted = None


def interrupted() -> type[KeyboardInterrupt] | None:
    """The KeyboardInterrupt class of a signal that arrived under :func:`sigint_stops_training` (None: none)."""
    return _interrupted


def request_stop() -> None:
    """Stops this process's inner loop after its step in progress, as a first signal under
    :func:`finish_the_step` does: for a Ray path worker, which the driver stops by a call, not a signal."""
    global _interrupted
    _interrupted = KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raises KeyboardInterrupt (:class:`Terminated` for SIGTERM) when a signal arrived under
    :func:`sigint_stops_training`."""
    if _interrupted is not None:
        raise _interrupted
