"""The doc_topics featurizer: topics of whole documents, read from a few words by naive Bayes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.metrics import normalized_mutual_info_score
from sklearn.naive_bayes import MultinomialNB

from routing.featurize import DocTopics, doc_topics_features, naive_bayes_words, word_counts
from routing.router import Router, fit_router

TOPIC_WORDS = {
    "sport": "match goal team league coach striker season cup referee stadium".split(),
    "money": "bank shares profit market investors economy bonds trader stocks inflation".split(),
    "music": "album band guitar singer concert chart song drummer tour lyrics".split(),
}
FILLER = "the report said that it was a day when people were there and then".split()


def toy_corpus(docs_per_topic: int = 30, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    """(whole documents, routing contexts, topic labels). A context is the document's first 8 words:
    mostly filler, with one or two topic words; the rest of the document is rich in them."""
    rng = np.random.default_rng(seed)
    docs, contexts, labels = [], [], []
    for topic, words in TOPIC_WORDS.items():
        for _ in range(docs_per_topic):
            head = list(rng.choice(FILLER, 6)) + list(rng.choice(words, 2))
            rng.shuffle(head)
            body = [w for _ in range(20) for w in (rng.choice(words), rng.choice(FILLER))]
            docs.append(" ".join(head + body))
            contexts.append(" ".join(head))
            labels.append(topic)
    return docs, contexts, labels


def test_naive_bayes_words_is_sklearns_multinomial_nb():
    docs, _, labels = toy_corpus()
    counts = CountVectorizer().fit_transform(docs).astype(np.float64)
    topics = np.unique(labels, return_inverse=True)[1]
    log_prior, log_word_probs = naive_bayes_words(counts, topics, 3, smoothing=0.1)
    ref = MultinomialNB(alpha=0.1).fit(counts, topics)
    np.testing.assert_allclose(log_prior, ref.class_log_prior_, rtol=1e-12)
    np.testing.assert_allclose(log_word_probs, ref.feature_log_prob_, rtol=1e-12)


def test_posterior_is_sklearns_predict_proba_and_an_unknown_text_gets_the_prior():
    docs, contexts, labels = toy_corpus()
    vec = CountVectorizer(token_pattern=r"(?u)\b\w\w+\b")
    counts = vec.fit_transform(docs).astype(np.float64)
    topics = np.unique(labels, return_inverse=True)[1][: len(docs)]
    topics[:5] = 1  # unequal topic sizes, so the prior is not uniform
    log_prior, log_word_probs = naive_bayes_words(counts, topics, 3, smoothing=0.5)
    model = DocTopics(vocabulary=list(vec.get_feature_names_out()), log_prior=log_prior, log_word_probs=log_word_probs)
    ref = MultinomialNB(alpha=0.5).fit(counts, topics)
    np.testing.assert_allclose(model.transform(contexts), ref.predict_proba(vec.transform(contexts)), atol=1e-6)
    np.testing.assert_allclose(model.transform(["zzz qqq", ""]), np.exp(np.stack([log_prior] * 2)), atol=1e-6)


def test_contexts_are_routed_to_the_topic_of_their_whole_document():
    docs, contexts, labels = toy_corpus()
    features, model, doc_topic = doc_topics_features(docs, contexts, 3, n_components=4, n_init=2)
    assert features.shape == (len(docs), 3) and model.dim == 3
    np.testing.assert_allclose(features.sum(axis=1), 1.0, atol=1e-5)
    assert normalized_mutual_info_score(labels, doc_topic) == pytest.approx(1.0)  # whole documents: clear topics
    routed = features.argmax(axis=1)
    assert normalized_mutual_info_score(labels, routed) > 0.9
    # Filler words appear in every topic alike, so a context of filler only carries no topic.
    filler_only = model.transform([" ".join(FILLER)])[0]
    assert filler_only.max() < 0.6


def test_a_router_keeps_the_word_model_through_save_and_load(tmp_path):
    docs, contexts, _ = toy_corpus()
    features, model, _ = doc_topics_features(docs, contexts, 3, n_components=4)
    router, paths = fit_router(torch.from_numpy(features), [3], text_model=model, metric="cosine", slack=0.1)
    assert router.featurizer == model.spec() and router.featurizer["kind"] == "doc_topics"
    router.save(tmp_path)
    loaded = Router.load(tmp_path)
    assert isinstance(loaded.text_model, DocTopics)
    new = ["the team won the cup", "shares fell as the market", "the band played a song", "nothing here"]
    assert torch.equal(loaded.assign(loaded.featurize(new)), router.assign(router.featurize(new)))
    assert torch.equal(loaded.featurize(contexts), torch.from_numpy(features))


def test_a_router_saved_before_text_model_existed_still_loads_its_tfidf(tmp_path):
    from routing.featurize import tfidf_svd_features

    texts = ["cats and dogs play", "dogs chase cats", "stocks and bonds fall", "bonds and stocks rise"] * 3
    feats, fitted = tfidf_svd_features(texts, n_components=2, min_df=1, max_df=1.0)
    router, _ = fit_router(feats, [2], text_model=fitted, metric="cosine")
    router.save(tmp_path)
    # The earlier layout: the TF-IDF state under "tfidf" and its arrays named "tfidf.*".
    from safetensors.torch import load_file, save_file

    doc = json.loads((tmp_path / "router.json").read_text())
    doc["tfidf"] = {k: v for k, v in doc.pop("text_model").items() if k != "kind"}
    (tmp_path / "router.json").write_text(json.dumps(doc))
    tensors = {k.replace("text_model.", "tfidf."): v for k, v in load_file(str(tmp_path / "router.safetensors")).items()}
    save_file(tensors, str(tmp_path / "router.safetensors"), metadata={"format": "dipaco-router"})
    loaded = Router.load(tmp_path)
    assert torch.equal(loaded.featurize(texts), router.featurize(texts))


def test_bad_inputs_are_named():
    docs, contexts, _ = toy_corpus(docs_per_topic=4)
    with pytest.raises(ValueError, match="2 routing contexts"):
        doc_topics_features(docs, contexts[:2], 3, n_components=4)
    with pytest.raises(ValueError, match="topics must be in"):
        doc_topics_features(docs, contexts, 1, n_components=4)
    with pytest.raises(ValueError, match="smoothing must be > 0"):
        naive_bayes_words(word_counts(docs, {"goal": 0}), np.zeros(len(docs), dtype=int), 1, 0.0)
    with pytest.raises(ValueError, match=r"topics \[1\] hold no document"):
        naive_bayes_words(word_counts(docs, {"goal": 0}), np.zeros(len(docs), dtype=int), 2, 0.1)
    with pytest.raises(ValueError, match="inconsistent topic arrays"):
        DocTopics(vocabulary=["a", "b"], log_prior=np.zeros(2), log_word_probs=np.zeros((2, 3)))


def test_of_several_topic_clusterings_the_one_the_contexts_read_best_is_kept():
    """Four word groups into two topics: k-means may pair them several ways, and the contexts show only some
    groups. Of the clusterings tried (seeds 0, 1, 2), the kept one has the most contexts whose most probable
    topic is their document's."""
    rng = np.random.default_rng(3)
    groups = [TOPIC_WORDS["sport"][:5], TOPIC_WORDS["sport"][5:], TOPIC_WORDS["money"][:5], TOPIC_WORDS["music"][:5]]
    docs, contexts = [], []
    for i in range(80):
        words = groups[i % 4]
        head = list(rng.choice(FILLER, 6)) + list(rng.choice(words, 2 if i % 4 < 2 else 0))
        docs.append(" ".join(head + [w for _ in range(12) for w in (rng.choice(words), rng.choice(groups[(i + 1) % 4]))]))
        contexts.append(" ".join(head))

    def readable(result) -> float:
        features, _, doc_topic = result
        return float(np.mean(features.argmax(axis=1) == doc_topic))

    single = [doc_topics_features(docs, contexts, 2, n_components=3, seed=s, n_init=1) for s in range(3)]
    kept = doc_topics_features(docs, contexts, 2, n_components=3, seed=0, n_init=3)
    scores = [readable(r) for r in single]
    best = single[int(np.argmax(scores))]
    assert int(np.argmax(scores)) != 0  # the corpus is built so that the first clustering is not the best
    assert readable(kept) == max(scores)
    np.testing.assert_array_equal(kept[2], best[2])
    np.testing.assert_array_equal(kept[0], best[0])
