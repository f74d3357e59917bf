"""Numeric precision of forward passes: fp32, or bf16/fp16 autocast over fp32 master weights.

Every job that runs a path model (pretrain, train, eval, route featurization, generate, serve)
takes a precision name: ``fp32 | bf16 | fp16 | auto``. ``auto`` is bf16 on CUDA and fp32 on CPU, so
GPU users get the fast path without asking while CPU results (and the bit-exact CPU tests) keep
holding. Only the forward pass is autocast: parameters, gradients, the bank, the outer step and
AdamW's states stay fp32, which is what keeps DiLoCo's averaged deltas exact in fp32.

fp16 needs loss scaling (its exponent range underflows small gradients); :meth:`Precision.grad_scaler`
gives a ``torch.amp.GradScaler`` whose state the inner loop checkpoints. bf16 has fp32's exponent
range and needs none.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dipaco.config import PRECISIONS
from dipaco.errors import ConfigError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16 (``auto`` already resolved)
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES.get(self.name, torch.float32)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward pass's context: autocast to ``dtype``, or nothing at fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A dynamic loss scaler for fp16; None otherwise."""
        return torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None


def resolve_precision(name: str, device: torch.device | str, key: str = "precision") -> Precision:
    """``name`` for ``device``; ``key`` names the config key in errors."""
    device = torch.device(device)
    if name not in PRECISIONS:
        raise ConfigError(f"{key}: {name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "auto":
        name = "bf16" if device.type == "cuda" else "fp32"
    if name == "bf16" and device.type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{key}: bf16 is not supported by {torch.cuda.get_device_name(device)}; use fp16")
    return Precision(name, device)
