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
* ``int4``: the same with 15 levels: q = round(x / s) in [-7, 7], s = absmax / 7, two values per
  byte; |x - q s| <= absmax / 14.
* ``fp4``: **E2M1** (the OCP MX 4-bit float: 1 sign, 2 exponent, 1 mantissa bit; magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6) with a per-chunk fp32 scale s = absmax / 6, round to nearest, two
  values per byte. E2M1 rather than Streaming DiLoCo's E3M0 (powers of two only): the same 4 bits,
  but a relative step of at most 1/3 instead of 1/2 over the top of the range, where most of a
  chunk's energy is. Its error is at most half the largest gap: absmax / 6 per element.

The 4-bit codecs are meant for use with error feedback (:mod:`dipaco.comm.feedback`), as
Streaming DiLoCo does: their per-element error is large, but it is carried to the next sync.

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


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 16) (any integer dtype) -> uint8, two per byte (low nibble first), odd length padded."""
    c = codes.reshape(-1).to(torch.uint8)
    c = F.pad(c, (0, c.numel() % 2))
    return (c[0::2] | (c[1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` 4-bit codes of ``packed`` (uint8), as uint8."""
    p = packed.reshape(-1)
    return torch.stack((p & 15, p >> 4), dim=1).reshape(-1)[:numel]


# E2M1 magnitudes (code & 7) and the midpoints between neighbours (round to nearest; ties go up).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDPOINTS = ((E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2).tolist()
_E2M1_SIGNED = torch.cat([E2M1_VALUES, -E2M1_VALUES])  # code (sign bit 3 | magnitude index) -> value


def _chunk_scale(x: torch.Tensor, chunk: int, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x padded to whole chunks, as (chunks, chunk); fp32 scale per chunk = absmax / top)."""
    n = x.numel()
    padded = F.pad(x.reshape(-1).float(), (0, (-n) % chunk)).view(-1, chunk)
    return padded, padded.abs().amax(dim=1) / top


def quantize_int4(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk absmax int4 in [-7, 7]: (packed uint8 of ceil(numel / 2) bytes, fp32 scale per chunk)."""
    n = x.numel()
    padded, scale = _chunk_scale(x, chunk, 7.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / safe.unsqueeze(1)).clamp_(-7, 7).add_(8).to(torch.uint8)
    return pack_nibbles(q.view(-1)[:n]), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, chunk: int, numel: int) -> torch.Tensor:
    q = unpack_nibbles(packed, numel).float().sub_(8)
    padded = F.pad(q, (0, (-numel) % chunk)).view(-1, chunk)
    return (padded * scale.unsqueeze(1)).view(-1)[:numel]


def quantize_fp4(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk scaled E2M1: (packed uint8 codes, sign bit 3 | magnitude index bits 0-2; fp32 scale)."""
    n = x.numel()
    padded, scale = _chunk_scale(x, chunk, 6.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (padded / safe.unsqueeze(1)).view(-1)[:n]
    # Index = how many midpoints |y| reaches (ties up): seven uint8 comparisons beat bucketize's int64 binary
    # search on CPU (docs/notes/2026-11-23-streaming-delay-codecs.md), and it is the codec's hot loop (every
    # sync, every adaptive observation).
    magnitude = y.abs()
    index = (y < 0).to(torch.uint8) << 3
    for midpoint in _E2M1_MIDPOINTS:
        index += magnitude >= midpoint
    return pack_nibbles(index), scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, chunk: int, numel: int) -> torch.Tensor:
    values = _E2M1_SIGNED.to(packed.device)[unpack_nibbles(packed, numel).long()]
    padded = F.pad(values, (0, (-numel) % chunk)).view(-1, chunk)
    return (padded * scale.unsqueeze(1)).view(-1)[:numel]


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

    def decode(self, scale: torch.Tensor, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``numel`` fp32 values of an encoded vector."""
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

    def decode(self, scale: torch.Tensor, payload: torch.Tensor, numel: int) -> torch.Tensor:
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

    def decode(self, scale: torch.Tensor, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return dequantize_int8(payload.view(torch.int8), scale.view(torch.float32), self.block)


class Packed4(Codec):
    """A 4-bit codec with per-chunk fp32 scales (``int4`` or ``fp4``); ``chunk`` must be even, so
    that a chunk boundary never splits a byte."""

    lossy = True

    def __init__(self, name: str, chunk: int) -> None:
        if chunk % 2:
            raise ValueError(f"{name}: the chunk size must be even (two values per byte), got {chunk}")
        self.name, self.block = name, chunk
        self._quantize, self._dequantize = {"int4": (quantize_int4, dequantize_int4),
                                            "fp4": (quantize_fp4, dequantize_fp4)}[name]

    def scale_bytes(self, numel: int) -> int:
        return 4 * num_chunks(numel, self.block)

    def payload_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def encode(self, x: torch.Tensor) -> Encoded:
        packed, scale = self._quantize(x, self.block)
        return Encoded(scale.view(torch.uint8), packed, self._dequantize(packed, scale, self.block, x.numel()))

    def decode(self, scale: torch.Tensor, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return self._dequantize(payload, scale.view(torch.float32), self.block, numel)


CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "fp4")


def build_codec(name: str, chunk: int = 1024) -> Codec:
    """``dist.comm_dtype`` -> its codec (``chunk``: values per scale of int8, int4 and fp4)."""
    if name == "fp32":
        return Codec()
    if name in ("bf16", "fp16"):
        return Cast16(name)
    if name == "int8":
        return Int8(chunk)
    if name in ("int4", "fp4"):
        return Packed4(name, chunk)
    raise ValueError(f"unknown codec {name!r}; one of {', '.join(CODECS)}")
