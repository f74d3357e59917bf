"""Checkpoints off the critical path: a snapshot copied into reused host buffers, written in the background.

A round's state lives in the models and optimizers that the next round changes in place, so it has
to be copied before training goes on; writing it (serializing, hashing every file into the manifest,
fsync, the atomic rename of :class:`~dipaco.checkpoint.store.CheckpointManager`) does not. The
trainer hands each snapshot to a :class:`BackgroundWriter`:

* :class:`HostBuffers` copies every tensor of the snapshot into a host buffer allocated once and
  reused at every checkpoint (pinned memory when the tensor is on CUDA, so the copy is a DMA
  transfer that the writer waits for with a CUDA event); the copy is all a round waits for;
* one writer thread writes the copy with the store's own ``save``: the same files, manifest and
  rename as the synchronous writer, byte for byte. At most one write is in flight: the next snapshot
  first waits for it, because it reuses its buffers.

A kill at any moment of a write leaves the previous checkpoint intact (the store writes into a
temporary directory and renames it whole), so a resumed run continues from it, bit-exactly. An error
of the write (a full disk) is raised in the trainer's thread at its next wait. With several ranks, the
writers coordinate through their own process group (:meth:`dipaco.comm.world.World.writers`), never the
training one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dipaco.checkpoint.store import CheckpointManager, Writers

Write = Callable[[Path], Iterable[Path] | None]


class HostBuffers:
    """Host copies of a snapshot's tensors, one buffer per place in the snapshot, reused from one checkpoint
    to the next (a tensor that changes shape or dtype gets a new one)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def copy(self, tree: Any) -> Any:
        """``tree`` (dicts, lists, tuples, dataclasses; tensors anywhere) with every tensor replaced by its host
        copy. An object met twice is copied once (as ``copy.deepcopy`` does), and a tuple that holds nothing
        to copy is kept, so ``torch.save`` writes the copy with the bytes it writes for ``tree``."""
        return self._copy(tree, "", {})

    def _copy(self, tree: Any, key: str, memo: dict[int, Any]) -> Any:
        if id(tree) in memo:
            return memo[id(tree)]
        if torch.is_tensor(tree):
            out: Any = self._copy_tensor(tree, key)
        elif isinstance(tree, dict):
            out = {k: self._copy(v, f"{key}/{k}", memo) for k, v in tree.items()}
        elif type(tree) is list:
            out = [self._copy(v, f"{key}[{i}]", memo) for i, v in enumerate(tree)]
        elif type(tree) is tuple:
            items = tuple(self._copy(v, f"{key}[{i}]", memo) for i, v in enumerate(tree))
            out = tree if all(a is b for a, b in zip(items, tree)) else items
        elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):  # a Snapshot
            out = dataclasses.replace(tree, **{f.name: self._copy(getattr(tree, f.name), f"{key}.{f.name}", memo)
                                               for f in dataclasses.fields(tree) if f.init})
        elif isinstance(tree, np.ndarray):
            out = tree.copy()
        elif isinstance(tree, (bool, int, float, complex, str, bytes, type(None), np.generic)):
            out = tree  # immutable: nothing the next round changes
        else:
            raise TypeError(f"a checkpoint snapshot holds a {type(tree).__name__} at {key or 'its root'}: "
                            f"HostBuffers copies tensors, dicts, lists, tuples and dataclasses of them")
        memo[id(tree)] = out
        return out

    def _copy_tensor(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.is_cuda and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
            self.nbytes = sum(b.numel() * b.element_size() for b in self._buffers.values())
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        return buffer


class BackgroundWriter:
    """Writes checkpoints with ``manager.save`` in one background thread, one at a time (see the module docstring)."""

    def __init__(self, manager: CheckpointManager, writers: Writers | None = None) -> None:
        self.manager, self.writers = manager, writers
        self.buffers = HostBuffers()
        self._thread: threading.Thread | None = None
        self._result: tuple[int, Path | None, BaseException | None] | None = None
        self.blocked_s = 0.0  # what the trainer waited for, over the run: copies, and writes still in flight

    def submit(self, index: int, snapshot: Any, write: Callable[[Any], Write]) -> None:
        """Copies ``snapshot`` into the host buffers and starts writing checkpoint ``index`` with
        ``write(copy)``; waits first for the write in flight (call :meth:`wait` to get its result)."""
        if self._thread is not None:
            raise RuntimeError("BackgroundWriter.submit: the previous write was not waited for")
        start = time.perf_counter()
        copy = self.buffers.copy(snapshot)
        done = torch.cuda.Event() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        if done is not None:
            done.record()
        self.blocked_s += time.perf_counter() - start
        self._thread = threading.Thread(target=self._run, args=(index, write(copy), done),
                                        name=f"dipaco-checkpoint-{index}", daemon=True)
        self._thread.start()

    def _run(self, index: int, write: Write, done: Any) -> None:
        try:
            if done is not None:
                done.synchronize()  # the copies into pinned memory have landed
            self._result = (index, self.manager.save(index, write, self.writers), None)
        except BaseException as exc:  # handed to the trainer's thread by wait()
            self._result = (index, None, exc)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def wait(self) -> tuple[int, Path] | None:
        """Waits for the write in flight; returns (index, checkpoint), None when none was in flight, or
        raises the write's error."""
        if self._thread is None:
            return None
        start = time.perf_counter()
        self._thread.join()
        self.blocked_s += time.perf_counter() - start
        self._thread, result, self._result = None, self._result, None
        assert result is not None
        index, path, error = result
        if error is not None:
            raise error
        assert path is not None
        return index, path
