"""`dipaco route` in chunks on the tiny run: the in-memory result when every document is in the fit sample,
the full N's bounds on a sample fit, and resume after a kill."""

from __future__ import annotations

import json
from dataclasses import replace

import datasets
import numpy as np
import pytest
import torch

import dipaco.route.assign as assign
from dipaco.config import Config
from dipaco.errors import ConfigError, DataError
from dipaco.route.assign import FEATURES, WORK, routing_context
from dipaco.run import Run
from dipaco.run_dir import RunDir
from dipaco.tensor_io import load_tensors
from routing.assignment import capacity, floor_size
from routing.featurize import tfidf_svd_features
from routing.router import Router, fit_router


def routed(cfg: Config, **route_kw) -> Config:
    route = dict(featurizer="tfidf_svd", svd_components=8, n_init=1, chunk_docs=64, min_shard_fraction=0.5)
    return replace(cfg, train=replace(cfg.train, sharding="kmeans"), route=replace(cfg.route, **(route | route_kw)))


def result(cfg: Config) -> tuple[Router, dict[str, np.ndarray]]:
    run = RunDir(cfg.run.dir)
    splits = datasets.load_from_disk(str(run.routing / "data"))
    return Router.load(run.routing / "router"), {s: np.asarray(splits[s]["path"]) for s in ("train", "validation")}


def test_with_every_document_in_the_fit_sample_routing_is_the_in_memory_one(run_cfg):
    cfg = routed(run_cfg, topk=2)  # fit_docs (200k) >= N; chunks of 64 documents
    Run(cfg).route()
    router, paths = result(cfg)
    prepared = Run(cfg).prepared(routed=False)
    assert len(prepared.train) > 3 * cfg.route.chunk_docs  # several chunks
    # What the in-memory code computed: features of all contexts at once, k-means on all of them.
    contexts = routing_context(prepared.train, prepared, cfg.data.prefix_tokens)
    x, model = tfidf_svd_features(contexts, n_components=8, seed=cfg.run.seed)
    stored = load_tensors(RunDir(cfg.run.dir).routing / FEATURES)
    assert torch.equal(stored["train"], torch.from_numpy(x))
    val = model.transform(routing_context(prepared.validation, prepared, cfg.data.prefix_tokens))
    assert torch.equal(stored["validation"], torch.from_numpy(val))
    expected, labels = fit_router(torch.from_numpy(x), [4], slack=cfg.route.balance_slack, min_fraction=0.5,
                                  seed=cfg.run.seed, n_init=1, max_iter=cfg.route.max_iter)
    assert torch.equal(router.centroids[0], expected.centroids[0])
    np.testing.assert_array_equal(paths["train"], labels.numpy())
    np.testing.assert_array_equal(paths["validation"], expected.assign(torch.from_numpy(val)).numpy())
    topk = np.asarray(datasets.load_from_disk(str(RunDir(cfg.run.dir).routing / "data"))["train"]["paths_topk"])
    np.testing.assert_array_equal(topk, expected.assign_topk(torch.from_numpy(x), 2).numpy())
    assert not (RunDir(cfg.run.dir).root / WORK).exists()  # the work folder goes once routing/ is written


def test_a_sample_fit_assigns_every_document_within_the_bounds_of_the_full_n(run_cfg):
    cfg = routed(run_cfg, fit_docs=120, balance_slack=0.05)
    report = Run(cfg).route()
    router, paths = result(cfg)
    n = len(paths["train"])
    sizes = np.bincount(paths["train"], minlength=4)
    assert sizes.max() <= capacity(n, 4, 0.05) and sizes.min() >= floor_size(n, 4, 0.05, 0.5)
    assert router.meta["fit_docs"] == 120 and router.meta["assignment_optimal"] is True
    assert router.meta["refine_rounds"] == cfg.route.refine_rounds == 2  # the default: centroids refined on all
    assert report["train"]["docs_per_path"] == sizes.tolist() and report["fit_docs"] == 120
    # The assignment is the exact balanced optimum of the full N for the sample's centroids.
    stored = load_tensors(RunDir(cfg.run.dir).routing / FEATURES)
    np.testing.assert_array_equal(paths["train"], router.assign_balanced(stored["train"]).numpy())
    np.testing.assert_array_equal(paths["validation"], router.assign(stored["validation"]).numpy())


def test_refine_rounds_must_not_be_negative(run_cfg):
    with pytest.raises(ConfigError, match="route.refine_rounds: must be >= 0"):
        Run(routed(run_cfg, refine_rounds=-1)).route()


