"""`dipaco route` / `dipaco reroute` wired to the trainer, on the tiny run."""

import itertools
import json
from dataclasses import replace

import datasets
import numpy as np
import pytest

from dipaco.config import Config
from dipaco.data.tokenizer import load_tokenizer
from dipaco.errors import ConfigError, DataError
from dipaco.route.assign import FEATURES, print_report
from dipaco.run import Run
from dipaco.run_dir import RunDir
from dipaco.tensor_io import load_tensors
from routing.quality import routing_report
from routing.router import Router


def routed(cfg: Config, **route_kw) -> Config:
    return replace(cfg, train=replace(cfg.train, sharding="kmeans"), route=replace(cfg.route, **route_kw))


@pytest.mark.parametrize("featurizer,method", [("lm_prefix", "kmeans"), ("tfidf_svd", "product")])
def test_route_writes_shards_artifact_and_report_and_train_uses_them(run_cfg, featurizer, method):
    cfg = routed(run_cfg, featurizer=featurizer, method=method, svd_components=8, topk=2)
    report = Run(cfg).route()
    run = RunDir(cfg.run.dir)
    splits = datasets.load_from_disk(str(run.routing / "data"))
    train_paths = np.asarray(splits["train"]["path"])
    assert report["train"]["docs_per_path"] == np.bincount(train_paths, minlength=4).tolist()
    # Balanced with slack 0.1: no shard over ceil(N/P * 1.1).
    n = len(train_paths)
    assert max(report["train"]["docs_per_path"]) <= int(np.ceil(n / 4 * 1.1))
    assert {"nmi", "ari", "purity"} <= set(report["train"])  # the slice has labels
    assert np.asarray(splits["train"]["paths_topk"]).shape == (n, 2)
    assert json.loads((run.routing / "routing_report.json").read_text())["router"] == report["router"]

    router = Router.load(run.routing / "router")
    router.check_fits(4)
    assert router.kind == ("kmeans" if method == "kmeans" else "product_kmeans")

    exp = Run(cfg).train()
    sizes = [loop.sampler.sequences.shape[0] for loop in exp.loops.values()]
    assert all(s > 0 for s in sizes)
    ev = Run(cfg).evaluate()
    val_paths = np.asarray(splits["validation"]["path"])
    assert [r["docs"] for r in ev["paths"]] == np.bincount(val_paths, minlength=4).tolist()


def test_route_prints_the_max_min_shard_ratio_rounded(capsys):
    def printed(sizes: list[int]) -> str:
        train = routing_report(np.repeat(np.arange(4), sizes), 4)
        print_report({"router": "kmeans", "featurizer": {"kind": "tfidf_svd"}, "train": train})
        return capsys.readouterr().out

    out = printed([29, 30, 31, 30])  # 31/29 = 1.0689...
    assert "docs per path [29, 30, 31, 30], max/min 1.07\n" in out
    assert "max/min inf\n" in printed([40, 40, 0, 40])  # an empty path: no finite ratio
    assert "max/min 1.00\n" in printed([3, 3, 3, 3])


def test_train_with_kmeans_before_route_says_what_to_run(run_cfg):
    with pytest.raises(DataError, match="dipaco route"):
        Run(routed(run_cfg)).train()


def test_product_routing_needs_a_grid(run_cfg):
    cfg = routed(run_cfg, method="product")
    cfg = replace(cfg, topology=replace(cfg.topology, preset="moe:4"))
    with pytest.raises(ConfigError, match="grid"):
        Run(cfg).route()


def test_reroute_reshards_and_training_resumes(run_cfg):
    cfg = routed(run_cfg, featurizer="lm_prefix", reroute_holdout=0.5)
    cfg = replace(cfg, train=replace(cfg.train, rounds=3))
    Run(cfg).route()
    Run(cfg).train(until_round=2)
    features = RunDir(cfg.run.dir).routing / FEATURES
    inode = features.stat().st_ino
    report = Run(cfg).reroute()
    assert report["router"] == "linear" and report["holdout_docs"] > 0
    router = Router.load(RunDir(cfg.run.dir).routing / "router")
    assert router.kind == "linear"
    # The features are unchanged: linked into the new routing, not loaded and written again. The paths,
    # assigned a chunk at a time from the file, are those of all features at once.
    assert features.stat().st_ino == inode
    stored = load_tensors(features)
    columns = datasets.load_from_disk(str(RunDir(cfg.run.dir).routing / "data"))
    for split in ("train", "validation"):
        assert np.array_equal(np.asarray(columns[split]["path"]), router.assign(stored[split]).numpy())
    # Sizes aim at uniform within the classifier's tolerance, and no shard is empty.
    assert min(report["train"]["docs_per_path"]) > 0
    exp = Run(cfg).train(resume=True)
    assert exp.checkpoints.latest().name == "round_000003"


