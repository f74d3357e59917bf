"""tiktoken's engine gives exactly the trained HF byte-level BPE's ids, or is not used."""

import json
import random

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

import dipaco.data.tokenizer as tokenizer_module
from dipaco.data.fast_bpe import byte_level_alphabet, tiktoken_bpe
from dipaco.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    TokenizeOptions,
    batch_encoder,
    tokenize_corpus,
    tokenize_to_disk,
    train_tokenizer,
)

SCRIPTS = [
    "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "éèêàçôüößñ", "абвгдежзийклмнопрстуфхцчшщыэюя",
    "αβγδεζηθικλμνξοπρστυφχψω", "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年", "あいうえおかきくけこさしすせそ",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي", "אבגדהוזחטיכלמנסעפצקרשת", "0123456789", "٠١٢٣٤٥٦٧٨٩", "😀🎉🚀👍🏽",
]
SEPARATORS = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u3000", "", ". ", ", ", "'s ", "'re ",
              "'ll ", " -- ", "!? ", " (", ") ", "\u2028", "   \n"]


def mixed_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_words):
        script = rng.choice(SCRIPTS)
        out.append("".join(rng.choice(script) for _ in range(rng.randint(1, 6))) + rng.choice(SEPARATORS))
    return "".join(out)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = [mixed_text(400, seed) for seed in range(300)]
    return train_tokenizer(corpus, vocab_size=2000, out_dir=tmp_path_factory.mktemp("tok"), show_progress=False)


def hf_ids(tokenizer, texts):
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def test_a_trained_tokenizer_is_encoded_by_tiktoken_with_the_same_ids(tokenizer):
    fast, why = tiktoken_bpe(tokenizer.backend_tokenizer, threads=2)
    assert fast is not None, why
    texts = [mixed_text(300, seed) for seed in range(1000, 1100)]
    texts += ["", " ", "  leading and trailing  ", f"an{EOS_TOKEN}inside{PAD_TOKEN}", "it's they're we'll I'd",
              "x" * 5000, "\n" * 300 + "end", "tab\tand\u00a0nbsp", "mixé 混合 смесь 🎉"]
    got = fast.encode(texts)
    assert all(ids.dtype == np.uint32 for ids in got)
    assert [ids.tolist() for ids in got] == hf_ids(tokenizer, texts)
    assert [ids.tolist() for ids in fast.encode(texts[:3])] == hf_ids(tokenizer, texts[:3])  # fewer texts than threads x 2


def test_every_code_point_is_encoded_the_same(tokenizer):
    """The two regex engines class each character alike: every code point of the planes Unicode
    assigns in (not the private-use ones), next to a letter, itself, a digit, spaces and an apostrophe."""
    fast, why = tiktoken_bpe(tokenizer.backend_tokenizer, threads=2)
    assert fast is not None, why
    points = [*range(0xD800), *range(0xE000, 0xF900), *range(0x10000, 0x40000), *range(0xE0000, 0xE1000)]
    chars = [chr(c) for c in points]
    texts = ["".join(f"a{c}{c}1 {c}'s" for c in chars[i : i + 20_000]) for i in range(0, len(chars), 20_000)]
    assert [ids.tolist() for ids in fast.encode(texts)] == hf_ids(tokenizer, texts)


def test_a_text_that_overflows_tiktokens_regex_gets_hfs_ids(tokenizer):
    fast, _ = tiktoken_bpe(tokenizer.backend_tokenizer, threads=1)
    text = "start" + " " * 1_000_000 + "end"  # tiktoken's regex gives up on this run of spaces
    assert fast.encode([text])[0].tolist() == hf_ids(tokenizer, [text])[0]


def test_batch_encoder_picks_tiktoken_only_where_it_applies(tokenizer, monkeypatch):
    ids_of, engine = batch_encoder(tokenizer, threads=2)
    assert engine.startswith("tiktoken")
    monkeypatch.setattr(tokenizer_module, "tiktoken_bpe", lambda backend, threads: (None, "forced"))
    hf_of, hf_engine = batch_encoder(tokenizer)
    assert hf_engine == "HF tokenizers (tiktoken not used: forced)"
    texts = [mixed_text(50, seed) for seed in range(2000, 2030)]
    assert [a.tolist() for a in ids_of(texts)] == hf_of(texts)


def test_tokenized_columns_are_the_same_on_either_engine(tokenizer, monkeypatch):
    ds = datasets.Dataset.from_dict({"id": [str(i) for i in range(40)],
                                     "text": [mixed_text(80, seed) for seed in range(3000, 3040)]})
    fast = tokenize_corpus(ds, tokenizer)
    monkeypatch.setattr(tokenizer_module, "tiktoken_bpe", lambda backend, threads: (None, "forced"))
    slow = tokenize_corpus(ds, tokenizer)
    assert fast["input_ids"] == slow["input_ids"] and fast["num_tokens"] == slow["num_tokens"]


def test_the_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet["Ġ"] == ord(" ") and alphabet["a"] == ord("a")


def _modified(tokenizer, edit) -> Tokenizer:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    edit(spec)
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("edit, reason", [
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "pre-tokenizer"),
    (lambda s: s["model"].update(dropout=0.1), "dropout"),
    (lambda s: s["added_tokens"][1].update(normalized=True), "not a plain special token"),
    (lambda s: s["model"]["merges"].reverse(), "not after the token of the merge before it"),
    (lambda s: s["model"]["merges"].pop(5), "does not encode to itself"),  # its token is in the vocabulary, unmade
])
def test_tokenizers_tiktoken_would_encode_differently_are_refused(tokenizer, edit, reason):
    fast, why = tiktoken_bpe(_modified(tokenizer, edit), threads=1)
    assert fast is None and reason in why


def test_a_tokenizer_with_a_normalizer_is_refused(tokenizer):
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Lowercase()
    assert tiktoken_bpe(backend, threads=1) == (None, "it has a normalizer")


def test_a_wordpiece_tokenizer_is_refused():
    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    fast, why = tiktoken_bpe(backend, threads=1)
    assert fast is None and "WordPiece" in why


def test_forked_tokenizer_processes_write_the_same_shards(tokenizer, tmp_path):
    ds = datasets.Dataset.from_dict({"id": [str(i) for i in range(60)],
                                     "text": [mixed_text(60, seed) for seed in range(4000, 4060)]})
    lines: list[str] = []
    one = tokenize_to_disk(ds, tokenizer, tmp_path / "one", "train", TokenizeOptions(num_proc=1, shard_docs=25), log=lines.append)
    two = tokenize_to_disk(ds, tokenizer, tmp_path / "two", "train", TokenizeOptions(num_proc=2, shard_docs=25))
    assert lines[0] == "tokenizing train with tiktoken's BPE engine (the same ids as the HF tokenizer)"
    read = [datasets.concatenate_datasets([datasets.Dataset.from_file(str(f)) for f in files]) for files in (one, two)]
    assert len(two) > len(one) == 3  # a file per process and shard
    assert read[0]["input_ids"] == read[1]["input_ids"] == hf_ids(tokenizer, ds["text"])