def test_a_killed_route_resumes_at_the_next_chunk_and_ends_as_an_uninterrupted_one(run_cfg, monkeypatch, capsys):
    cfg = routed(run_cfg, featurizer="lm_prefix", fit_docs=150)
    Run(cfg).route()
    router_once, paths_once = result(cfg)
    features_once = load_tensors(RunDir(cfg.run.dir).routing / FEATURES)

    real = assign.featurize_chunk
    calls: list[int] = []

    def killed_in_chunk_2(*args, **kwargs):
        calls.append(len(args[3]))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(assign, "featurize_chunk", killed_in_chunk_2)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).route()
    record = json.loads((RunDir(cfg.run.dir).root / WORK / "record.json").read_text())
    assert record["splits"]["train"]["done"] == [0]

    calls.clear()
    monkeypatch.setattr(assign, "featurize_chunk", lambda *a, **k: (calls.append(len(a[3])), real(*a, **k))[1])
    Run(cfg).route()
    assert "resuming the features" in capsys.readouterr().out
    n_train = len(paths_once["train"])
    assert sum(calls) == n_train - cfg.route.chunk_docs + len(paths_once["validation"])  # chunk 0 not again
    router, paths = result(cfg)
    assert torch.equal(router.centroids[0], router_once.centroids[0])
    for split in ("train", "validation"):
        np.testing.assert_array_equal(paths[split], paths_once[split])
        assert torch.equal(load_tensors(RunDir(cfg.run.dir).routing / FEATURES)[split], features_once[split])


def test_changed_settings_start_the_features_over(run_cfg, monkeypatch, capsys):
    cfg = routed(run_cfg)
    real = assign.featurize_chunk
    calls: list[int] = []

    def killed_in_chunk_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(assign, "featurize_chunk", killed_in_chunk_2)
    with pytest.raises(KeyboardInterrupt):
        Run(routed(run_cfg, featurizer="lm_prefix")).route()
    monkeypatch.setattr(assign, "featurize_chunk", real)
    Run(cfg).route()  # tfidf: another featurizer, so the LM chunk done is not reused
    assert "from other settings; starting over" in capsys.readouterr().out
    assert Router.load(RunDir(cfg.run.dir).routing / "router").featurizer["kind"] == "tfidf_svd"


def test_a_work_folder_whose_record_outlived_its_features_starts_over(run_cfg, monkeypatch, capsys):
    # Issue 48: `dipaco route` killed while it deleted routing.work left record.json without train.npy, and
    # every later route "resumed" and crashed with FileNotFoundError until the folder was deleted by hand.
    cfg = routed(run_cfg, featurizer="lm_prefix", fit_docs=150)
    real = assign.featurize_chunk
    calls: list[int] = []

    def killed_in_chunk_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(assign, "featurize_chunk", killed_in_chunk_2)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).route()
    work = RunDir(cfg.run.dir).root / WORK
    (work / "train.npy").unlink()  # what a removal killed between the two files left
    monkeypatch.setattr(assign, "featurize_chunk", real)
    Run(cfg).route()
    assert "lack train.npy; starting over" in capsys.readouterr().out
    assert not work.exists() and not list(work.parent.glob(f".{WORK}.removing.*"))
    assert Router.load(RunDir(cfg.run.dir).routing / "router").featurizer["kind"] == "lm_prefix"


def test_routing_writes_only_its_columns_and_joins_them_to_the_prepared_splits(run_cfg):
    """`routing/data` holds the path columns only, not a copy of the corpus; training sees them joined to
    the prepared rows. Routing written whole by older versions is still read."""
    cfg = routed(run_cfg, topk=2)
    Run(cfg).route()
    run = RunDir(cfg.run.dir)
    written = datasets.load_from_disk(str(run.routing / "data"))
    assert written["train"].column_names == ["path", "paths_topk"]
    assert written["validation"].column_names == ["path"]
    prepared, joined = Run(cfg).prepared(routed=False), Run(cfg).prepared(routed=True)
    assert joined.train["id"] == prepared.train["id"] and joined.train["path"] == written["train"]["path"]
    assert joined.validation["input_ids"] == prepared.validation["input_ids"]

    old = {"train": joined.train, "validation": joined.validation}  # the layout before: the whole split, routed
    info = (run.routing / "data" / "routing_info.json").read_text()
    datasets.DatasetDict(old).save_to_disk(str(run.routing / "data.old"))
    (run.routing / "data.old" / "routing_info.json").write_text(info)
    (run.routing / "data").rename(run.routing / "data.new")
    (run.routing / "data.old").rename(run.routing / "data")
    again = Run(cfg).prepared(routed=True)
    assert again.train["paths_topk"] == joined.train["paths_topk"] and again.validation["id"] == prepared.validation["id"]

    (run.routing / "data").rename(run.routing / "data.old")
    short = {"train": datasets.Dataset.from_dict(written["train"].to_dict()),
             "validation": datasets.Dataset.from_dict({"path": written["validation"]["path"][:-1]})}
    datasets.DatasetDict(short).save_to_disk(str(run.routing / "data"))
    (run.routing / "data" / "routing_info.json").write_text(info)
    with pytest.raises(DataError, match="routed validation documents, but the prepared data has"):
        Run(cfg).prepared(routed=True)


