"""Very long documents are tokenized in bounded pieces, with exactly the tokens of the whole text."""

import random

import datasets
import pytest

import dipaco.data.tokenizer as tokenizer_module
from dipaco.data.tokenizer import text_pieces, tokenize_corpus, train_tokenizer


def long_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh,.'") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    seps = [" ", " ", "  ", "\n", " \n ", "\t", ". ", ""]
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n_words))


def test_pieces_join_back_and_are_bounded():
    text = long_text(20000)
    pieces = list(text_pieces(text, 1000))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 1000 and len(pieces) > len(text) // 1000
    assert list(text_pieces("x" * 2500, 1000)) == ["x" * 1000, "x" * 1000, "x" * 500]  # no space: a hard cut
    assert list(text_pieces("short", 1000)) == ["short"]


@pytest.mark.parametrize("engine", ["tiktoken", "hf"])
def test_long_documents_are_encoded_in_pieces_with_the_same_tokens(tmp_path, monkeypatch, engine):
    text = long_text(40000)
    tok = train_tokenizer([text[:50000]], 600, tmp_path / "tok", show_progress=False)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(tokenizer_module, "MAX_PIECE_CHARS", 5000)
    if engine == "hf":
        monkeypatch.setattr(tokenizer_module, "tiktoken_bpe", lambda backend, threads: (None, "forced"))
    seen, engines = [], []
    real_batch_encoder = tokenizer_module.batch_encoder

    def spied(tokenizer, threads=1):
        encode, name = real_batch_encoder(tokenizer, threads)
        engines.append(name)

        def spy(texts):
            seen.extend(texts)
            return encode(texts)
        return spy, name

    monkeypatch.setattr(tokenizer_module, "batch_encoder", spied)
    ds = datasets.Dataset.from_dict({"id": ["long", "short"], "text": [text, "a short one"]})
    out = tokenize_corpus(ds, tok)
    assert engines and all(name.startswith("tiktoken" if engine == "tiktoken" else "HF") for name in engines)
    assert out["input_ids"][0] == whole and out["num_tokens"][0] == len(whole)
    assert out["input_ids"][1] == tok("a short one", add_special_tokens=False)["input_ids"]
    assert seen and max(len(t) for t in seen) <= 5000  # the tokenizer never saw the whole long text


def test_training_on_pieces_learns_the_same_vocabulary(tmp_path, monkeypatch):
    text = long_text(30000, seed=3)
    whole = train_tokenizer([text], 700, tmp_path / "a", show_progress=False)
    monkeypatch.setattr(tokenizer_module, "MAX_PIECE_CHARS", 4000)
    pieced = train_tokenizer([text], 700, tmp_path / "b", show_progress=False)
    assert pieced.get_vocab() == whole.get_vocab()
