"""Document features for routing: texts in, one vector per document out.

Three featurizers:

- `lm_prefix_features`: DiPaCo's generative-routing feature. z(doc) is the mean of
  a hidden state of a pretrained causal LM over the first `prefix_tokens` tokens of the
  document (the paper uses 32; those tokens are the routing context), optionally several
  layers concatenated and the first tokens left out (`pool_prefix_states`).
- `encoder_features`: the same pooling over any Hugging Face encoder (hub name or local
  directory, `load_encoder`), for users who have a sentence encoder.
- `tfidf_svd_features`: c-BTM's TF-IDF + truncated SVD (LSA) feature. Needs no model,
  so it is also the cheap baseline.
- `doc_topics_features`: topics found in the whole training documents, read back from the
  routing context: the posterior over T topics of a naive Bayes word model fitted on the
  whole documents (`DocTopics`). Needs no model either, and is the most topical of the
  three on a 32-token prefix (docs/notes/2026-11-23-what-routing-buys.md, "Topics from whole documents").

The fitted text models are kept as plain arrays (vocabulary, idf, SVD components, word
log-probabilities) in `TfidfSvd` and `DocTopics`, not as pickled scikit-learn objects, so a
router artifact stays safetensors + JSON and loads with any scikit-learn version (or none).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from routing.validate import check_finite

# scikit-learn's default token pattern: words of 2+ alphanumeric characters.
DEFAULT_TOKEN_PATTERN = r"(?u)\b\w\w+\b"


# ----------------------------------------------------------------------------------------
# LM prefix features (DiPaCo)


def tokenize_prefixes(tokenizer: Any, texts: Sequence[str], prefix_tokens: int) -> list[list[int]]:
    """Token ids of the first `prefix_tokens` tokens of each text, no special tokens added.

    The tokenizer is only called as `tokenizer(texts, add_special_tokens=False, truncation=True,
    max_length=prefix_tokens)["input_ids"]`, so any callable honouring that (for example one
    handing back ids the caller already has) can stand in for a Hugging Face tokenizer.
    """
    if prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    enc = tokenizer(
        list(texts), add_special_tokens=False, truncation=True, max_length=prefix_tokens
    )
    # Some tokenizers ignore max_length when truncation has no strategy; cut again to be sure.
    return [list(ids)[:prefix_tokens] for ids in enc["input_ids"]]


def pad_right(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: real tokens keep positions 0..len-1, as unbatched."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check_layers(layers: Sequence[int], num_states: int) -> list[int]:
    """`layers` as indices into a model's `hidden_states` tuple (embeddings first, then one entry per
    block; -1 is the last), checked: ValueError names any index outside it."""
    layers = [int(layer) for layer in layers]
    if not layers:
        raise ValueError("layers must name at least one hidden state")
    bad = [layer for layer in layers if not -num_states <= layer < num_states]
    if bad:
        raise ValueError(f"layers {bad} are outside the model's {num_states} hidden states "
                         f"(0 = embeddings, {num_states - 1} or -1 = last)")
    return layers


def prefix_token_weights(mask: torch.Tensor, skip_tokens: int) -> torch.Tensor:
    """(N, T) float weights: each row's real tokens from position `skip_tokens` on.

    The first tokens of a document are mostly formatting and function words (a title's first
    word, "The", a quote mark) that every topic shares; averaging them in pulls every document
    towards the same point. A row with no more than `skip_tokens` tokens keeps its last token.
    """
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens must be >= 0, got {skip_tokens}")
    lengths = mask.sum(dim=1, keepdim=True)
    start = torch.clamp(lengths - 1, max=skip_tokens)
    positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    return (mask.bool() & (positions >= start)).to(torch.float32)


def pool_prefix_states(hidden_states: Sequence[torch.Tensor], mask: torch.Tensor,
                       layers: Sequence[int] = (-1,), skip_tokens: int = 0) -> torch.Tensor:
    """(N, D * len(layers)) float32: the masked mean over the kept tokens of each chosen hidden state,
    concatenated in the order of `layers`. The one pooling rule of every LM featurizer."""
    weights = prefix_token_weights(mask, skip_tokens).unsqueeze(-1)
    pooled = [(hidden_states[layer].float() * weights).sum(dim=1) / weights.sum(dim=1)
              for layer in check_layers(layers, len(hidden_states))]
    return torch.cat(pooled, dim=1)


def lm_prefix_features(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    prefix_tokens: int = 32,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    show_progress: bool = True,
    layers: Sequence[int] = (-1,),
    skip_tokens: int = 0,
) -> torch.Tensor:
    """Mean of the LM's hidden states over each document's first `prefix_tokens` tokens.

    Works with any Hugging Face causal LM: we call it with `output_hidden_states=True` and
    pool `hidden_states[l]` for each l in `layers` (default: the last). For Llama-style models
    in transformers 5.x the last entry is the output of the final norm (transformers overwrites
    it with `last_hidden_state`), i.e. what the LM head sees. Several layers are concatenated;
    `skip_tokens` leaves each document's first tokens out of the mean (see `pool_prefix_states`).

    A document shorter than the prefix uses the tokens it has. Documents with no tokens at
    all raise ValueError listing their indices (decide to skip or fail before calling).
    The model is moved to `device` (in place, as `nn.Module.to` does) and put in eval mode
    for the call; its train/eval flag is restored afterwards. Returns float32 (N, hidden *
    len(layers)) on CPU.
    """
    seqs = tokenize_prefixes(tokenizer, texts, prefix_tokens)
    # Only the hidden states matter; skip the (N, T, vocab) logits when the model allows it.
    extra = {"logits_to_keep": 1} if _accepts(model.forward, "logits_to_keep") else {}
    return pooled_features(model, tokenizer, seqs, batch_size, device, show_progress, layers, skip_tokens,
                           extra, "lm prefix features")


def pooled_features(model: Any, tokenizer: Any, seqs: list[list[int]], batch_size: int,
                    device: str | torch.device, show_progress: bool, layers: Sequence[int], skip_tokens: int,
                    extra: dict[str, Any], desc: str) -> torch.Tensor:
    """`pool_prefix_states` of `model` over token-id sequences, in length-sorted batches."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    empty = [i for i, s in enumerate(seqs) if len(s) == 0]
    if empty:
        raise ValueError(
            f"{len(empty)} document(s) have no tokens, cannot featurize them; indices: {empty[:50]}"
            + (" ..." if len(empty) > 50 else "")
        )
    n = len(seqs)
    if n == 0:
        raise ValueError("no documents to featurize")

    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = 0 if pad_id is None else int(pad_id)  # pads are masked out, any valid id works

    # Longest first: batches hold similar lengths, so little compute goes to padding.
    order = sorted(range(n), key=lambda i: -len(seqs[i]))
    out: torch.Tensor | None = None
    was_training = model.training
    model.to(device)
    model.eval()
    try:
        with torch.inference_mode(), tqdm(total=n, disable=not show_progress, unit="doc", desc=desc) as bar:
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                ids, mask = pad_right([seqs[i] for i in idx], pad_id)
                ids, mask = ids.to(device), mask.to(device)
                states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **extra).hidden_states
                feats = pool_prefix_states(states, mask, layers, skip_tokens)
                if out is None:
                    out = torch.empty(n, feats.shape[1], dtype=torch.float32)
                out[torch.tensor(idx)] = feats.cpu()
                bar.update(len(idx))
    finally:
        model.train(was_training)
    assert out is not None
    check_finite(out, desc)
    return out


