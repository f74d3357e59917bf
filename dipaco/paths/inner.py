"""The inner loop: AdamW steps of one model on one shard (a path in DiPaCo, the dense model in pretraining).

The loop owns everything that is private to a path and persists across rounds: the AdamW state,
the LR schedule position, the data cursor and fp16's loss scale. DiPaCo never averages or
communicates any of it.

How fast it runs is set by :class:`InnerOptions`: autocast precision, torch.compile, activation
checkpointing, and keeping the AdamW state in CPU memory while other paths train. None of them
changes which parameters are trained or their names, so the bank's name-based mapping holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dipaco.config import OptimConfig
from dipaco.errors import ConfigError, check_range
from dipaco.model.llama import enable_activation_checkpointing
from dipaco.paths.lr_schedule import build_scheduler
from dipaco.paths.sampler import ShardSampler
from dipaco.precision import Precision, resolve_precision
from dipaco.runtime import interrupted


def check_optim(key: str, optim: OptimConfig) -> None:
    """An inner AdamW section (``key``: ``train.optim`` or ``pretrain.optim``, named in errors)."""
    for name, low, high, closed in (("lr", 0.0, math.inf, False), ("beta1", 0.0, 1.0, False),
                                    ("beta2", 0.0, 1.0, False), ("weight_decay", 0.0, math.inf, False),
                                    ("min_lr_ratio", 0.0, 1.0, True), ("grad_clip", 0.0, math.inf, False)):
        check_range(f"{key}.{name}", getattr(optim, name), low, high, high_closed=closed)
    if not (math.isfinite(optim.eps) and optim.eps > 0):
        raise ConfigError(f"{key}.eps: must be a finite number > 0, got {optim.eps}")
    if optim.warmup_steps < 0:
        raise ConfigError(f"{key}.warmup_steps: must be >= 0, got {optim.warmup_steps}")
    if optim.batch_size <= 0:
        raise ConfigError(f"{key}.batch_size: must be > 0, got {optim.batch_size}")
    micro = optim.micro_batch_size
    if micro is not None and (micro <= 0 or optim.batch_size % micro):
        raise ConfigError(f"{key}.micro_batch_size: must be > 0 and divide {key}.batch_size={optim.batch_size}, got {micro}")


@dataclass
class InnerStats:
    steps: int
    loss: float  # mean training loss over the steps
    tokens: int
    seconds: float
    lr: float  # learning rate after the last step
    swap_seconds: float = 0.0  # moving the AdamW state to and from CPU memory (train.offload_inactive)
    # The mean loss of each window of train.log_every steps (the last one may be shorter; windows restart at a
    # round's sync points) and the loop's step count at each window's end.
    loss_curve: tuple[float, ...] = ()
    loss_curve_steps: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @staticmethod
    def combine(parts: list[InnerStats]) -> InnerStats:
        """The stats of consecutive runs (segments of a round) as one."""
        if len(parts) == 1:
            return parts[0]
        steps = sum(s.steps for s in parts)
        return InnerStats(steps=steps, loss=sum(s.loss * s.steps for s in parts) / max(steps, 1),
                          tokens=sum(s.tokens for s in parts), seconds=sum(s.seconds for s in parts),
                          lr=parts[-1].lr, swap_seconds=sum(s.swap_seconds for s in parts),
                          loss_curve=tuple(v for s in parts for v in s.loss_curve),
                          loss_curve_steps=tuple(v for s in parts for v in s.loss_curve_steps))


@dataclass(frozen=True)
class InnerOptions:
    """How an inner loop runs on its device (``train.*`` / ``pretrain.*`` and ``model.*`` keys, resolved for the
    device by :meth:`dipaco.paths.factory.LoopSettings.options`)."""

    precision: Precision
    compile: bool = False
    activation_checkpointing: bool = False
    offload_inactive: bool = False


class Stopped:
    """The interrupt of a loop stopped by a signal between two steps: the signal's KeyboardInterrupt class
    (:class:`dipaco.runtime.Terminated` for SIGTERM), carrying the stats of the steps it did (``.stats``)."""

    @staticmethod
    def of(kind: type[KeyboardInterrupt], stats: InnerStats) -> KeyboardInterrupt:
        exc = kind()
        exc.stats = stats  # type: ignore[attr-defined]
        return exc


def build_adamw(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; norms (1-D weights) are not decayed.

    The fused kernel on CUDA (one launch for every parameter), the multi-tensor ``foreach`` one
    elsewhere: both are torch's own, and much faster than the per-parameter loop.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = next(model.parameters()).device.type == "cuda"
    kernel = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


class StateOffload:
    """Keeps an optimizer's state in host memory while its path is not training.

    The host copies are allocated once (pinned when the state lives on CUDA, so the copies are
    DMA transfers) and reused every round; only the device copies are freed and re-made. Each
    tensor goes back to the device it came from (AdamW keeps some ``step`` counters on the CPU).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.on_host = False
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._devices: dict[tuple[int, str], torch.device] = {}

    def to_host(self) -> None:
        if self.on_host:
            return
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                slot = (id(param), key)
                buf = self._buffers.get(slot)
                if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                    buf = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda")
                    self._buffers[slot] = buf
                buf.copy_(value)
                self._devices[slot] = value.device
                state[key] = buf
        self.on_host = True

    def to_home(self) -> None:
        if not self.on_host:
            return
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                slot = (id(param), key)
                if torch.is_tensor(value) and slot in self._devices:
                    # copy=True: the host buffer is never trained on, even when home is the CPU.
                    state[key] = value.to(self._devices[slot], non_blocking=True, copy=True)
        self.on_host = False


