"""ShardSampler: seeded, resumable batches of packed sequences from one shard.

Each epoch visits every sequence once in an order drawn from ``(seed, epoch)``; the cursor
``(epoch, position)`` is all the state there is, so a resumed run draws exactly the batches an
uninterrupted run would have drawn.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dipaco.errors import DataError


class Sequences(Protocol):
    """Packed rows, (n_rows, seq_len): an in-memory LongTensor, or a
    :class:`dipaco.data.packing.PackedShard` that reads them from disk."""

    ndim: int

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor: ...


class ShardSampler:
    def __init__(self, sequences: Sequences, batch_size: int, seed: int) -> None:
        if sequences.ndim != 2 or sequences.shape[0] == 0:
            raise DataError(f"a shard needs at least one packed sequence, got shape {tuple(sequences.shape)}")
        self.sequences = sequences
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.sequences.shape[0], generator=generator)

    def next_batch(self) -> torch.Tensor:
        """The next ``batch_size`` sequences; an epoch boundary inside a batch just continues."""
        picked = []
        needed = self.batch_size
        while needed:
            take = self._order[self.position : self.position + needed]
            picked.append(take)
            needed -= take.numel()
            self.position += take.numel()
            if self.position == self._order.numel():
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        return self.sequences[torch.cat(picked)]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.sequences.shape[1]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self.position >= self.sequences.shape[0]:
            # The shard shrank (re-routing between rounds): the interrupted epoch is over.
            self.epoch, self.position = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
