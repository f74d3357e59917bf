"""Featurizers: LM prefix means (checked against an unbatched reference) and TF-IDF + SVD."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from routing_testutil import WORDS

from routing.featurize import (
    encoder_features,
    lm_prefix_features,
    load_encoder,
    prefix_token_weights,
    tfidf_svd_features,
)

DOCS = [
    "the cat sat on a mat",
    "dog",  # shorter than the prefix: uses the one token it has
    "the dog ran in the park the sun the moon the star the river",
    "red blue green red blue green red blue green",
    "music song dance food bread milk water fire stone house car road city",
    "a cat",
]


def reference_features(model, tokenizer, texts, prefix):
    """One document at a time, no padding: mean of hidden_states[-1] over the first tokens."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"][:prefix]
            h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
            out.append(h[0].mean(dim=0))
    return torch.stack(out)


@pytest.mark.parametrize("prefix,batch_size", [(4, 1), (4, 3), (8, 32), (32, 2)])
def test_lm_prefix_matches_unbatched_reference(tiny_llama, tiny_tokenizer, prefix, batch_size):
    ref = reference_features(tiny_llama, tiny_tokenizer, DOCS, prefix)
    got = lm_prefix_features(tiny_llama, tiny_tokenizer, DOCS, prefix_tokens=prefix,
                             batch_size=batch_size, show_progress=False)
    assert got.shape == (len(DOCS), 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_lm_prefix_is_last_norm_output_and_restores_train_mode(tiny_llama, tiny_tokenizer):
    # hidden_states[-1] is the final-norm output in transformers 5.x (what the LM head sees).
    ids = torch.tensor([tiny_tokenizer("the cat sat", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = tiny_llama(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(out.hidden_states[-1], tiny_llama.model(input_ids=ids).last_hidden_state)
    tiny_llama.train()
    try:
        lm_prefix_features(tiny_llama, tiny_tokenizer, ["the cat"], show_progress=False)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()


def test_empty_documents_are_refused_with_their_indices(tiny_llama, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"2 document\(s\).*\[1, 3\]"):
        lm_prefix_features(tiny_llama, tiny_tokenizer, ["the cat", "", "dog", "   "], show_progress=False)


CORPUS = [
    "The cat sat on the mat while another cat watched the mat.",
    "Dogs run in the park; the park has dogs and trees.",
    "Stock markets fell as investors sold stocks and bonds.",
    "The central bank raised rates; markets and bonds reacted.",
    "A new vaccine trial showed the vaccine reduced infections.",
    "Doctors reported infections fell after the vaccine trial.",
    "The team won the match after a late goal in the match.",
    "Fans cheered the team and the goal at the stadium.",
] * 3


def test_tfidf_svd_matches_sklearn_pipeline():
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    feats, fitted = tfidf_svd_features(CORPUS, n_components=5, seed=0, min_df=1, max_df=1.0)
    assert feats.shape == (len(CORPUS), 5) and feats.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, atol=1e-5)

    vec = TfidfVectorizer(sublinear_tf=True, stop_words="english", min_df=1, max_df=1.0, max_features=50000)
    svd = TruncatedSVD(5, random_state=0)
    x = vec.fit_transform(CORPUS)
    svd.fit(x)
    new = ["Cats and dogs in the park!", "bonds, stocks & the bank", "zzz unknown words only"]
    expected = normalize(svd.transform(vec.transform(new)))
    np.testing.assert_allclose(fitted.transform(new), expected, atol=1e-5)
    np.testing.assert_allclose(fitted.transform(CORPUS), feats, atol=1e-6)
    assert np.all(fitted.transform(["zzz qqq"]) == 0)  # no known word: all-zero feature
    assert fitted.spec()["kind"] == "tfidf_svd"


def test_tfidf_too_many_components():
    with pytest.raises(ValueError, match="n_components"):
        tfidf_svd_features(CORPUS, n_components=500, min_df=1, max_df=1.0)


def test_non_finite_features_are_refused(tiny_llama, tiny_tokenizer):
    import copy

    broken = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        broken.model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match=r"3 row\(s\) contain NaN or inf; first indices: \[0, 1, 2\]"):
        lm_prefix_features(broken, tiny_tokenizer, ["the cat", "dog", "red sun"], show_progress=False)


def reference_pooled(model, tokenizer, texts, prefix, layers, skip):
    """One document at a time: mean of each chosen hidden state over its tokens from `skip` on
    (the last token when it has no more), layers concatenated."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"][:prefix]
            states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            start = min(skip, len(ids) - 1)
            out.append(torch.cat([states[layer][0, start:].mean(dim=0) for layer in layers]))
    return torch.stack(out)


@pytest.mark.parametrize("layers,skip", [([0], 0), ([1, -1], 0), ([-1], 3), ([0, 1], 2)])
def test_lm_prefix_layers_and_skipped_tokens_match_reference(tiny_llama, tiny_tokenizer, layers, skip):
    ref = reference_pooled(tiny_llama, tiny_tokenizer, DOCS, 8, layers, skip)
    got = lm_prefix_features(tiny_llama, tiny_tokenizer, DOCS, prefix_tokens=8, batch_size=4,
                             show_progress=False, layers=layers, skip_tokens=skip)
    assert got.shape == (len(DOCS), 32 * len(layers))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_prefix_token_weights_keep_the_last_token_of_short_rows():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert prefix_token_weights(mask, 2).tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert torch.equal(prefix_token_weights(mask, 0), mask.float())
    with pytest.raises(ValueError, match="skip_tokens must be >= 0"):
        prefix_token_weights(mask, -1)


def test_layers_outside_the_model_are_refused(tiny_llama, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"layers \[5\] are outside the model's 2 hidden states"):
        lm_prefix_features(tiny_llama, tiny_tokenizer, DOCS, layers=[0, 5], show_progress=False)


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory):
    """A randomly initialised 1-layer BERT and a word-piece tokenizer, saved as a local directory."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    d = tmp_path_factory.mktemp("encoder")
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(d / "vocab.txt")).save_pretrained(d)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=5 + len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(d)
    return d


def test_encoder_features_from_a_local_directory_match_unbatched_means(tiny_encoder_dir):
    model, tokenizer = load_encoder(str(tiny_encoder_dir))
    got = encoder_features(model, tokenizer, DOCS, max_tokens=10, batch_size=4, show_progress=False, layers=[-1, 0])
    assert got.shape == (len(DOCS), 32)
    with torch.no_grad():
        for row, text in zip(got, DOCS):
            ids = tokenizer(text, truncation=True, max_length=10)["input_ids"]  # [CLS] ... [SEP]
            states = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            torch.testing.assert_close(row, torch.cat([states[-1][0].mean(0), states[0][0].mean(0)]),
                                       atol=1e-5, rtol=1e-4)


def test_router_featurizes_with_its_recorded_encoder(tiny_encoder_dir):
    from routing.router import fit_router

    spec = {"kind": "encoder", "model": str(tiny_encoder_dir), "max_tokens": 10, "layers": [-1], "skip_tokens": 1}
    model, tokenizer = load_encoder(str(tiny_encoder_dir))
    x = encoder_features(model, tokenizer, DOCS, max_tokens=10, show_progress=False, skip_tokens=1)
    router, _ = fit_router(x, [2], featurizer=spec, seed=0, n_init=1)
    torch.testing.assert_close(router.featurize(DOCS, show_progress=False), x)


def test_unknown_encoder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load the encoder"):
        load_encoder(str(tmp_path / "nowhere"))
