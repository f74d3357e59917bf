"""Where each token starts in a decoded text (OpenAI's ``text_offset``; issue 76): the same offsets as decoding
every prefix, which cost time quadratic in the tokens, in linear time; a byte sequence that never completes a
character counted where decoding every prefix left it out."""

from __future__ import annotations

import random

import pytest
import transformers
from open_model import build_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers

from dipaco.data.fast_bpe import byte_level_alphabet
from dipaco.serve.offsets import byte_level_offsets, skipped_ids, text_offsets, token_bytes, window_offsets

FFFD = "\ufffd"
# Words in scripts of 1 to 4 UTF-8 bytes a character, so tokens split characters (a byte-level BPE merges bytes
# across characters; a SentencePiece vocabulary without a character spells it in byte tokens).
TEXTS = ["The café in Zürich served crème brûlée to a naïve critic. Привет, мир! Как дела у тебя сегодня? "
         "你好，世界。こんにちは、元気ですか 🙂🚀🎉 résumé ½ €5 £3 — “quoted” … Ελληνικά γράμματα και ఆంధ్ర "] * 8
BYTE_BPE = "dipaco.serve.offsets.byte_level_offsets"


def reference_offsets(tokenizer, ids: list[int]) -> list[int]:
    """The rule before issue 76's fix, one decode per prefix: the prefix's length without the U+FFFD it ends with."""
    texts = tokenizer.batch_decode([ids[:i] for i in range(len(ids))], skip_special_tokens=True)
    return [len(t.rstrip(FFFD)) for t in texts]


def character_offsets(tokenizer, ids: list[int]) -> list[int]:
    """What a byte-level token's offset is, from its bytes alone: a token starts at a character of the text when the
    bytes before it and the bytes from it, decoded apart, give the text; else inside the last character those
    before it start (decoded alone, it is one U+FFFD)."""
    special, alphabet = skipped_ids(tokenizer), byte_level_alphabet()
    pieces = [b"" if t in special else token_bytes(tokenizer.convert_ids_to_tokens(t), alphabet) for t in ids]
    data = b"".join(pieces)
    text = data.decode("utf-8", errors="replace")
    out, start = [], 0
    for piece in pieces:
        before = data[:start].decode("utf-8", errors="replace")
        out.append(len(before) - (before + data[start:].decode("utf-8", errors="replace") != text))
        start += len(piece)
    return out


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory) -> transformers.PreTrainedTokenizerFast:
    return build_tokenizer(tmp_path_factory.mktemp("byte_bpe"), TEXTS, vocab_size=420)