def test_reroute_of_one_experiment_is_refused_to_the_others_of_the_run(run_cfg):
    """`dipaco reroute` rewrites the run's routing; an experiment trained on the old routing must not
    resume, evaluate or serve on shards it never saw (the quality benchmark once did exactly that)."""
    from dipaco.serve.pipeline import experiment_router, load_experiment

    cfg = routed(run_cfg, featurizer="lm_prefix", reroute_holdout=0.5)
    other = replace(cfg, train=replace(cfg.train, name="other", rounds=2))
    rerouted = replace(cfg, train=replace(cfg.train, name="rerouted", rounds=2))
    Run(cfg).route()
    Run(other).train(until_round=1)
    Run(rerouted).train(until_round=1)
    Run(other).evaluate()  # same routing: fine
    Run(rerouted).reroute()

    for job in (lambda: Run(other).train(resume=True), lambda: Run(other).evaluate(), lambda: Run(other).reroute(),
                lambda: experiment_router(load_experiment(other.run.dir, "other"))):
        with pytest.raises(DataError, match="not the routing experiment 'other' was trained on"):
            job()
    # The re-routed experiment carries on on its new routing.
    assert Run(rerouted).train(resume=True).checkpoints.latest().name == "round_000002"
    Run(rerouted).evaluate()
    # Routing again with the original settings restores the original routing, and `other` with it.
    Run(cfg).route()
    assert Run(other).train(resume=True).checkpoints.latest().name == "round_000002"


def test_routing_sees_only_the_prefix_never_the_scored_tokens(run_cfg):
    # Regression: TF-IDF routing once read whole documents, so a validation document's path was
    # chosen from the very tokens its perplexity is measured on.
    from dipaco.route.assign import routing_context

    prepared = Run(run_cfg).prepared(routed=False)
    prefix = run_cfg.data.prefix_tokens
    ds = prepared.validation.select(range(5))
    tail_changed = ds.map(lambda row: {"input_ids": row["input_ids"][:prefix] + [7] * 50})
    assert routing_context(ds, prepared, prefix) == routing_context(tail_changed, prepared, prefix)
    for text, ids in zip(routing_context(ds, prepared, prefix), ds["input_ids"]):
        assert text == prepared.tokenizer.decode(ids[:prefix])


IMPROVED = dict(layers=[1, 2], skip_tokens=2, transform="whiten_l2", metric="cosine")