# ----------------------------------------------------------------------------------------
# Encoder features (any Hugging Face encoder, by hub name or local directory)


@functools.lru_cache(maxsize=2)
def load_encoder(name_or_dir: str, device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of a Hugging Face encoder: a hub name (downloaded and cached by
    `transformers`) or a local directory holding `config.json`, the weights and the tokenizer.
    Kept in memory (two at most), so routing one text at a time does not reload it."""
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
        model = AutoModel.from_pretrained(name_or_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the encoder {name_or_dir!r} (a hub name or a local directory): {exc}") from None
    return model.to(device).eval(), tokenizer


def encoder_features(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    max_tokens: int = 128,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    show_progress: bool = True,
    layers: Sequence[int] = (-1,),
    skip_tokens: int = 0,
) -> torch.Tensor:
    """Masked mean of an encoder's hidden states over each text's first `max_tokens` encoder tokens.

    The texts are routing contexts already cut to the run's prefix (decoded from its own
    tokenizer), so `max_tokens` only bounds the encoder's sequence. The encoder's special tokens
    ([CLS], [SEP]) are part of its input as it was trained, and of the mean.
    """
    enc = tokenizer(list(texts), add_special_tokens=True, truncation=True, max_length=max_tokens)
    seqs = [list(ids) for ids in enc["input_ids"]]
    return pooled_features(model, tokenizer, seqs, batch_size, device, show_progress, layers, skip_tokens,
                           {}, "encoder features")


# ----------------------------------------------------------------------------------------
# Words: the tokenization every text featurizer shares


def word_counts(texts: Sequence[str], index: dict[str, int], token_pattern: str = DEFAULT_TOKEN_PATTERN,
                lowercase: bool = True):
    """Sparse (N, len(index)) float64 counts of each text's words (scikit-learn's tokenization:
    optional lowercasing, then `token_pattern`); words outside `index` are ignored."""
    from scipy import sparse

    pattern = re.compile(token_pattern)
    indptr: list[int] = [0]
    indices: list[int] = []
    counts: list[int] = []
    for text in texts:
        text = text.lower() if lowercase else text
        c = Counter(index[t] for t in pattern.findall(text) if t in index)
        indices.extend(c.keys())
        counts.extend(c.values())
        indptr.append(len(indices))
    return sparse.csr_matrix(
        (np.asarray(counts, dtype=np.float64), np.asarray(indices, dtype=np.int64), indptr),
        shape=(len(texts), len(index)),
    )


# ----------------------------------------------------------------------------------------
# TF-IDF + SVD features (c-BTM)


@dataclass
class TfidfSvd:
    """A fitted TF-IDF + truncated-SVD transform stored as plain arrays.

    `transform` reproduces scikit-learn's `TfidfVectorizer(sublinear_tf=True)` ->
    `TruncatedSVD` -> row L2 normalisation, using the same tokenization (lowercase,
    regex `token_pattern`); words outside `vocabulary` are ignored, as in scikit-learn.
    """

    kind: ClassVar[str] = "tfidf_svd"
    vocabulary: list[str]  # term of each column, in column order
    idf: np.ndarray  # (V,) float64
    components: np.ndarray  # (n_components, V) float32: SVD right singular vectors
    token_pattern: str = DEFAULT_TOKEN_PATTERN
    lowercase: bool = True
    sublinear_tf: bool = True
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.idf = np.asarray(self.idf, dtype=np.float64)
        self.components = np.asarray(self.components, dtype=np.float32)
        v = len(self.vocabulary)
        if self.idf.shape != (v,) or self.components.ndim != 2 or self.components.shape[1] != v:
            raise ValueError(
                f"inconsistent TF-IDF arrays: vocabulary {v}, idf {self.idf.shape}, "
                f"components {self.components.shape}"
            )
        self._index = {t: i for i, t in enumerate(self.vocabulary)}

    @property
    def dim(self) -> int:
        return int(self.components.shape[0])

    def tfidf(self, texts: Sequence[str]):
        """Sparse (N, V) TF-IDF matrix with L2-normalised rows, as scikit-learn computes it."""
        from scipy import sparse

        x = word_counts(texts, self._index, self.token_pattern, self.lowercase)
        if self.sublinear_tf:
            x.data = 1.0 + np.log(x.data)
        x.data *= self.idf[x.indices]
        norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
        norms[norms == 0] = 1.0  # documents with no known word stay all-zero
        return sparse.diags(1.0 / norms) @ x

    def transform(self, texts: Sequence[str]) -> np.ndarray:
        """(N, n_components) float32 features with unit-norm rows (zero rows stay zero)."""
        z = self.tfidf(texts) @ self.components.astype(np.float64).T
        return _l2_normalize_rows(np.asarray(z)).astype(np.float32)

    def spec(self) -> dict[str, Any]:
        """Featurizer spec for `Router.featurizer`: small, human-readable, no arrays."""
        return {
            "kind": "tfidf_svd",
            "n_components": self.dim,
            "vocab_size": len(self.vocabulary),
            "token_pattern": self.token_pattern,
            "lowercase": self.lowercase,
            "sublinear_tf": self.sublinear_tf,
        }

    # Persistence (see routing.router): JSON-able state + arrays for safetensors.
    def state(self) -> dict[str, Any]:
        return {
            "vocabulary": list(self.vocabulary),
            "token_pattern": self.token_pattern,
            "lowercase": self.lowercase,
            "sublinear_tf": self.sublinear_tf,
        }

    def arrays(self) -> dict[str, np.ndarray]:
        return {"idf": self.idf, "components": self.components}

    @classmethod
    def from_parts(cls, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> TfidfSvd:
        return cls(
            vocabulary=list(state["vocabulary"]),
            idf=np.asarray(arrays["idf"]),
            components=np.asarray(arrays["components"]),
            token_pattern=state.get("token_pattern", DEFAULT_TOKEN_PATTERN),
            lowercase=bool(state.get("lowercase", True)),
            sublinear_tf=bool(state.get("sublinear_tf", True)),
        )


def _l2_normalize_rows(z: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return z / norms


def tfidf_svd_features(
    texts: Sequence[str],
    n_components: int = 128,
    max_features: int = 50000,
    seed: int = 0,
    min_df: int | float = 2,
    max_df: int | float = 0.5,
    stop_words: str | None = "english",
) -> tuple[np.ndarray, TfidfSvd]:
    """Fit TF-IDF (sublinear tf) + TruncatedSVD on `texts`; return unit-norm features and the fit.

    min_df/max_df drop words seen in one document (typos, ids) or in over half of them
    (boilerplate); they shape the vocabulary only, transform does not need them.
    """
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(
        sublinear_tf=True,
        stop_words=stop_words,
        max_features=max_features,
        min_df=min_df,
        max_df=max_df,
        token_pattern=DEFAULT_TOKEN_PATTERN,
        lowercase=True,
        dtype=np.float64,
    )
    x = vec.fit_transform(list(texts))
    if n_components >= x.shape[1]:
        raise ValueError(
            f"n_components={n_components} must be smaller than the vocabulary size {x.shape[1]}"
        )
    svd = TruncatedSVD(n_components=n_components, random_state=seed)
    svd.fit(x)
    fitted = TfidfSvd(
        vocabulary=[str(t) for t in vec.get_feature_names_out()],
        idf=vec.idf_,
        components=svd.components_,
    )
    # Project with the stored (float32) components, so training docs and new docs see
    # the same transform (tests check fitted.transform(texts) matches this).
    z = np.asarray(x @ fitted.components.astype(np.float64).T)
    return _l2_normalize_rows(z).astype(np.float32), fitted


# ----------------------------------------------------------------------------------------
# Topics from whole documents, read from the routing context


@dataclass
class DocTopics:
    """T topics found in whole documents, and a word model that reads them from a few words.

    `transform` gives each text its posterior over the topics under a multinomial naive Bayes
    model, p(t | text) proportional to p(t) * prod_w p(w | t)^count(w), with p(w | t) estimated
    (additive smoothing) from the words of every whole training document of topic t. A text with
    no known word gets the prior. Tokenization is `word_counts`'; words outside `vocabulary`
    are ignored.

    Why a word model and not the context's own TF-IDF vector: 32 tokens hold a handful of content
    words, too few for their TF-IDF vector to land near their topic's documents, but each of those
    words' association with a topic can be learned from whole documents, where the topic is clear.
    Naive Bayes is the classifier that adds such evidence word by word, and it is linear in the
    counts, so it is exact and cheap to store as arrays.
    """

    kind: ClassVar[str] = "doc_topics"
    vocabulary: list[str]  # word of each column, in column order
    log_prior: np.ndarray  # (T,) float64: log fraction of training documents per topic
    log_word_probs: np.ndarray  # (T, V) float64: log p(word | topic)
    token_pattern: str = DEFAULT_TOKEN_PATTERN
    lowercase: bool = True
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.log_prior = np.asarray(self.log_prior, dtype=np.float64)
        self.log_word_probs = np.asarray(self.log_word_probs, dtype=np.float64)
        t, v = self.log_prior.shape[0], len(self.vocabulary)
        if self.log_prior.ndim != 1 or self.log_word_probs.shape != (t, v):
            raise ValueError(f"inconsistent topic arrays: vocabulary {v}, log_prior {self.log_prior.shape}, "
                             f"log_word_probs {self.log_word_probs.shape}")
        self._index = {w: i for i, w in enumerate(self.vocabulary)}

    @property
    def dim(self) -> int:
        return int(self.log_prior.shape[0])

    def log_posterior(self, texts: Sequence[str]) -> np.ndarray:
        """(N, T) float64 log p(topic | words of the text), normalised per row."""
        joint = np.asarray(word_counts(texts, self._index, self.token_pattern, self.lowercase)
                           @ self.log_word_probs.T) + self.log_prior
        peak = joint.max(axis=1, keepdims=True)
        return joint - (peak + np.log(np.exp(joint - peak).sum(axis=1, keepdims=True)))

    def transform(self, texts: Sequence[str]) -> np.ndarray:
        """(N, T) float32 topic posteriors (rows sum to 1): the routing features."""
        return np.exp(self.log_posterior(texts)).astype(np.float32)

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "topics": self.dim, "vocab_size": len(self.vocabulary),
                "token_pattern": self.token_pattern, "lowercase": self.lowercase}

    def state(self) -> dict[str, Any]:
        return {"vocabulary": list(self.vocabulary), "token_pattern": self.token_pattern, "lowercase": self.lowercase}

    def arrays(self) -> dict[str, np.ndarray]:
        return {"log_prior": self.log_prior, "log_word_probs": self.log_word_probs}

    @classmethod
    def from_parts(cls, state: dict[str, Any], arrays: dict[str, np.ndarray]) -> DocTopics:
        return cls(vocabulary=list(state["vocabulary"]), log_prior=np.asarray(arrays["log_prior"]),
                   log_word_probs=np.asarray(arrays["log_word_probs"]),
                   token_pattern=state.get("token_pattern", DEFAULT_TOKEN_PATTERN),
                   lowercase=bool(state.get("lowercase", True)))


def naive_bayes_words(counts, topics: np.ndarray, num_topics: int, smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial naive Bayes from (N, V) word counts and each row's topic: (log prior (T,), log p(word | topic)
    (T, V)), p(w | t) = (count of w in topic t + smoothing) / (words in topic t + smoothing * V)."""
    if smoothing <= 0:
        raise ValueError(f"smoothing must be > 0 (a word unseen in a topic would veto it), got {smoothing}")
    topics = np.asarray(topics, dtype=np.int64)
    docs_per_topic = np.bincount(topics, minlength=num_topics).astype(np.float64)
    if (docs_per_topic == 0).any():
        raise ValueError(f"topics {np.flatnonzero(docs_per_topic == 0).tolist()} hold no document")
    from scipy import sparse

    onehot = sparse.csr_matrix((np.ones(len(topics)), (topics, np.arange(len(topics)))),
                               shape=(num_topics, len(topics)))
    per_topic = np.asarray((onehot @ counts).todense()) + smoothing  # (T, V)
    log_word_probs = np.log(per_topic) - np.log(per_topic.sum(axis=1, keepdims=True))
    return np.log(docs_per_topic / docs_per_topic.sum()), log_word_probs