def test_routing_columns_are_saved_in_batches_of_a_million_rows(tmp_path):
    """save_to_disk wrote 1,000-row batches: opening routing/data of 10M documents touched all of its
    77 MB, and joining it to the splits sliced it into thousands of Arrow pieces."""
    import pyarrow as pa

    rows = 2500
    splits = {"train": datasets.Dataset(pa.table({"path": pa.array(np.arange(rows) % 4, type=pa.int64())}))}
    assign.save_routing_columns(splits, tmp_path / "data")
    [file] = (tmp_path / "data" / "train").glob("*.arrow")
    with pa.memory_map(str(file)) as source:
        assert [b.num_rows for b in pa.ipc.open_stream(source)] == [rows]
    assert datasets.load_from_disk(str(tmp_path / "data"))["train"]["path"][:6] == [0, 1, 2, 3, 0, 1]


def test_path_columns_are_int32_and_checked_before_the_cast():
    from dipaco.route.shards import column_paths

    ds = datasets.Dataset.from_dict({"id": ["a", "b", "c"], "p": [0, 3, 1]})
    assert column_paths(ds, "p", 4).dtype == np.int32 and column_paths(ds, "p", 4).tolist() == [0, 3, 1]
    wraps = datasets.Dataset.from_dict({"id": ["a", "b"], "p": [0, 2**32 + 1]})  # 1 once cast to int32
    with pytest.raises(DataError, match=r"1 docs have a path outside \[0, 4\), e.g. ids \['b'\]"):
        column_paths(wraps, "p", 4)


def test_stored_features_read_rows_of_the_file_and_name_a_bad_one(tmp_path):
    """`dipaco reroute` loaded the whole features file (4.6 GB at 10M documents); it now reads the rows it
    needs from it, through the same layout safetensors reads and writes."""
    from safetensors.numpy import save_file

    from dipaco.route.assign import save_features, stored_features

    rng = np.random.default_rng(1)
    train, validation = rng.random((101, 5), dtype=np.float32), rng.random((9, 5), dtype=np.float32)
    save_features({"train": train, "validation": validation}, tmp_path / "ours.safetensors", chunk_bytes=64)
    save_file({"validation": validation, "train": train.astype(np.float16)}, str(tmp_path / "theirs.safetensors"),
              metadata={"by": "safetensors"})
    for name, half in (("ours", False), ("theirs", True)):
        stored = stored_features(tmp_path / f"{name}.safetensors")
        want = train.astype(np.float16) if half else train
        assert np.array_equal(stored["train"][:], want) and np.array_equal(stored["validation"][:], validation)
        rows = np.array([100, 3, 4, 50])
        assert np.array_equal(stored["train"][rows], want[rows]) and len(stored["train"]) == 101
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / "ours.safetensors").read_bytes()[:-40])
    with pytest.raises(DataError, match="cut.safetensors: not a readable features file"):
        stored_features(cut)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(DataError, match="junk.safetensors: not a readable features file"):
        stored_features(tmp_path / "junk.safetensors")


def test_holdout_rows_are_the_holdout_mask_read_in_chunks():
    from dipaco.data.hashing import holdout_mask
    from dipaco.train.reroute import holdout_rows

    ds = datasets.Dataset.from_dict({"id": [f"doc{i}" for i in range(1000)]})
    want = np.flatnonzero(holdout_mask(ds["id"], 0.1, "reroute:0"))
    assert 50 < len(want) < 150
    assert np.array_equal(holdout_rows(ds, 0.1, "reroute:0", chunk=64), want)


def test_features_are_written_as_safetensors_in_bounded_pieces(tmp_path):
    """save_features streams each array in pieces of about chunk_bytes; the file is what safetensors reads."""
    from safetensors.numpy import load_file

    from dipaco.route.assign import save_features

    rng = np.random.default_rng(0)
    train, validation = rng.random((1001, 7), dtype=np.float32), rng.random((13, 7), dtype=np.float32)
    save_features({"train": train, "validation": torch.from_numpy(validation)}, tmp_path / "f.safetensors",
                  chunk_bytes=4 * 7 * 10 + 3)
    loaded = load_file(tmp_path / "f.safetensors")
    assert np.array_equal(loaded["train"], train) and np.array_equal(loaded["validation"], validation)