def test_improved_featurizer_with_top2_overlap_trains_and_serves_on_the_same_routes(run_cfg):
    import torch

    from dipaco.route.assign import FEATURES
    from dipaco.route.shards import overlap_token_shares, overlapping_paths
    from dipaco.serve.pipeline import Pipeline
    from dipaco.serve.router_passes import lm_prefix_features
    from dipaco.tensor_io import load_tensors

    cfg = routed(run_cfg, n_init=1, topk=2, **IMPROVED)
    Run(cfg).route()
    run = RunDir(cfg.run.dir)
    router = Router.load(run.routing / "router")
    assert router.featurizer == {"kind": "lm_prefix", "prefix_tokens": 16, "layers": [1, 2], "skip_tokens": 2}
    assert router.transform is not None and router.transform.kind == "whiten_l2" and router.dim == 64
    stored = load_tensors(run.routing / FEATURES)
    joined = Run(cfg).prepared(routed=True)
    splits = {"train": joined.train, "validation": joined.validation}
    assert router.assign(stored["validation"]).tolist() == splits["validation"]["path"]

    exp = Run(cfg).train()
    train_ds = splits["train"]
    two = overlapping_paths(train_ds, np.asarray(train_ds["path"]), 2)
    one = np.bincount(np.asarray(train_ds["path"]), minlength=4)
    assert (np.bincount(two.ravel(), minlength=4) == one + np.bincount(two[:, 1], minlength=4)).all()
    shares = overlap_token_shares(two, 4, train_ds["num_tokens"])
    assert shares == pytest.approx([0.5] * 4)
    assert exp.weights == {p: float(loop.sampler.sequences.numel()) * shares[p] for p, loop in exp.loops.items()}
    single = routed(run_cfg, n_init=1, **IMPROVED)  # same routing, one path per document
    assert all(exp.loops[p].sampler.sequences.shape[0] > n for p, n in
               enumerate(np.bincount(np.asarray(train_ds["path"]), weights=train_ds["num_tokens"], minlength=4)
                         // (single.data.seq_len * 4)))

    # Serving pools the same hidden states over the same tokens and applies the same transform.
    Run(cfg).evaluate()
    pipe = Pipeline.from_run(cfg.run.dir, experiment=cfg.train.name)
    for i in range(5):
        ids = splits["validation"]["input_ids"][i]
        prefix = torch.tensor([list(ids)[: pipe.routing_prefix_tokens()]])
        torch_feats = lm_prefix_features(pipe.featurizer_model, pipe.router.featurizer, prefix, pipe.precision)
        np.testing.assert_allclose(torch_feats.numpy()[0], stored["validation"][i].numpy(), atol=1e-4, rtol=1e-4)
        assert pipe._route("", ids)[0] == splits["validation"]["path"][i]


def test_route_featurizer_options_are_checked_by_their_keys(run_cfg):
    from dipaco.run import apply_overrides

    with pytest.raises(ConfigError, match=r"route.skip_tokens: must be in \[0, data.prefix_tokens=16\)"):
        apply_overrides(run_cfg, ["route.skip_tokens=16"])
    with pytest.raises(ConfigError, match="route.encoder: route.featurizer=encoder needs"):
        apply_overrides(run_cfg, ["route.featurizer=encoder"])
    with pytest.raises(ConfigError, match="route.transform: 'zca' is not one of"):
        apply_overrides(run_cfg, ["route.transform=zca"])
    with pytest.raises(ConfigError, match="route.topk=2: overlapping shards need train.sharding=kmeans"):
        Run(apply_overrides(run_cfg, ["route.topk=2"])).train()


def test_improved_featurizer_clusters_the_bbc_slice_more_topically_than_the_raw_one(run_cfg):
    """The tiny run's slice of the shared BBC corpus (5 topics), routed on the same 16-token prefix: the
    benchmark's improved featurizer (TF-IDF + SVD of the prefix, cosine) agrees with the topics more than
    the raw mean last hidden state of the pretrained model."""
    raw = Run(routed(run_cfg, n_init=2)).route()["train"]["nmi"]
    improved = Run(routed(run_cfg, n_init=2, featurizer="tfidf_svd", svd_components=16, metric="cosine")).route()
    print(f"NMI raw {raw:.3f}, improved {improved['train']['nmi']:.3f}")
    assert improved["train"]["nmi"] > raw


def test_doc_topics_routes_the_bbc_slice_more_topically_than_the_prefix_tfidf(run_cfg):
    """On the same 16-token prefix, topics learned from the whole training documents and read back by the
    word model agree with the BBC topics more than TF-IDF + SVD of the prefix itself (the improved
    featurizer of the test above). Validation documents are routed on their prefix only."""
    tfidf = Run(routed(run_cfg, n_init=2, featurizer="tfidf_svd", svd_components=16, metric="cosine")).route()
    topics = Run(routed(run_cfg, n_init=2, featurizer="doc_topics", svd_components=16, metric="cosine")).route()
    print(f"NMI tfidf prefix {tfidf['train']['nmi']:.3f} / {tfidf['validation']['nmi']:.3f}, "
          f"doc_topics {topics['train']['nmi']:.3f} / {topics['validation']['nmi']:.3f}")
    assert topics["featurizer"]["kind"] == "doc_topics" and topics["featurizer"]["topics"] == 4
    assert topics["train"]["nmi"] > tfidf["train"]["nmi"]
    assert topics["validation"]["nmi"] > tfidf["validation"]["nmi"]
    run = RunDir(run_cfg.run.dir)
    router = Router.load(run.routing / "router")
    splits = {"validation": Run(run_cfg).prepared(routed=True).validation}
    tokenizer = load_tokenizer(run.tokenizer)
    contexts = tokenizer.batch_decode([ids[:16] for ids in splits["validation"]["input_ids"]])
    assert router.assign(router.featurize(contexts)).tolist() == splits["validation"]["path"]


def test_route_doc_topics_options_are_checked(run_cfg):
    from dipaco.run import apply_overrides

    with pytest.raises(ConfigError, match="route.topics: must be 0"):
        apply_overrides(run_cfg, ["route.topics=1"])
    with pytest.raises(ConfigError, match="route.topic_smoothing: must be > 0"):
        apply_overrides(run_cfg, ["route.topic_smoothing=0"])
    with pytest.raises(ConfigError, match="route.featurizer=doc_topics: topics must be in"):
        Run(routed(run_cfg, featurizer="doc_topics", svd_components=8, topics=100000)).route()


def test_arrange_renumbers_the_same_clusters_so_alike_shards_share_modules(run_cfg):
    """route.arrange=similar keeps k-means' shards and only chooses which path each one becomes: the
    numbering with the lowest block-weighted Jensen-Shannon divergence between paths that share modules."""
    from dipaco.model.topology import Topology
    from dipaco.route.assign import cluster_token_counts
    from routing.arrange import arrangement_cost, js_divergences

    def shards(report: dict) -> tuple[np.ndarray, np.ndarray, Router]:
        run = RunDir(run_cfg.run.dir)
        splits = datasets.load_from_disk(str(run.routing / "data"))
        return (np.asarray(splits["train"]["path"]), np.asarray(splits["validation"]["path"]),
                Router.load(run.routing / "router"))

    kw = dict(featurizer="doc_topics", svd_components=16, metric="cosine", n_init=1)
    plain_train, plain_val, _ = shards(Run(routed(run_cfg, **kw)).route())
    report = Run(routed(run_cfg, arrange="similar", **kw)).route()
    train_paths, val_paths, router = shards(report)
    perm = np.asarray(report["arrangement"]["perm"])
    assert router.meta["arrangement"]["mode"] == "similar"
    assert train_paths.tolist() == perm[plain_train].tolist()
    assert val_paths.tolist() == perm[plain_val].tolist()

    prepared = Run(run_cfg).prepared(routed=False)
    dis = js_divergences(cluster_token_counts(prepared, plain_train, 4))
    shared = np.asarray(Topology.grid(run_cfg.model.num_layers, [2, 2]).shared_blocks())
    every = [arrangement_cost(np.asarray(p), shared, dis) for p in itertools.permutations(range(4))]
    assert report["arrangement"]["cost"] == pytest.approx(min(every))
    assert report["arrangement"]["identity_cost"] == pytest.approx(every[0])


def test_arrange_needs_plain_kmeans(run_cfg):
    from dipaco.run import apply_overrides

    with pytest.raises(ConfigError, match="route.arrange=similar: needs route.method=kmeans"):
        apply_overrides(run_cfg, ["route.method=product", "route.arrange=similar"])
    with pytest.raises(ConfigError, match="route.arrange"):
        apply_overrides(run_cfg, ["route.arrange=closest"])


def test_reroute_keeps_overlapping_shards_top2_and_em_training_uses_them(run_cfg):
    """With route.topk=2 the re-routed data carries the new router's two best paths (`paths_topk`), so
    overlapping shards follow every re-routing (here inside `dipaco train`, route.em_rounds)."""
    cfg = routed(run_cfg, featurizer="lm_prefix", n_init=1, reroute_holdout=0.5, topk=2, em_rounds=[1])
    Run(cfg).route()
    before = np.asarray(datasets.load_from_disk(str(RunDir(cfg.run.dir).routing / "data"))["train"]["paths_topk"])
    exp = Run(cfg).train()
    assert exp.checkpoints.latest().name == "round_000002"
    train_ds = datasets.load_from_disk(str(RunDir(cfg.run.dir).routing / "data"))["train"]
    after = np.asarray(train_ds["paths_topk"])
    assert after.shape == (len(train_ds), 2) and (after[:, 0] == np.asarray(train_ds["path"])).all()
    assert (after[:, 0] != after[:, 1]).all() and not np.array_equal(after, before)
    router = Router.load(RunDir(cfg.run.dir).routing / "router")
    assert router.kind == "linear"