def doc_topics_features(
    documents: Sequence[str],
    contexts: Sequence[str],
    topics: int,
    *,
    n_components: int = 64,
    smoothing: float = 0.1,
    slack: float | None = 0.1,
    seed: int = 0,
    n_init: int = 2,
    max_iter: int = 100,
    max_features: int = 50000,
) -> tuple[np.ndarray, DocTopics, np.ndarray]:
    """Fit `DocTopics` on whole documents and featurize their routing contexts.

    1. TF-IDF + SVD(`n_components`) of each whole document (`tfidf_svd_features`), cosine k-means into
       `topics` clusters, balanced with `slack` (None: plain k-means) so that no topic is a sliver;
    2. a naive Bayes word model of each topic over the documents' words (`naive_bayes_words`).

    `n_init` clusterings are tried (seeds `seed`, `seed + 1`, ...), and the one kept is the one the
    contexts read best: the most documents whose context's most probable topic is their whole
    document's. Not the lowest k-means inertia: among clusterings of nearly equal inertia, some split
    the corpus along lines a prefix shows and some along lines only the whole text shows, and on the
    benchmark's mixed corpus the lowest-inertia one of three was the least readable (label NMI 0.20
    against 0.28; docs/notes/2026-11-23-what-routing-buys.md). No label is used.

    `contexts[i]` is what routing may see of `documents[i]` (its prefix). Returns the contexts'
    topic posteriors (N, T), the fitted model, and each document's whole-document topic.
    """
    from sklearn.feature_extraction.text import CountVectorizer

    from routing.kmeans import balanced_kmeans, kmeans

    if len(documents) != len(contexts):
        raise ValueError(f"{len(documents)} documents but {len(contexts)} routing contexts")
    if not 2 <= topics <= len(documents):
        raise ValueError(f"topics must be in [2, {len(documents)} documents], got {topics}")
    whole, _ = tfidf_svd_features(documents, n_components=n_components, seed=seed, max_features=max_features)
    x = torch.from_numpy(whole)
    vec = CountVectorizer(stop_words="english", min_df=2, max_df=0.5, max_features=max_features,
                          token_pattern=DEFAULT_TOKEN_PATTERN, lowercase=True, dtype=np.float64)
    counts = vec.fit_transform(list(documents))
    vocabulary = [str(w) for w in vec.get_feature_names_out()]
    best: tuple[float, DocTopics, np.ndarray, np.ndarray] | None = None
    for trial in range(max(1, n_init)):
        if slack is None:
            doc_topic = kmeans(x, topics, metric="cosine", seed=seed + trial, max_iter=max_iter).labels.numpy()
        else:
            doc_topic = balanced_kmeans(x, topics, slack, metric="cosine", seed=seed + trial,
                                        max_iter=max_iter).labels.numpy()
        log_prior, log_word_probs = naive_bayes_words(counts, doc_topic, topics, smoothing)
        model = DocTopics(vocabulary=vocabulary, log_prior=log_prior, log_word_probs=log_word_probs)
        features = model.transform(contexts)
        readable = float(np.mean(features.argmax(axis=1) == doc_topic))
        if best is None or readable > best[0]:
            best = (readable, model, features, doc_topic)
    assert best is not None
    return best[2], best[1], best[3]


# featurizer kind -> the fitted text model a router keeps for it
TEXT_MODELS: dict[str, type[TfidfSvd] | type[DocTopics]] = {"tfidf_svd": TfidfSvd, "doc_topics": DocTopics}
