"""Encode with tiktoken's BPE engine, and get exactly the ids of the HF byte-level BPE it stands in for.

`dipaco prepare` spends almost all its time encoding. On the shared 2-core machine, HF `tokenizers`
(``encode_batch_fast``, both cores) encodes the benchmark corpus at about 0.9M tokens/s and tiktoken at
about 2.6M (docs/notes/2026-11-27-corpora-larger-than-memory.md). tiktoken takes a vocabulary as ``bytes -> rank``
and a split pattern, so a byte-level BPE trained by HF (:func:`dipaco.data.tokenizer.train_tokenizer`) converts to it
directly. :func:`tiktoken_bpe` does the conversion only where the ids are provably the same, and says
why not otherwise; the caller then keeps HF.

Why the ids are the same. Both engines split the text with the same GPT-2 pattern, then merge each
piece's bytes. HF repeatedly merges the adjacent pair of lowest *merge* rank (leftmost first); tiktoken
the adjacent pair whose *concatenation* has the lowest token id (leftmost first). Require

1. the i-th merge ``(a, b)`` makes the token ``a + b``, and its id grows with i; and
2. every token's own bytes encode, under HF's merges, to that one token.

Then the two merge the same pairs in the same order. While they agree, a pair HF may merge is one
tiktoken may merge, with the same rank (1). They could part only where tiktoken merges an adjacent pair
``x, y`` that is no merge although ``x + y = z`` is a token. Every merge that built ``x`` and ``y`` was
inside the bytes of ``z`` (a byte merged with a neighbour outside never comes back), so HF run on ``z``
alone passes through the same state ``[x, y]``, where it stops, since ``(x, y)`` is no merge: ``z`` does
not encode to itself, against (2). Condition 1 holds for every BPE HF trains; (2) is checked here, one
lookup per token, before any text is encoded.

What is not covered by the argument: the two regex engines' Unicode tables (HF's Oniguruma and
tiktoken's fancy-regex), which classify letters, digits and spaces. They agree on every character the
test suite and the benchmark corpora hold; characters assigned in a recent Unicode version could be
classed differently by one of them. Such a text still decodes to itself exactly.

Texts whose split makes tiktoken's regex give up (its backtracking limit, hit by runs of about a
million spaces) are encoded by HF instead, one text at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tokenizers import Tokenizer

# HF's ByteLevel pre-tokenizer pattern (use_regex=true), the GPT-2 one
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's character for each byte (printable bytes stand for themselves, the others are
    shifted past 255), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + sum(1 for c in chars.values() if c >= 256)
    return {chr(c): b for b, c in chars.items()}


class TiktokenBPE:
    """A byte-level BPE tokenizer's encoder on tiktoken's engine; build it with :func:`tiktoken_bpe`."""

    def __init__(self, encoding, fallback: Tokenizer, threads: int) -> None:
        self.encoding = encoding
        self.fallback = fallback
        self.threads = max(1, threads)
        self._specials = encoding.special_tokens_set  # split on them, as HF does on added tokens

    def _one(self, text: str) -> np.ndarray:
        try:
            return self.encoding.encode_to_numpy(text, allowed_special=self._specials)
        except ValueError:  # the regex's backtracking limit: HF has none
            return np.asarray(self.fallback.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def _run(self, texts: list[str]) -> list[np.ndarray]:
        return [self._one(t) for t in texts]

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids (uint32), no special tokens added; ``threads`` threads, each over a contiguous
        part (tiktoken releases the GIL while it encodes)."""
        if self.threads == 1 or len(texts) < 2 * self.threads:
            return self._run(texts)
        size = -(-len(texts) // self.threads)
        with ThreadPoolExecutor(self.threads) as pool:
            parts = pool.map(self._run, [texts[i : i + size] for i in range(0, len(texts), size)])
            return [ids for part in parts for ids in part]


def tiktoken_bpe(backend: Tokenizer, threads: int) -> tuple[TiktokenBPE | None, str]:
    """``backend``'s encoder on tiktoken, or None and the reason it would not give the same ids."""
    spec = json.loads(backend.to_str())
    reason = _unlike_byte_level_bpe(spec)
    if reason:
        return None, reason
    model = spec["model"]
    specials = {t["content"]: t["id"] for t in spec["added_tokens"]}
    ranks = _byte_ranks(model["vocab"], set(specials))
    if isinstance(ranks, str):
        return None, ranks
    reason = _merge_order_problem(model["vocab"], model["merges"]) or _token_not_itself(backend, model["vocab"], set(specials))
    if reason:
        return None, reason
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed"
    encoding = tiktoken.Encoding("dipaco-byte-level-bpe", pat_str=BYTE_LEVEL_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=specials)
    return TiktokenBPE(encoding, backend, threads), "tiktoken"


def _unlike_byte_level_bpe(spec: dict) -> str:
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    checks: list[tuple[bool, str]] = [
        (model.get("type") == "BPE", f"model is {model.get('type')}, not BPE"),
        (spec.get("normalizer") is None, "it has a normalizer"),
        (pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"),
         f"pre-tokenizer {pre.get('type')} is not ByteLevel(add_prefix_space=false, use_regex=true)"),
        (not model.get("dropout"), "BPE dropout"),
        (not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"), "subword prefix or suffix"),
        (not model.get("byte_fallback") and model.get("unk_token") is None, "unknown-token handling"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    for token in spec.get("added_tokens", []):
        if not token.get("special") or token.get("normalized") or token.get("lstrip") or token.get("rstrip") \
                or token.get("single_word"):
            return f"added token {token.get('content')!r} is not a plain special token"
    contents = [t["content"] for t in spec.get("added_tokens", [])]
    if any(a != b and a in b for a in contents for b in contents):
        return "one added token is inside another"  # HF takes the longest match, tiktoken the first
    return ""


def _byte_ranks(vocab: dict[str, int], specials: set[str]) -> dict[bytes, int] | str:
    alphabet = byte_level_alphabet()
    ranks: dict[bytes, int] = {}
    for token, rank in vocab.items():
        if token in specials:
            continue
        if any(ch not in alphabet for ch in token):
            return f"token {token!r} is not made of byte-level characters"
        ranks[bytes(alphabet[ch] for ch in token)] = rank
    if sum(len(b) == 1 for b in ranks) < 256:
        return "the vocabulary does not hold all 256 bytes"
    return ranks


def _merge_order_problem(vocab: dict[str, int], merges: list) -> str:
    made = -1
    for i, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = vocab.get(left + right)
        if token is None:
            return f"merge {i} ({left!r}, {right!r}) makes no token of the vocabulary"
        if token <= made:
            return f"merge {i} makes token {token}, not after the token of the merge before it"
        made = token
    return ""


def _token_not_itself(backend: Tokenizer, vocab: dict[str, int], specials: set[str]) -> str:
    tokenize: Callable = backend.model.tokenize
    for token, rank in vocab.items():
        if token not in specials and [t.id for t in tokenize(token)] != [rank]:
            return f"token {rank} ({token!r}) does not encode to itself"
    return ""
