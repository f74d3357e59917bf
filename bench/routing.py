"""Benchmarks of the routing package: k-means, routing quality and featurizers (no trainer needed).

1. kmeans:  our torch k-means vs scikit-learn KMeans on the same features, same k and n_init,
            run alternately in one process: wall time (best and median of --repeats) and inertia.
            Features: TF-IDF+SVD of 20 Newsgroups (k=20) and synthetic blobs (N=50k, d=64, k=16).
2. 20ng:    routing quality on 20 Newsgroups: fit the router on the train split, NMI/ARI/purity
            against the newsgroup labels on train (the fitted shards) and test (nearest centroid),
            for the TF-IDF+SVD router unbalanced and balanced (--slack), over --seeds.
3. lm:      with --lm-model DIR, the LM-prefix featurizer on the same documents: its NMI, its docs/s,
            and the plain forward-pass docs/s of the same model on the same inputs.
4. featurizers: with --lm-model DIR (a run's pretrain/, --lm-tokenizer its tokenizer/), NMI and purity
            of balanced k-means (k = --featurizer-k) on the three shared corpora (20NG, BBC, and the
            quality benchmark's mix of all three) at --prefix-tokens, for every featurizer variant:
            the raw last-layer mean (today's default), centring / PCA / whitening + L2, the layer(s)
            pooled, skipped first tokens, TF-IDF over the prefix, TF-IDF + LM, and --encoder NAME.
5. context: with --lm-tokenizer DIR, the NMI of TF-IDF routing against the routing context's length
            (--context-tokens, 0 = the whole document) on the same corpora: how much topic a prefix holds.
6. doc_topics: with --lm-tokenizer DIR, routing on the first --prefix-tokens tokens as `dipaco route`
            does, fitted on 90% of each corpus and scored on the fitted shards and on the held-out 10%
            (routed one by one): TF-IDF + SVD of the prefix, whole-document topics routed by nearest
            centroid of the prefix's projection (c-BTM's rule), and the doc_topics featurizer.

    python -m bench routing                       # sections 1 and 2
    python -m bench routing --sections 20ng --lm-model runs/demo/pretrain --out bench.json
    python -m bench routing --sections featurizers --lm-model RUN/pretrain --lm-tokenizer RUN/tokenizer
    python -m bench routing --sections context --lm-tokenizer RUN/tokenizer --corpora bbc,mix
    python -m bench routing --sections doc_topics --lm-tokenizer RUN/tokenizer --seeds 0,1,2

Every section prints markdown tables; ``--out`` writes the figures as JSON (``args`` with paths relative to the
checkout, the machine as ``environment`` (:func:`bench.harness.environment`), the command, each section's rows).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from bench.harness import REPO, Column, argument_parser, command_line, environment, markdown_table, write_json
from routing.featurize import (
    doc_topics_features,
    encoder_features,
    lm_prefix_features,
    load_encoder,
    pad_right,
    tfidf_svd_features,
    tokenize_prefixes,
)
from routing.kmeans import Metric, kmeans
from routing.quality import routing_report
from routing.router import fit_router
from routing.transform import FeatureTransform

SUMMARY_COLS = ["router", "slack", "seeds", "mean_train_nmi", "min_train_nmi", "max_train_nmi",
                "mean_test_nmi", "min_test_nmi", "max_test_nmi"]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "20news_bydate.jsonl.gz"


# ----------------------------------------------------------------------------------------
# Data


def strip_headers(text: str, keep_subject: bool = False) -> str:
    """Drop the Usenet header block (everything before the first blank line)."""
    head, sep, body = text.partition("\n\n")
    if not sep:
        return text
    if keep_subject:
        subject = [line for line in head.split("\n") if line.lower().startswith("subject:")]
        return "\n".join(subject + [body])
    return body


def read_docs(path: Path) -> Iterator[dict[str, Any]]:
    """The documents of a shared corpus file (gzipped JSON lines)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        yield from map(json.loads, f)


def load_20ng(path: Path, keep_subject: bool = False) -> dict[str, dict[str, list]]:
    """{"train"/"test": {"text": [...], "label": [...]}}, headers stripped, empty bodies dropped."""
    splits: dict[str, dict[str, list]] = {"train": {"text": [], "label": []}, "test": {"text": [], "label": []}}
    for doc in read_docs(path):
        text = strip_headers(doc["text"], keep_subject)
        if text.strip():
            splits[doc["split"]]["text"].append(text)
            splits[doc["split"]]["label"].append(doc["label"])
    return splits