@pytest.fixture(scope="module")
def sentencepiece() -> transformers.PreTrainedTokenizerFast:
    """Llama 2's kind of tokenizer: "▁" for a space, byte tokens <0x..> for characters outside the vocabulary,
    and a decoder that strips the text's leading space. Its vocabulary is built here (no training: the same every
    run): the characters and words of a few Latin, Cyrillic and Greek words, each word merged letter by letter."""
    words = ["▁the", "▁café", "▁in", "▁Zürich", "▁served", "▁to", "▁a", "▁Привет,", "▁мир!", "▁Как", "▁дела",
             "▁Ελληνικά", "▁και"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = []
    for word in words:
        for ch in word:
            vocab.setdefault(ch, len(vocab))
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                merges.append((word[: k - 1], word[k - 1]))
                vocab[word[:k]] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def byte_ids(tokenizer, ids: list[int]) -> list[int]:
    """The single-byte tokens of a byte-level BPE's tokens."""
    ids_of = {b: tokenizer.convert_tokens_to_ids(c) for c, b in byte_level_alphabet().items()}
    alphabet = byte_level_alphabet()
    return [ids_of[b] for t in ids for b in token_bytes(tokenizer.convert_ids_to_tokens(t), alphabet)]


def text_tokens(tokenizer, rng: random.Random, n: int, spell_in_bytes: bool) -> list[int]:
    """About ``n`` tokens of the texts from a random place, special tokens among them; some tokens spelt byte by
    byte (a multi-byte character split over tokens) when ``spell_in_bytes``."""
    text = TEXTS[0] * (2 + n // 20)  # a copy is more than 20 tokens
    at = rng.randrange(len(TEXTS[0]))
    ids = tokenizer(text[at:], add_special_tokens=False)["input_ids"][:n]
    special = sorted(skipped_ids(tokenizer))
    out: list[int] = []
    for t in ids:
        if rng.random() < 0.08:
            out.append(rng.choice(special))
        out.extend(byte_ids(tokenizer, [t]) if spell_in_bytes and rng.random() < 0.2 else [t])
    return out


def any_tokens(tokenizer, rng: random.Random, n: int) -> list[int]:
    """``n`` random ids of the whole vocabulary, special tokens and runs of byte tokens that are not UTF-8 too."""
    return [rng.randrange(len(tokenizer)) for _ in range(n)]


def test_byte_level_offsets_equal_decoding_every_prefix(byte_bpe):
    rng = random.Random(0)
    inside = 0  # tokens that start inside a character: the case that needs care
    for n in [1, 2, 5, 30, 120, 400] * 8:
        ids = text_tokens(byte_bpe, rng, n, spell_in_bytes=True)
        assert byte_level_offsets(byte_bpe, [t for t in ids if t not in skipped_ids(byte_bpe)]) is not None
        offsets = text_offsets(byte_bpe, ids)
        assert offsets == reference_offsets(byte_bpe, ids)
        assert offsets == character_offsets(byte_bpe, ids)
        inside += sum(byte_bpe.decode(ids[:i], skip_special_tokens=True).endswith(FFFD) for i in range(len(ids)))
    assert inside > 100


def test_a_byte_sequence_that_never_completes_is_a_character_of_the_text(byte_bpe):
    """Decoding every prefix left out every U+FFFD a prefix ends with, so a token after bytes that never complete a
    character (a stray continuation byte, a character's start followed by something else) got the offset of
    those bytes: inside its own text's past. Now it starts after their U+FFFD."""
    ids_of = {b: byte_bpe.convert_tokens_to_ids(c) for c, b in byte_level_alphabet().items()}
    a, b, cut = ids_of[ord("a")], ids_of[ord("b")], ids_of[0xE2]  # 0xE2: the first of 3 bytes (e.g. of "€")
    eos = byte_bpe.eos_token_id
    assert byte_bpe.decode([a, cut, b]) == "a\ufffdb"
    assert reference_offsets(byte_bpe, [a, cut, b]) == [0, 1, 1]  # b at 1: where the U+FFFD is
    assert text_offsets(byte_bpe, [a, cut, b]) == [0, 1, 2]
    assert text_offsets(byte_bpe, [a, cut, eos]) == [0, 1, 2]  # the EOS after the text's last character
    assert text_offsets(byte_bpe, [a, cut, ids_of[0x82], b]) == [0, 1, 1, 2]  # 0x82 continues the U+FFFD's bytes
    assert text_offsets(byte_bpe, [a, cut, ids_of[0x82], ids_of[0xAC], b]) == [0, 1, 1, 1, 2]  # "a€b"
    rng = random.Random(1)
    differ = 0
    for n in [1, 3, 10, 60, 300] * 10:
        ids = any_tokens(byte_bpe, rng, n)
        text = byte_bpe.decode(ids, skip_special_tokens=True)
        offsets, before = text_offsets(byte_bpe, ids), reference_offsets(byte_bpe, ids)
        assert offsets == character_offsets(byte_bpe, ids)
        for new, old in zip(offsets, before):
            assert new == old or (new > old and set(text[old:new]) == {FFFD})  # only where U+FFFD were left out
            differ += new != old
    assert differ > 50


@pytest.mark.parametrize("tokenizer", ["byte_bpe", "sentencepiece"])
def test_window_offsets_equal_decoding_every_prefix(tokenizer, request):
    """The decoding of any tokenizer that is not byte-level, in windows: here SentencePiece's kind (its leading space
    stripped, byte tokens for characters outside its vocabulary) and a byte-level BPE read that way."""
    tok = request.getfixturevalue(tokenizer)
    rng = random.Random(2)
    special = skipped_ids(tok)
    for n in [1, 4, 17, 40, 150, 500] * 6:
        for ids in (text_tokens(tok, rng, n, spell_in_bytes=tokenizer == "byte_bpe"), any_tokens(tok, rng, n)):
            kept = [t for t in ids if t not in special]
            assert window_offsets(tok, kept)[:-1] == reference_offsets(tok, kept)
            assert text_offsets(tok, ids) == (reference_offsets(tok, ids) if tokenizer == "sentencepiece"
                                              else character_offsets(tok, ids))


def test_the_sentencepiece_tokenizer_spells_characters_in_byte_tokens(sentencepiece):
    """The fixture has what the window test needs: byte tokens, a decoder that strips the leading space."""
    ids = sentencepiece("the 你好 café", add_special_tokens=False)["input_ids"]
    tokens = sentencepiece.convert_ids_to_tokens(ids)
    assert "<0xE4>" in tokens and "▁café" in tokens
    assert sentencepiece.decode(ids) == "the 你好 café"
    assert byte_level_offsets(sentencepiece, ids) is None  # not byte-level: decoded in windows


class CountingTokenizer:
    """A tokenizer whose decoding counts the sequences and tokens it decodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.sequences, self.tokens = tokenizer, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def decode(self, ids, **kwargs):
        self.sequences, self.tokens = self.sequences + 1, self.tokens + len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def batch_decode(self, batch, **kwargs):
        self.sequences, self.tokens = self.sequences + len(batch), self.tokens + sum(len(ids) for ids in batch)
        return self.tokenizer.batch_decode(batch, **kwargs)


@pytest.mark.parametrize("tokenizer", ["byte_bpe", "sentencepiece"])
@pytest.mark.parametrize("kind", ["text", "any"])
def test_an_8192_token_input_decodes_linearly_many_tokens(tokenizer, kind, request):
    """Decoding every prefix of 8,192 tokens decoded 8,192 sequences of 33,550,336 tokens in all (seconds of work
    per echoed request, n**2 / 2); the offsets now decode a number of tokens linear in n."""
    tok = request.getfixturevalue(tokenizer)
    rng = random.Random(3)
    n = 8192
    ids = (text_tokens(tok, rng, n, spell_in_bytes=False) if kind == "text" else any_tokens(tok, rng, n))[:n]
    assert len(ids) == n
    counting = CountingTokenizer(tok)
    offsets = text_offsets(counting, ids)
    assert len(offsets) == n
    old = n * (n - 1) // 2
    assert counting.tokens <= 64 * n < old // 60
    assert counting.sequences <= 2 * n


@pytest.fixture(scope="module")
def pipe(served_run):
    from dipaco.serve.pipeline import Pipeline
    from dipaco.serve.router_passes import RouterOptions

    return Pipeline.from_run(served_run.run.dir, router=RouterOptions(in_child=False))


def test_a_completions_logprobs_count_a_character_that_never_completes(pipe):
    """The case reported on /v1/completions: a generated token that starts a character no later token completes is a
    U+FFFD of the text, and the tokens after it start after it, in the echoed prompt and in the completion."""
    from dipaco.serve import openai_api as oa
    from dipaco.serve.decode import DecodeRow, TokenScore

    ids_of = {b: pipe.tokenizer.convert_tokens_to_ids(c) for c, b in byte_level_alphabet().items()}
    a, b, c, cut = ids_of[ord("a")], ids_of[ord("b")], ids_of[ord("c")], ids_of[0xE2]
    eos = pipe.tokenizer.eos_token_id
    row = DecodeRow([c, cut, a], max_new_tokens=4, logprobs=0, prompt_logprobs=True)
    row.tokens = [a, cut, b, eos]
    row.token_scores = [TokenScore(-1.0, []) for _ in row.tokens]
    row.prompt_scores = [TokenScore(-1.0, []) for _ in row.prompt_ids[1:]]
    row.finish_reason = oa.FINISH_STOP
    spelling = oa.Spelling(pipe, frozenset(pipe.tokenizer.all_special_ids))
    plain = oa.choice(spelling, oa.Decoded(0, row, 0), echo=False, logprobs=0, stops=())
    assert plain["text"] == "a\ufffdb"
    assert plain["logprobs"]["text_offset"] == [0, 1, 2, 3]  # before: [0, 1, 1, 3]
    echoed = oa.choice(spelling, oa.Decoded(0, row, 0), echo=True, logprobs=0, stops=())
    assert echoed["text"] == "c\ufffda" + "a\ufffdb"
    assert echoed["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5, 6]  # before: [0, 1, 1, 3, 4, 4, 6]