class PinnedCopy:
    """Batches to the device without a stream sync each step. A copy from pageable host memory syncs the
    stream before it starts (the CUDA runtime's "API synchronization behavior"), so the host could not
    queue step t+1 while the device runs step t; from pinned memory the copy is asynchronous. Two pinned
    buffers take turns, and a buffer is written again only once the copy out of it (two steps earlier)
    has completed. On other devices the batch is moved as is."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # (pinned buffer, the event after the copy out of it)
        self.turn = 0

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return batch.to(self.device)
        if self.turn == len(self.slots):
            self.slots.append((torch.empty(0, dtype=batch.dtype, pin_memory=True), torch.cuda.Event()))
        buffer, copied = self.slots[self.turn]
        copied.synchronize()  # returns at once for an event never recorded
        if buffer.shape != batch.shape or buffer.dtype != batch.dtype:
            buffer = torch.empty(batch.shape, dtype=batch.dtype, pin_memory=True)
            self.slots[self.turn] = (buffer, copied)
        buffer.copy_(batch)
        on_device = buffer.to(self.device, non_blocking=True)
        copied.record()
        self.turn = (self.turn + 1) % 2
        return on_device


class InnerLoop:
    def __init__(
        self,
        model: PreTrainedModel,
        sampler: ShardSampler,
        cfg: OptimConfig,
        total_steps: int,
        device: torch.device | str = "cpu",
        options: InnerOptions | None = None,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.cfg = cfg
        self.device = torch.device(device)
        self.options = options or InnerOptions(resolve_precision("auto", self.device))
        if self.options.activation_checkpointing:
            enable_activation_checkpointing(model)
        # The compiled callable lives beside the model, never in its place: the bank maps parameters
        # by their names, which the compiled wrapper would prefix with ``_orig_mod.``. Dynamo's code
        # cache is shared by every model of the same architecture, so a rank's paths compile once.
        self.forward = torch.compile(model) if self.options.compile else model
        self.optimizer = build_adamw(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
        self.scaler = self.options.precision.grad_scaler()
        self.offload = StateOffload(self.optimizer) if self.options.offload_inactive else None
        self.step = 0
        self.to_device = PinnedCopy(self.device)

    def train_step(self) -> torch.Tensor:
        """One AdamW step on the sampler's next batch, accumulated over micro-batches of ``micro_batch_size`` rows.

        Every row is a packed sequence whose every position is a target, so the batch's mean loss is the mean
        of equal-sized micro-batches' means: each is weighted by its share of the rows."""
        batch = self.to_device(self.sampler.next_batch())
        passes = batch.split(self.cfg.micro_batch_size or len(batch))
        loss: torch.Tensor | None = None
        for rows in passes:
            with self.options.precision.autocast():
                part = self.forward(input_ids=rows, labels=rows).loss
            if len(passes) > 1:  # one pass (no accumulation) leaves the loss and its graph as they were
                part = part * (len(rows) / len(batch))
            (part if self.scaler is None else self.scaler.scale(part)).backward()
            loss = part.detach() if loss is None else loss + part.detach()
        assert loss is not None
        if self.scaler is None:
            self._clip()
            self.optimizer.step()
        else:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            self._clip()
            self.scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
            self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss

    def _clip(self) -> None:
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)

    def _swap(self, to_home: bool) -> float:
        """Moves the AdamW state home or to host memory; returns the seconds it took."""
        if self.offload is None:
            return 0.0
        start = time.perf_counter()
        self.offload.to_home() if to_home else self.offload.to_host()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def run(self, steps: int, progress=None, log_every: int = 10) -> InnerStats:
        """Runs ``steps`` AdamW steps; ``progress`` is an optional tqdm bar advanced per step.

        With ``offload_inactive`` the AdamW state comes back from host memory first and returns
        there after, so only the path that is training holds its state on the device."""
        self.model.train()
        swap = self._swap(to_home=True)
        start = time.perf_counter()
        total = torch.zeros((), device=self.device)
        recent = torch.zeros((), device=self.device)
        windows: list[torch.Tensor] = []
        window_ends: list[int] = []
        stopped: type[KeyboardInterrupt] | None = None
        for i in range(steps):
            stopped = interrupted()
            if stopped is not None:  # a signal: stop before this step, with the stats of the steps done
                steps = i
                break
            loss = self.train_step()
            total += loss
            recent += loss
            if progress is not None:
                progress.update(1)
            if (i + 1) % log_every == 0 or i + 1 == steps:
                windows.append(recent / ((i % log_every) + 1))  # a new tensor: no device sync here
                window_ends.append(self.step)
                if progress is not None:  # .item() syncs the device, so only at log points and with a bar
                    progress.set_postfix(loss=f"{windows[-1].item():.3f}", refresh=False)
                recent = torch.zeros((), device=self.device)
        mean_loss = total.item() / max(steps, 1)  # syncs the device, so the time below is the steps' own
        curve = tuple(torch.stack(windows).tolist()) if windows else ()
        seconds = time.perf_counter() - start
        swap += self._swap(to_home=False)
        stats = InnerStats(
            steps=steps,
            loss=mean_loss,
            tokens=steps * self.sampler.tokens_per_batch,
            seconds=seconds,
            lr=float(self.scheduler.get_last_lr()[0]),
            swap_seconds=swap,
            loss_curve=curve,
            loss_curve_steps=tuple(window_ends),
        )
        if stopped is not None:
            raise Stopped.of(stopped, stats)
        return stats

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        if self.scaler is not None:
            if "grad_scaler" not in state:
                raise ValueError("the checkpoint has no fp16 loss-scaler state: it was not trained with precision=fp16")
            self.scaler.load_state_dict(state["grad_scaler"])
