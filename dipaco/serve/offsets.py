"""Where each token's text starts in a decoded text (OpenAI's ``logprobs.text_offset``), in time linear in the tokens.

The text is ``tokenizer.decode(ids, skip_special_tokens=True)``, so a special token has no text: it gets the
offset of what follows it. A token that starts inside a character (a multi-byte character split over tokens)
gets the offset of that character, where the text it helps to spell starts.

A byte-level tokenizer (a ``ByteLevel`` decoder: the BPEs dipaco trains, GPT-2's, Llama 3's, SmolLM's) is
read byte by byte (:func:`byte_level_offsets`): the text is those bytes decoded as UTF-8, each byte sequence that
is not a character (one that never completes) one U+FFFD, as the tokenizer's decoder writes it; a token after
such a U+FFFD starts after it. Any other tokenizer is decoded in short overlapping windows
(:func:`window_offsets`), which give what decoding every prefix gives wherever decoding is local.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dipaco.data.fast_bpe import byte_level_alphabet

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (or not yet) a character
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte of SentencePiece's byte fallback
# window_offsets: the tokens one batch of decodes gives the offsets of, the tokens decoded before its anchor at
# least, and how far back it looks for prefixes that end in a whole character. A token costs about
# CONTEXT + BLOCK token decodes, 2 * REACH + CONTEXT + BLOCK at worst.
BLOCK, CONTEXT, REACH = 16, 8, 64
# For a lead byte whose second byte is restricted (no overlong forms, no surrogates, nothing past U+10FFFF:
# Unicode's table 3-7), that byte's range; every other continuation byte is 0x80..0xBF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def text_offsets(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Where each of ``ids`` starts in ``tokenizer.decode(ids, skip_special_tokens=True)`` (module docstring)."""
    special = skipped_ids(tokenizer)
    kept = [t for t in ids if t not in special]
    offsets = byte_level_offsets(tokenizer, kept)
    if offsets is None:
        offsets = window_offsets(tokenizer, kept)
    out: list[int] = []
    before = 0  # the kept tokens before this one
    for t in ids:
        out.append(offsets[before])
        before += t not in special
    return out


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` leaves out: the backend's added tokens marked special."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return frozenset(tokenizer.all_special_ids)
    return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)


# --- byte-level tokenizers ------------------------------------------------------------------------------
def byte_level_offsets(tokenizer: Any, ids: Sequence[int]) -> list[int] | None:
    """The offset of each of ``ids`` (no special ones) and of the text's end, from the bytes the tokens stand for;
    None where the tokenizer is not byte-level or its decoding is not those bytes as UTF-8 (a clean-up step,
    an unknown id), so the caller decodes instead."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    alphabet = _alphabet()
    pieces: list[bytes] = []
    for t in ids:
        token = backend.id_to_token(t)
        if token is None:
            return None
        pieces.append(token_bytes(token, alphabet))
    data = b"".join(pieces)
    ends = character_ends(data)
    text = data.decode("utf-8", errors="replace")
    if len(ends) != len(text) or text != tokenizer.decode(list(ids), skip_special_tokens=True):
        return None
    offsets: list[int] = []
    start = 0
    for piece in pieces:
        offsets.append(bisect.bisect_right(ends, start))  # the characters that end before this token starts
        start += len(piece)
    offsets.append(len(ends))
    return offsets


@functools.cache
def _alphabet() -> dict[str, int]:
    return byte_level_alphabet()


def token_bytes(token: str, alphabet: dict[str, int]) -> bytes:
    """The bytes a byte-level token stands for; an added token spelt outside the alphabet stands for its UTF-8, as
    the ByteLevel decoder reads it."""
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:
        return token.encode()


def character_ends(data: bytes) -> list[int]:
    """Where each character of ``data.decode("utf-8", errors="replace")`` ends in ``data``: a valid sequence is one
    character, and so is each maximal start of one that does not complete (one U+FFFD), as Unicode recommends and
    both Python's and the tokenizers' (Rust's) decoders do; any other byte is a U+FFFD of its own."""
    ends: list[int] = []
    at, n = 0, len(data)
    while at < n:
        lead = data[at]
        need = 1 if lead < 0xC2 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4 if lead < 0xF5 else 1
        end = at + 1
        low, high = _SECOND_BYTE.get(lead, (0x80, 0xBF))
        while end < at + need and end < n and low <= data[end] <= high:
            end += 1
            low, high = 0x80, 0xBF
        ends.append(end)
        at = end
    return ends


# --- any tokenizer ----------------------------------------------------------------------------------------
def window_offsets(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """The offset of each of ``ids`` (no special ones) and of the text's end, as decoding each prefix gives it:
    the prefix's length without the U+FFFD it ends with (the start of a character the next tokens complete).

    The prefixes of a block of ``BLOCK`` tokens are decoded from a window start and measured from an anchor: the
    last cut up to the block, the start the last cut at least ``CONTEXT`` tokens before the anchor (a decoder's
    rule for its first token, a leading space stripped, falls before the anchor); a prefix's length is the
    anchor's plus what the window's text grew by. A cut is where a prefix ends in a whole character, and not
    between two byte tokens (SentencePiece's byte fallback decodes a run of them as one: a run that is not UTF-8
    becomes one U+FFFD a byte, its characters before too). Exact wherever decoding more tokens leaves the text
    before a cut as it was: byte-level and SentencePiece decoders, but for a run of byte tokens longer than
    ``REACH`` that is not UTF-8."""
    n = len(ids)
    length = [0] * (n + 1)  # len(decode(ids[:j]))
    trailing = [0] * (n + 1)  # the U+FFFD it ends with
    byte = [BYTE_TOKEN.fullmatch(t or "") is not None for t in tokenizer.convert_ids_to_tokens(list(ids))]
    cuts = Cuts(trailing, [j == 0 or j == n or not (byte[j - 1] and byte[j]) for j in range(n + 1)])
    for block in range(0, n, BLOCK):
        stop = min(block + BLOCK, n)
        anchor = cuts.last(block, block)
        start = 0 if anchor <= CONTEXT else cuts.last(anchor - CONTEXT, anchor)
        window = [list(ids[start:j]) for j in (anchor, *range(block + 1, stop + 1))]
        texts = tokenizer.batch_decode(window, skip_special_tokens=True)
        base = length[anchor] - len(texts[0])
        for j, text in enumerate(texts[1:], block + 1):
            length[j] = base + len(text)
            run = len(text) - len(text.rstrip(REPLACEMENT))
            trailing[j] = run if run < len(text) else run + trailing[start]  # all U+FFFD: the run began before
    return [size - run for size, run in zip(length, trailing)]


@dataclass(frozen=True)
class Cuts:
    """Where :func:`window_offsets` may start a window or measure from: prefixes known to end in a whole character
    (``trailing`` 0) whose last token and the next may be decoded apart (``apart``: not two byte tokens)."""

    trailing: list[int]
    apart: list[bool]

    def last(self, latest: int, before: int) -> int:
        """The last cut from ``latest`` back to ``REACH`` tokens before ``before``; ``latest`` when there is none."""
        for j in range(latest, max(0, before - REACH) - 1, -1):
            if self.trailing[j] == 0 and self.apart[j]:
                return j
        return latest
