"""The inner loop: AdamW steps of one model on one shard (a path in DiPaCo, the dense model in pretraining).

The loop owns everything that is private to a path and persists across rounds: the AdamW state,
the LR schedule position and the data cursor. DiPaCo never averages or communicates any of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dipaco.config import OptimConfig
from dipaco.train.lr_schedule import build_scheduler
from dipaco.train.sampler import ShardSampler


@dataclass
class InnerStats:
    steps: int
    loss: float  # mean training loss over the steps
    tokens: int
    seconds: float
    lr: float  # learning rate after the last step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @staticmethod
    def combine(parts: list["InnerStats"]) -> "InnerStats":
        """The stats of consecutive runs (segments of a round) as one."""
        if len(parts) == 1:
            return parts[0]
        steps = sum(s.steps for s in parts)
        return InnerStats(steps=steps, loss=sum(s.loss * s.steps for s in parts) / max(steps, 1),
                          tokens=sum(s.tokens for s in parts), seconds=sum(s.seconds for s in parts),
                          lr=parts[-1].lr)


def build_adamw(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; norms (1-D weights) are not decayed."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


class InnerLoop:
    def __init__(
        self,
        model: PreTrainedModel,
        sampler: ShardSampler,
        cfg: OptimConfig,
        total_steps: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.cfg = cfg
        self.device = torch.device(device)
        self.optimizer = build_adamw(model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
        self.step = 0

    def train_step(self) -> torch.Tensor:
        batch = self.sampler.next_batch().to(self.device, non_blocking=True)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss.detach()

    def run(self, steps: int, progress=None, log_every: int = 10) -> InnerStats:
        """Runs ``steps`` AdamW steps; ``progress`` is an optional tqdm bar advanced per step."""
        self.model.train()
        start = time.perf_counter()
        total = torch.zeros((), device=self.device)
        recent = torch.zeros((), device=self.device)
        for i in range(steps):
            loss = self.train_step()
            total += loss
            recent += loss
            if progress is not None:
                progress.update(1)
                if (i + 1) % log_every == 0 or i + 1 == steps:
                    # .item() syncs the device, so only at log points.
                    progress.set_postfix(loss=f"{recent.item() / ((i % log_every) + 1):.3f}", refresh=False)
                    recent.zero_()
        seconds = time.perf_counter() - start
        return InnerStats(
            steps=steps,
            loss=total.item() / max(steps, 1),
            tokens=steps * self.sampler.tokens_per_batch,
            seconds=seconds,
            lr=self.scheduler.get_last_lr()[0],
        )

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
