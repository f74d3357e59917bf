"""Codecs: how one flat fp32 vector travels as bytes.

A codec turns a vector into (scale bytes, payload bytes) and back. The transport
(:mod:`dipaco.comm.reduce`) never sums encoded values: it decodes every contribution and adds in
fp32 (a ring all-reduce in bf16/fp16 would round every partial sum to 8/11 mantissa bits, and int8
would overflow or need re-quantization at every hop). Streaming DiLoCo (arXiv 2501.18512) likewise
sends low-precision outer gradients and accumulates in fp32.

* ``fp32``: lossless; the transport all-reduces it directly.
* ``bf16`` / ``fp16``: a cast; no scales.
* ``int8``: per-chunk absmax scales (``chunk`` values per fp32 scale): q = round(x / s),
  s = absmax / 127, so |x - q s| <= absmax / 254 per element.

Adding a codec is one class here plus its name in :data:`CODECS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_EMPTY = torch.empty(0, dtype=torch.uint8)


def num_chunks(numel: int, chunk: int) -> int:
    return -(-numel // chunk)


def quantize_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk absmax int8: returns (q int8 of x's numel, fp32 scale per chunk); |x - q s| <= s / 2."""
    n = x.numel()
    padded = F.pad(x.reshape(-1).float(), (0, (-n) % chunk)).view(-1, chunk)
    scale = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.view(-1)[:n].contiguous(), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    n = q.numel()
    padded = F.pad(q.float(), (0, (-n) % chunk)).view(-1, chunk)
    return (padded * scale.unsqueeze(1)).view(-1)[:n]


@dataclass(frozen=True)
class Encoded:
    scale: torch.Tensor  # uint8 bytes of the scales (empty when the codec has none)
    payload: torch.Tensor  # uint8 bytes of the values
    decoded: torch.Tensor  # fp32: exactly what every receiver will decode


class Codec:
    """Encodes flat fp32 vectors. ``block``: vectors are cut only at multiples of it (scale chunks)."""

    name = "fp32"
    lossy = False
    block = 1

    def scale_bytes(self, numel: int) -> int:
        return 0

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> Encoded:
        x = x.float().contiguous()
        return Encoded(_EMPTY.to(x.device), x.view(torch.uint8), x)

    def decode(self, scale: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        return payload.view(torch.float32)


class Cast16(Codec):
    lossy = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> Encoded:
        low = x.to(self.dtype)
        return Encoded(_EMPTY.to(x.device), low.view(torch.uint8), low.float())

    def decode(self, scale: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        return payload.view(self.dtype).float()


class Int8(Codec):
    name = "int8"
    lossy = True

    def __init__(self, chunk: int) -> None:
        self.block = chunk

    def scale_bytes(self, numel: int) -> int:
        return 4 * num_chunks(numel, self.block)

    def payload_bytes(self, numel: int) -> int:
        return numel

    def encode(self, x: torch.Tensor) -> Encoded:
        q, scale = quantize_int8(x, self.block)
        return Encoded(scale.view(torch.uint8), q.view(torch.uint8), dequantize_int8(q, scale, self.block))

    def decode(self, scale: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        return dequantize_int8(payload.view(torch.int8), scale.view(torch.float32), self.block)


CODECS = ("fp32", "bf16", "fp16", "int8")


def build_codec(name: str, chunk: int = 1024) -> Codec:
    """``dist.comm_dtype`` -> its codec (``chunk``: int8 values per scale)."""
    if name == "fp32":
        return Codec()
    if name in ("bf16", "fp16"):
        return Cast16(name)
    if name == "int8":
        return Int8(chunk)
    raise ValueError(f"unknown codec {name!r}; one of {', '.join(CODECS)}")