def blobs(n: int, d: int, k: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    centers = g.normal(scale=4.0, size=(k, d))
    return (centers[g.integers(k, size=n)] + g.normal(size=(n, d))).astype(np.float32)


# ----------------------------------------------------------------------------------------
# Helpers


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """The rows as the harness's markdown table, one column per key; a float to 4 significant digits (what a table
    of NMIs and seconds needs)."""
    def figure(key: str) -> Column:
        return key, lambda row: f"{row[key]:.4g}" if isinstance(row.get(key), float) else row.get(key)

    return markdown_table(rows, [figure(c) for c in cols])


# ----------------------------------------------------------------------------------------
# 1. k-means vs scikit-learn


def bench_kmeans(name: str, x: np.ndarray, k: int, n_init: int, repeats: int, seed: int) -> dict[str, Any]:
    from sklearn.cluster import KMeans

    x = np.ascontiguousarray(x, dtype=np.float32)
    sk_runs, our_runs = [], []  # (seconds, inertia, iterations) of each repeat
    for r in range(repeats):  # alternate, so background load hits both alike
        sk, t = timed(lambda: KMeans(k, n_init=n_init, random_state=seed + r).fit(x))
        sk_runs.append((t, float(sk.inertia_), int(sk.n_iter_)))
        ours, t = timed(lambda: kmeans(x, k, n_init=n_init, seed=seed + r))
        our_runs.append((t, ours.inertia, ours.n_iter))
    (sk_t, sk_i, sk_it), (ours_t, ours_i, ours_it) = zip(*sk_runs), zip(*our_runs)
    return {
        "features": name, "N": x.shape[0], "D": x.shape[1], "k": k, "n_init": n_init,
        "sklearn_s": min(sk_t), "ours_s": min(ours_t),
        "sklearn_median_s": statistics.median(sk_t), "ours_median_s": statistics.median(ours_t),
        "time_ratio": min(ours_t) / min(sk_t),
        "sklearn_inertia": statistics.mean(sk_i), "ours_inertia": statistics.mean(ours_i),
        "inertia_ratio": statistics.mean(ours_i) / statistics.mean(sk_i),
        "sklearn_iter": statistics.mean(sk_it), "ours_iter": statistics.mean(ours_it),
    }


# ----------------------------------------------------------------------------------------
# 2. Routing quality on 20 Newsgroups


def route_and_score(name: str, x: tuple[Any, Any], labels: tuple[list, list], args: argparse.Namespace,
                    slack: float | None, seed: int, metric: Metric = "euclidean") -> dict[str, Any]:
    """A router fitted on the train split's features ``x[0]``: NMI and balance of its fitted shards, and the NMI of
    the test split ``x[1]`` routed to the nearest centroid, against the (train, test) ``labels``."""
    (router, train_paths), seconds = timed(
        lambda: fit_router(x[0], [args.k], slack=slack, seed=seed, n_init=args.n_init, metric=metric))
    train = routing_report(train_paths, args.k, labels=labels[0])
    test = routing_report(router.assign(x[1]), args.k, labels=labels[1])
    return {
        "router": name, "slack": slack, "seed": seed, "fit_s": seconds,
        "train_nmi": train["nmi"], "test_nmi": test["nmi"], "train_ari": train["ari"],
        "train_purity": train["purity"], "train_max_min": train["docs_max_min_ratio"],
        "train_max_docs": max(train["docs_per_path"]), "train_empty": train["num_empty_paths"],
    }


def summarize(rows: list[dict[str, Any]], keys: tuple[str, ...] = ("train_nmi", "test_nmi")) -> list[dict[str, Any]]:
    """Mean (and min/max) over seeds per (router, slack)."""
    out = []
    for router, slack in dict.fromkeys((r["router"], r["slack"]) for r in rows):
        group = [r for r in rows if (r["router"], r["slack"]) == (router, slack)]
        row: dict[str, Any] = {"router": router, "slack": slack, "seeds": len(group)}
        for key in keys:
            vals = [r[key] for r in group]
            row |= {f"mean_{key}": statistics.mean(vals), f"min_{key}": min(vals), f"max_{key}": max(vals)}
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------
# 3. LM-prefix featurizer


def load_tokenizer(path: str) -> Any:
    """A saved tokenizer (a run's tokenizer/ directory), never one fetched from the hub."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_lm(model_dir: str, tokenizer_dir: str | None, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    return model, tokenizer


def forward_rate(model, tokenizer, texts: list[str], prefix: int, batch_size: int, device: str) -> float:
    """docs/s of a plain forward pass (logits, no hidden states) on the featurizer's batches."""
    seqs = tokenize_prefixes(tokenizer, texts, prefix)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    batches = [pad_right([seqs[i] for i in order[s : s + batch_size]], 0)
               for s in range(0, len(order), batch_size)]
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            model(input_ids=ids.to(device), attention_mask=mask.to(device))
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return len(texts) / (time.perf_counter() - start)


def bench_lm(args: argparse.Namespace, data: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Section 3: the LM-prefix featurizer's NMI and speed against the model's plain forward pass."""
    model, tokenizer = load_lm(args.lm_model, args.lm_tokenizer, args.device)
    texts = {s: data[s]["text"][: args.lm_max_docs] for s in ("train", "test")}
    labels = {s: data[s]["label"][: args.lm_max_docs] for s in ("train", "test")}
    feats, rates = {}, {}
    for split in ("train", "test"):
        keep = [i for i, s in enumerate(tokenize_prefixes(tokenizer, texts[split], args.prefix_tokens)) if s]
        texts[split] = [texts[split][i] for i in keep]
        labels[split] = [labels[split][i] for i in keep]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        feats[split], seconds = timed(lambda: lm_prefix_features(
            model, tokenizer, texts[split], prefix_tokens=args.prefix_tokens,
            batch_size=args.lm_batch_size, device=args.device, show_progress=False))
        rates[split] = len(texts[split]) / seconds
    fwd = forward_rate(model, tokenizer, texts["train"], args.prefix_tokens, args.lm_batch_size, args.device)
    _, tokenize_s = timed(lambda: tokenize_prefixes(tokenizer, texts["train"], args.prefix_tokens))
    scored = (route_and_score(f"lm_prefix/{metric}", (feats["train"], feats["test"]), (labels["train"], labels["test"]),
                              args, slack, seed, metric)
              for seed in args.seeds for slack in (None, args.slack) for metric in ("euclidean", "cosine"))
    rows = [{key: row[key] for key in ("router", "slack", "seed", "fit_s", "train_nmi", "test_nmi")} for row in scored]
    lm = {
        "model": relative(args.lm_model), "device": args.device, "prefix_tokens": args.prefix_tokens,
        "batch_size": args.lm_batch_size, "docs": {s: len(texts[s]) for s in texts},
        "hidden": int(feats["train"].shape[1]),
        "featurizer_docs_per_s": rates["train"], "forward_docs_per_s": fwd,
        "featurizer_fraction_of_forward": rates["train"] / fwd,
        "tokenize_docs_per_s": len(texts["train"]) / tokenize_s,  # part of the featurizer's time
        "rows": rows, "summary": summarize(rows),
    }
    print(f"\n## LM-prefix featurizer ({lm['model']}, {lm['device']}, {lm['docs']} docs, hidden {lm['hidden']})")
    print(f"featurizer {lm['featurizer_docs_per_s']:.1f} docs/s, plain forward {lm['forward_docs_per_s']:.1f} "
          f"docs/s, fraction {lm['featurizer_fraction_of_forward']:.2f} "
          f"(tokenizing alone: {lm['tokenize_docs_per_s']:.1f} docs/s)")
    print(table(lm["rows"], ["router", "slack", "seed", "train_nmi", "test_nmi", "fit_s"]))
    print("\n" + table(lm["summary"], SUMMARY_COLS))
    return lm

# ----------------------------------------------------------------------------------------
# 4. Featurizer variants on the three shared corpora


def load_shared(shared: Path, name: str, max_docs: int | None) -> dict[str, list]:
    """{"text", "label"} of one shared corpus; "mix" is the quality benchmark's corpus (all three,
    labels prefixed by source, 20NG headers stripped). Every ``len // max_docs``-th document is
    kept, so a slice still holds every label."""
    files = {"20ng": ["20news_bydate.jsonl.gz"], "bbc": ["bbc_news.jsonl.gz"],
             "mix": ["20news_bydate.jsonl.gz", "bbc_news.jsonl.gz", "brown_genres.jsonl.gz"]}[name]
    docs: dict[str, list] = {"text": [], "label": []}
    for doc in (d for file in files for d in read_docs(shared / file)):
        text = strip_headers(doc["text"]) if doc["source"].startswith("20news") else doc["text"]
        if text.strip():
            docs["text"].append(text)
            docs["label"].append(f"{doc['source']}:{doc['label']}" if name == "mix" else doc["label"])
    if max_docs and len(docs["text"]) > max_docs:
        step = len(docs["text"]) / max_docs
        keep = [int(i * step) for i in range(max_docs)]
        docs = {k: [v[i] for i in keep] for k, v in docs.items()}
    return docs


# name -> (hidden states pooled, first tokens skipped, transform, principal axes kept, k-means metric).
# "L" is the last state (after the final norm), "M" the middle block's output, "A" every block's output
# concatenated.
LM_VARIANTS: dict[str, tuple[str, int, str | None, int | None, Metric]] = {
    "lm raw last (default)": ("L", 0, None, None, "euclidean"),
    "lm raw last, cosine": ("L", 0, None, None, "cosine"),
    "lm last, center+l2": ("L", 0, "center_l2", None, "cosine"),
    "lm last, whiten+l2": ("L", 0, "whiten_l2", None, "cosine"),
    "lm last, whiten top 16+l2": ("L", 0, "whiten_l2", 16, "cosine"),
    "lm last, pca top 16+l2": ("L", 0, "pca_l2", 16, "cosine"),
    "lm middle, cosine": ("M", 0, None, None, "cosine"),
    "lm all layers, pca+l2": ("A", 0, "pca_l2", None, "cosine"),
    "lm all layers, whiten+l2": ("A", 0, "whiten_l2", None, "cosine"),
    "lm last, skip 4, cosine": ("L", 4, None, None, "cosine"),
}


def _layer_slice(which: str, num_states: int, width: int) -> slice:
    """Columns of the all-states feature block (states 0..num_states-1 concatenated) for a variant."""
    if which == "L":
        return slice((num_states - 1) * width, num_states * width)
    if which == "M":
        mid = num_states // 2
        return slice(mid * width, (mid + 1) * width)
    return slice(width, num_states * width)  # every block's output, not the embeddings


def anisotropy(x: torch.Tensor, labels: list, seed: int = 0, pairs: int = 20000) -> dict[str, float]:
    """Why raw features cluster badly: how much all documents point one way (mean cosine of random
    pairs, the common mean's share of the squared norm), how much variance the top principal axes
    hold, and how much of the variance the labels explain (between-label over total, per axis summed)."""
    g = torch.Generator().manual_seed(seed)
    i, j = torch.randint(len(x), (2, pairs), generator=g)
    unit = torch.nn.functional.normalize(x.double(), dim=1)
    centred = x.double() - x.double().mean(dim=0)
    eigen = torch.linalg.svdvals(centred) ** 2
    y = np.asarray(labels)
    between = sum(((centred[torch.from_numpy(y == lab)].mean(dim=0)) ** 2).sum() * (y == lab).sum()
                  for lab in np.unique(y))
    return {"mean_pair_cosine": float((unit[i] * unit[j]).sum(dim=1).mean()),
            "mean_share_of_sq_norm": float((x.double().mean(dim=0) ** 2).sum() / (x.double() ** 2).sum(dim=1).mean()),
            "top1_variance": float(eigen[0] / eigen.sum()), "top5_variance": float(eigen[:5].sum() / eigen.sum()),
            "label_variance": float(between / (centred**2).sum())}


def score_variant(name: str, x: torch.Tensor, labels: list, args: argparse.Namespace, transform: str | None = None,
                  metric: Metric = "cosine", components: int | None = None) -> dict[str, Any]:
    """Balanced k-means (k = --featurizer-k, --slack) on ``x``: NMI and purity against the labels over --seeds."""
    nmi, purity, ratio = [], [], []
    fitted = FeatureTransform.fit(x, transform, components) if transform else None
    for seed in args.seeds:
        _, paths = fit_router(x, [args.featurizer_k], slack=args.slack, seed=seed, n_init=args.n_init, metric=metric,
                              transform=fitted)
        report = routing_report(paths, args.featurizer_k, labels=labels)
        nmi.append(report["nmi"])
        purity.append(report["purity"])
        ratio.append(report["docs_max_min_ratio"])
    return {"featurizer": name, "nmi": statistics.mean(nmi), "min_nmi": min(nmi), "purity": statistics.mean(purity),
            "max_min_docs": max(r if r is not None else float("inf") for r in ratio), "dim": int(x.shape[1])}


def bench_featurizers(args: argparse.Namespace) -> dict[str, Any]:
    """Section 4: every LM featurizer variant, TF-IDF over the prefix and --encoder, on each shared corpus."""
    model, tokenizer = load_lm(args.lm_model, args.lm_tokenizer, args.device)
    encoder = load_encoder(args.encoder, args.device) if args.encoder else None
    num_states, width = model.config.num_hidden_layers + 1, model.config.hidden_size
    out: dict[str, Any] = {"model": relative(args.lm_model), "prefix_tokens": args.prefix_tokens, "k": args.featurizer_k,
                           "slack": args.slack, "seeds": args.seeds, "corpora": {}}
    for corpus in args.corpora.split(","):
        docs = load_shared(args.shared_data, corpus, args.featurizer_max_docs)
        seqs = tokenize_prefixes(tokenizer, docs["text"], args.prefix_tokens)
        keep = [i for i, s in enumerate(seqs) if s]
        texts = [docs["text"][i] for i in keep]
        labels = [docs["label"][i] for i in keep]
        contexts = tokenizer.batch_decode([seqs[i] for i in keep])  # all any featurizer may see
        pooled = {skip: lm_prefix_features(model, tokenizer, texts, prefix_tokens=args.prefix_tokens,
                                           batch_size=args.lm_batch_size, device=args.device, show_progress=False,
                                           layers=list(range(num_states)), skip_tokens=skip) for skip in (0, 4)}
        diagnostics = {which: anisotropy(pooled[0][:, _layer_slice(which, num_states, width)], labels)
                       for which in ("L", "M", "A")}
        print(f"\n{corpus}: raw features, last (L) / middle (M) / all blocks (A):")
        print(table([{"states": k, **v} for k, v in diagnostics.items()],
                    ["states", "mean_pair_cosine", "mean_share_of_sq_norm", "top1_variance", "top5_variance",
                     "label_variance"]))
        rows = []
        for name, (which, skip, transform, components, metric) in LM_VARIANTS.items():
            x = pooled[skip][:, _layer_slice(which, num_states, width)]
            rows.append(score_variant(name, x, labels, args, transform, metric, components))
        # TF-IDF + SVD over the same prefix text (`dipaco route`'s tfidf_svd featurizer reads the same contexts).
        tfidf = {}
        for n in args.tfidf_components:
            tfidf[n] = torch.from_numpy(tfidf_svd_features(contexts, n_components=n, seed=args.seeds[0])[0])
            rows.append(score_variant(f"tfidf prefix, svd {n}", tfidf[n], labels, args))
        last = pooled[0][:, _layer_slice("L", num_states, width)]
        lm = F.normalize(last - last.mean(dim=0), dim=1)
        n = args.tfidf_components[len(args.tfidf_components) // 2]
        both = torch.cat([lm, tfidf[n]], dim=1)  # two unit blocks: equal weight in cosine
        rows.append(score_variant(f"tfidf prefix svd {n} + lm last center+l2", both, labels, args))
        if encoder is not None:
            x = encoder_features(*encoder, contexts, batch_size=args.lm_batch_size, device=args.device,
                                 show_progress=False)
            for transform in (None, "whiten_l2"):
                rows.append(score_variant(f"encoder {args.encoder}{', whiten+l2' if transform else ''}", x, labels, args,
                                          transform))
        out["corpora"][corpus] = {"docs": len(texts), "labels": len(set(labels)), "rows": rows,
                                  "raw_diagnostics": diagnostics}
        print(f"\n## {corpus}: {len(texts)} docs, {len(set(labels))} labels, k={args.featurizer_k}, "
              f"balanced (slack {args.slack}), prefix {args.prefix_tokens} tokens, seeds {args.seeds}")
        print(table(rows, ["featurizer", "dim", "nmi", "min_nmi", "purity", "max_min_docs"]))
    return out


# ----------------------------------------------------------------------------------------
# 5. How much topic the routing context holds: TF-IDF NMI against the context length


def bench_context(args: argparse.Namespace) -> dict[str, Any]:
    """Balanced k-means NMI of TF-IDF + SVD over each document's first N tokens, N in --context-tokens
    (0 = the whole document), on the shared corpora. Bag-of-words over the whole document is the most
    topical signal a featurizer without outside knowledge can use, so its NMI is a practical ceiling for
    a prefix featurizer of the same kind, and the curve shows what the routing context costs."""
    tokenizer = load_tokenizer(args.lm_tokenizer)
    n = args.tfidf_components[len(args.tfidf_components) // 2]
    out: dict[str, Any] = {"tokenizer": relative(args.lm_tokenizer), "k": args.featurizer_k, "svd": n, "slack": args.slack,
                           "seeds": args.seeds, "corpora": {}}
    for corpus in args.corpora.split(","):
        docs = load_shared(args.shared_data, corpus, args.featurizer_max_docs)
        ids = tokenizer(docs["text"], add_special_tokens=False)["input_ids"]
        rows = []
        for length in args.context_tokens:
            contexts = tokenizer.batch_decode([i[:length] if length else i for i in ids])
            x = torch.from_numpy(tfidf_svd_features(contexts, n_components=n, seed=args.seeds[0])[0])
            name = f"tfidf, first {length} tokens" if length else "tfidf, whole document"
            rows.append({"context_tokens": length or None, **score_variant(name, x, docs["label"], args)})
        out["corpora"][corpus] = {"docs": len(ids), "labels": len(set(docs["label"])), "rows": rows}
        print(f"\n## {corpus}: {len(ids)} docs, {len(set(docs['label']))} labels, k={args.featurizer_k}, balanced "
              f"(slack {args.slack}), TF-IDF + SVD {n}, cosine k-means, seeds {args.seeds}")
        print(table(rows, ["featurizer", "nmi", "min_nmi", "purity", "max_min_docs"]))
    return out


# ----------------------------------------------------------------------------------------
# 6. Topics from whole documents, routed from the prefix


def held_out(n: int, fraction: float = 0.1, seed: int = 0) -> np.ndarray:
    """Boolean mask of the held-out documents: a seeded random `fraction` of them."""
    return np.random.default_rng(seed).random(n) < fraction


def score_routing(name: str, fit: Callable[[int], tuple[torch.Tensor, torch.Tensor]], labels: np.ndarray,
                  test: np.ndarray, k: int, seeds: list[int]) -> dict[str, Any]:
    """``fit(seed)`` -> (training documents' balanced paths, held-out documents' paths); NMI and purity of
    both against the labels, mean (and min) over seeds, and the training shards' balance."""
    train_nmi, test_nmi, purity, ratio = [], [], [], []
    for seed in seeds:
        train_paths, test_paths = fit(seed)
        fitted = routing_report(train_paths, k, labels=labels[~test].tolist())
        train_nmi.append(fitted["nmi"])
        purity.append(fitted["purity"])
        ratio.append(fitted["docs_max_min_ratio"] or float("inf"))
        test_nmi.append(routing_report(test_paths, k, labels=labels[test].tolist())["nmi"])
    return {"featurizer": name, "train_nmi": statistics.mean(train_nmi), "min_train_nmi": min(train_nmi),
            "test_nmi": statistics.mean(test_nmi), "min_test_nmi": min(test_nmi),
            "train_purity": statistics.mean(purity), "max_min_docs": max(ratio)}


def bench_doc_topics(args: argparse.Namespace) -> dict[str, Any]:
    """The doc_topics featurizer against the prefix's own TF-IDF, on each shared corpus, as `dipaco route`
    would use them: fitted on the training documents (doc_topics and the whole-document rows read their
    whole text, which is training data), every document routed on its first --prefix-tokens tokens,
    balanced cosine k-means (k = --featurizer-k, --slack) over the features."""
    tokenizer = load_tokenizer(args.lm_tokenizer)
    n, k = args.tfidf_components[len(args.tfidf_components) // 2], args.featurizer_k
    out: dict[str, Any] = {"tokenizer": relative(args.lm_tokenizer), "prefix_tokens": args.prefix_tokens, "k": k, "svd": n,
                           "slack": args.slack, "seeds": args.seeds, "held_out": 0.1, "corpora": {}}

    def routed(train_x: np.ndarray, test_x: np.ndarray, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        router, paths = fit_router(torch.from_numpy(train_x), [k], slack=args.slack, seed=seed, n_init=args.n_init,
                                   metric="cosine")
        return paths, router.assign(torch.from_numpy(test_x))

    for corpus in args.corpora.split(","):
        start = time.perf_counter()
        docs = load_shared(args.shared_data, corpus, args.featurizer_max_docs)
        ids = tokenizer(docs["text"], add_special_tokens=False)["input_ids"]
        contexts = np.array(tokenizer.batch_decode([i[: args.prefix_tokens] for i in ids]), dtype=object)
        whole, labels = np.array(docs["text"], dtype=object), np.array(docs["label"])
        test = held_out(len(whole))
        tr = ~test

        def prefix_tfidf(seed: int):
            x, fitted = tfidf_svd_features(list(contexts[tr]), n_components=n, seed=seed)
            return routed(x, fitted.transform(list(contexts[test])), seed)

        def whole_centroids(seed: int):
            # c-BTM: clusters of whole documents; a new document goes to the centroid nearest its prefix.
            x, fitted = tfidf_svd_features(list(whole[tr]), n_components=n, seed=seed)
            router, _ = fit_router(torch.from_numpy(x), [k], slack=args.slack, seed=seed, n_init=args.n_init,
                                   metric="cosine")
            prefixes = torch.from_numpy(fitted.transform(list(contexts)))
            return router.assign_balanced(prefixes[torch.from_numpy(tr)]), router.assign(prefixes[torch.from_numpy(test)])

        def doc_topics(seed: int):
            x, model, _ = doc_topics_features(list(whole[tr]), list(contexts[tr]), k, n_components=n,
                                              slack=args.slack, seed=seed, n_init=args.n_init)
            return routed(x, model.transform(list(contexts[test])), seed)

        def whole_tfidf(seed: int):  # not a router (it reads the whole text): the ceiling of the rows above
            x, fitted = tfidf_svd_features(list(whole[tr]), n_components=n, seed=seed)
            return routed(x, fitted.transform(list(whole[test])), seed)

        rows = [score_routing(name, fit, labels, test, k, args.seeds) for name, fit in (
            (f"tfidf prefix, svd {n}", prefix_tfidf),
            (f"whole-document clusters, nearest to the prefix (c-BTM), svd {n}", whole_centroids),
            (f"doc_topics (whole-document topics, naive Bayes on the prefix), svd {n}", doc_topics),
            (f"whole document, tfidf svd {n} (not a router: ceiling)", whole_tfidf))]
        out["corpora"][corpus] = {"docs": len(whole), "held_out_docs": int(test.sum()), "labels": len(set(labels)),
                                  "rows": rows, "wall_s": time.perf_counter() - start}
        print(f"\n## {corpus}: {len(whole)} docs ({int(test.sum())} held out), {len(set(labels))} labels, k={k}, "
              f"balanced (slack {args.slack}), first {args.prefix_tokens} tokens, seeds {args.seeds}")
        print(table(rows, ["featurizer", "train_nmi", "min_train_nmi", "test_nmi", "min_test_nmi", "train_purity",
                           "max_min_docs"]))
    return out


# ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m bench routing`` (see the module docstring for the sections they drive)."""
    p = argument_parser("routing", __doc__)
    p.add_argument("--sections", default="kmeans,20ng", help="comma list of kmeans, 20ng, featurizers, context, doc_topics "
                   "(lm runs with --lm-model)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="20news_bydate.jsonl.gz")
    p.add_argument("--keep-subject", action="store_true", help="keep the Subject: header line (default: body only)")
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--svd", type=int, default=128, help="TF-IDF SVD components")
    p.add_argument("--n-init", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timing repeats per k-means comparison")
    p.add_argument("--slack", type=float, default=0.1)
    p.add_argument("--seeds", type=lambda s: [int(v) for v in s.split(",")], default=[0, 1, 2])
    p.add_argument("--blobs", default="50000,64,16", help="N,D,k of the synthetic blobs ('' to skip)")
    p.add_argument("--lm-model", default=None, help="HF causal LM directory: runs the LM-prefix section")
    p.add_argument("--lm-tokenizer", default=None, help="tokenizer directory (default: --lm-model)")
    p.add_argument("--lm-max-docs", type=int, default=None, help="cap docs per split for the LM section")
    p.add_argument("--lm-batch-size", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=32)
    p.add_argument("--tfidf-prefix-tokens", type=int, default=None,
                   help="TF-IDF sees only each doc's first N tokens of --lm-tokenizer/--lm-model (causal routing, "
                        "as the trainer routes); default: whole documents (c-BTM)")
    p.add_argument("--shared-data", type=Path, default=DEFAULT_DATA.parent, help="the shared corpora's folder")
    p.add_argument("--corpora", default="bbc,mix,20ng", help="featurizers section: comma list of bbc, mix, 20ng")
    p.add_argument("--featurizer-k", type=int, default=4, help="featurizers section: clusters")
    p.add_argument("--featurizer-max-docs", type=int, default=None, help="featurizers section: docs per corpus")
    p.add_argument("--tfidf-components", type=lambda s: [int(v) for v in s.split(",")], default=[16, 64, 128],
                   help="featurizers section: TF-IDF SVD widths tried")
    p.add_argument("--encoder", default=None, help="featurizers section: also an HF encoder (hub name or directory)")
    p.add_argument("--context-tokens", type=lambda s: [int(v) for v in s.split(",")], default=[32, 64, 128, 256, 0],
                   help="context section: routing context lengths in tokens (0 = the whole document)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch and BLAS/OpenMP threads (default: as is)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p


# The sections that need a tokenizer or a model, and the flag that gives it.
NEEDS = {"context": ("lm_tokenizer", "--lm-tokenizer (a run's tokenizer/ directory)"),
         "doc_topics": ("lm_tokenizer", "--lm-tokenizer (a run's tokenizer/ directory)"),
         "featurizers": ("lm_model", "--lm-model (a run's pretrain/ directory)")}


def check_sections(p: argparse.ArgumentParser, args: argparse.Namespace, sections: set[str]) -> None:
    """Ends the run, before any section runs, when a section lacks the tokenizer or model it reads."""
    for section in sorted(sections & set(NEEDS)):
        attribute, flag = NEEDS[section]
        if not getattr(args, attribute):
            p.error(f"--sections {section} needs {flag}")


def set_threads(threads: int | None) -> None:
    """torch's and the BLAS/OpenMP pools' threads (scikit-learn's k-means runs in the latter)."""
    if threads:
        from threadpoolctl import threadpool_limits

        torch.set_num_threads(threads)
        threadpool_limits(threads)


def relative(value: Any) -> Any:
    """A path relative to the checkout (a results file names no machine's folders); any other value as it is."""
    if isinstance(value, Path) or (isinstance(value, str) and os.path.isabs(value)):
        return os.path.relpath(value, REPO)
    return value


def header(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """The results' first fields: the arguments and the command (paths relative to the checkout, so a results
    file names no machine's folders) and the machine (:func:`bench.harness.environment`). The machine's
    ``torch_threads``, ``torch`` and ``cpus`` stay at the top as well, where the files of docs/ hold them."""
    env = environment(args.device)
    return {"args": {k: relative(v) for k, v in vars(args).items()},
            "torch_threads": env["threads"], "torch": env["torch"], "cpus": env["cpus"], "loadavg_start": os.getloadavg(),
            "command": command_line("routing", [relative(a) for a in argv]), "environment": env}


def load_texts(args: argparse.Namespace, sections: set[str]) -> dict[str, dict[str, list]] | None:
    """20 Newsgroups for the k-means, 20ng and LM sections (None when none of them runs); with
    --tfidf-prefix-tokens each document cut to its first tokens, as the trainer routes."""
    need_text = bool(sections & {"kmeans", "20ng"}) or (args.lm_model and "featurizers" not in sections)
    if not need_text:
        return None
    data = load_20ng(args.data, args.keep_subject)
    if args.tfidf_prefix_tokens:
        tok = load_tokenizer(args.lm_tokenizer or args.lm_model)
        for split in data.values():
            ids = tok(split["text"], add_special_tokens=False)["input_ids"]
            split["text"] = tok.batch_decode([i[: args.tfidf_prefix_tokens] for i in ids])
        print(f"TF-IDF sees each document's first {args.tfidf_prefix_tokens} tokens only")
    return data


def kmeans_section(args: argparse.Namespace, tfidf: tuple[np.ndarray, np.ndarray] | None) -> list[dict[str, Any]]:
    """Section 1: ours against scikit-learn on the 20NG features (when loaded) and the synthetic blobs."""
    rows = []
    if tfidf is not None:
        rows.append(bench_kmeans("20ng tfidf+svd (train)", tfidf[0], args.k, args.n_init, args.repeats, 0))
    if args.blobs:
        n, d, k = (int(v) for v in args.blobs.split(","))
        rows.append(bench_kmeans(f"blobs {n}x{d}", blobs(n, d, k), k, args.n_init, args.repeats, 0))
    print("\n## k-means: ours vs scikit-learn (time: best and median of repeats; inertia, iterations: mean)")
    print(table(rows, ["features", "N", "D", "k", "n_init", "sklearn_s", "ours_s", "time_ratio",
                       "sklearn_median_s", "ours_median_s", "sklearn_inertia", "ours_inertia",
                       "inertia_ratio", "sklearn_iter", "ours_iter"]))
    return rows


def twenty_newsgroups_section(args: argparse.Namespace, tfidf: tuple[np.ndarray, np.ndarray],
                              data: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Section 2: the TF-IDF+SVD router on 20NG, unbalanced and balanced, every seed."""
    labels = (data["train"]["label"], data["test"]["label"])
    rows = [route_and_score("tfidf_svd", tfidf, labels, args, slack, seed)
            for seed in args.seeds for slack in (None, args.slack)]
    out = {"rows": rows, "summary": summarize(rows)}
    print(f"\n## 20 Newsgroups routing, k={args.k} (train = fitted shards, test = nearest centroid)")
    print(table(rows, ["router", "slack", "seed", "train_nmi", "test_nmi", "train_ari", "train_purity",
                       "train_max_min", "train_max_docs", "fit_s"]))
    print("\n" + table(out["summary"], SUMMARY_COLS))
    return out


def run(argv: list[str]) -> dict[str, Any]:
    """Runs the sections ``argv`` asks for and returns the results (what ``--out`` writes)."""
    p = build_parser()
    args = p.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    check_sections(p, args, sections)
    set_threads(args.threads)
    results = header(args, argv)
    # Timings on a shared machine are only comparable at similar load: print it with them.
    print(f"torch {results['torch']}, {results['torch_threads']} threads, {results['cpus']} CPUs, "
          f"load average {results['loadavg_start'][0]:.2f}")

    data = load_texts(args, sections)
    tfidf = None
    if data is not None and sections & {"kmeans", "20ng"}:
        (train_x, fitted), secs = timed(lambda: tfidf_svd_features(data["train"]["text"], n_components=args.svd))
        test_x = fitted.transform(data["test"]["text"])
        tfidf = (train_x, test_x)
        results["tfidf_fit_s"] = secs
        print(f"20 Newsgroups: {len(train_x)} train / {len(test_x)} test docs, TF-IDF+SVD({args.svd}) in {secs:.1f}s")
    if "kmeans" in sections:
        results["kmeans"] = kmeans_section(args, tfidf)
    if "20ng" in sections and tfidf is not None and data is not None:
        results["20ng"] = twenty_newsgroups_section(args, tfidf, data)
    if "context" in sections:
        results["context"] = bench_context(args)
    if "doc_topics" in sections:
        results["doc_topics"] = bench_doc_topics(args)
    if "featurizers" in sections:
        results["featurizers"] = bench_featurizers(args)
    elif args.lm_model and data is not None:
        results["lm"] = bench_lm(args, data)

    results["loadavg_end"] = os.getloadavg()
    print(f"\nload average at the end {results['loadavg_end'][0]:.2f}")
    if args.out:
        write_json(args.out, results)
        print(f"\nwrote {args.out}")
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m bench routing ARGS``: :func:`run`, its results printed and, with --out, written."""
    run(sys.argv[1:] if argv is None else argv)
    return 0
