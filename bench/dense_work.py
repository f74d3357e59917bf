"""The data-parallel baseline's work, shared by the two DDP rows of ``python -m bench sites`` (issues 72, 75): torch's
``DistributedDataParallel`` (``bench.sites --ddp-worker``) and torchft's fault-tolerant one (:mod:`bench.torchft_peer`)
train the same model on the same batches with the same optimizer, so that only the implementation differs.

The work: the dense path-sized model from the run's pretrained weights; every training document packed into one
shard, rank ``r`` of ``W`` drawing from the sequences ``r, r + W, ...`` with a generator seeded ``seed + r``; DiPaCo's
global tokens per step (``paths`` x the inner batch) split over the ranks; AdamW with the inner loop's settings and
schedule, for as many steps as a path takes (``train.rounds`` x ``train.inner_steps``); the whole validation split
scored every ``train.inner_steps`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dipaco.config import Config
from dipaco.data.packing import PackedShard


@dataclass
class DenseWork:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: Any  # torch.optim.lr_scheduler.LambdaLR
    sequences: PackedShard  # rows indexed by a tensor of sequence numbers
    mine: np.ndarray  # the sequences this rank draws from
    local_batch: int
    generator: torch.Generator
    steps: int
    eval_every: int
    grad_clip: float
    docs: Any
    scoring: Any

    def next_batch(self) -> torch.Tensor:
        picked = torch.randint(len(self.mine), (self.local_batch,), generator=self.generator).numpy()
        return self.sequences[self.mine[picked]]

    def validation_ppl(self) -> float:
        """The validation split's perplexity with the weights now (the model is left in training mode)."""
        from dipaco.model.scoring import score_documents

        self.model.eval()
        with torch.no_grad():
            scores = score_documents(self.model, self.docs, self.scoring)
        self.model.train()
        return math.exp(float(scores.nll.sum()) / float(scores.tokens.sum()))


def dense_work(cfg: Config, paths: int, rank: int, world: int) -> DenseWork:
    """Rank ``rank`` of ``world``'s share of the baseline's work (see the module's docstring)."""
    from dipaco.data.packing import DocumentTokens
    from dipaco.eval.evaluate import validation_split
    from dipaco.model.pretrained import load_pretrained, path_llama_config
    from dipaco.model.scoring import Scoring
    from dipaco.paths.lr_schedule import build_scheduler
    from dipaco.route.shards import build_shards, routed_data

    prepared = routed_data(cfg.run.dir, cfg.data, cfg.tokenizer, False)
    sequences = build_shards(prepared.train, np.zeros(len(prepared.train), dtype=np.int64), 1, cfg.data.seq_len,
                             prepared.tokenizer.eos_token_id)[0]
    llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
    model = load_pretrained(Path(cfg.run.dir) / "pretrain", llama).train()
    optim = cfg.train.optim
    steps = cfg.train.rounds * cfg.train.inner_steps
    # torch's AdamW over every parameter, not dipaco's build_adamw (which spares norms and biases the decay): the
    # baseline as a user writes it by hand; docs/notes/2026-12-06-torchft-side-by-side.md
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                  weight_decay=optim.weight_decay)
    schedule = build_scheduler(optimizer, optim.warmup_steps, steps, optim.min_lr_ratio)
    val = validation_split(cfg.eval, prepared)
    docs = DocumentTokens(val).documents(np.arange(len(val)), np.int32)
    scoring = Scoring(cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id)
    return DenseWork(model=model, optimizer=optimizer, schedule=schedule, sequences=sequences,
                     mine=np.arange(rank, len(sequences), world), local_batch=max(1, paths * optim.batch_size // world),
                     generator=torch.Generator().manual_seed(cfg.run.seed + rank), steps=steps,
                     eval_every=cfg.train.inner_steps, grad_clip=optim.grad_clip, docs=docs, scoring=scoring)
