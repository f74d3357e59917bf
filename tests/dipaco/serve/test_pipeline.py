"""Single-path inference: routing a prompt, composing its path, generating, the path cache, bad runs."""

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dipaco.cli import main
from dipaco.errors import CheckpointError, DipacoError
from dipaco.model.llama import build_model
from dipaco.run import Run
from dipaco.run_dir import RunDir
from dipaco.serve.pipeline import Pipeline
from dipaco.serve.router_passes import lm_prefix_features

PROMPTS = [
    "The government said on Tuesday that the economy",
    "The striker scored twice in the second half",
    "Shares in the bank rose after the results",
    "In the beginning of the war the army",
]


@pytest.fixture(scope="module")
def pipe(served_run) -> Pipeline:
    return Pipeline.from_run(served_run.run.dir, cache_size=4)


def copy_run(cfg, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(cfg.run.dir, dst)
    return dst


def test_routes_prompts_as_validation_documents_were_routed(pipe, served_run):
    val = Run(served_run).prepared(routed=True).validation
    for text, stored in zip(val["text"], val["path"]):
        path, scores = pipe.route(text)
        assert path == stored
        assert len(scores) == pipe.num_paths == 4
        assert max(range(4), key=lambda p: scores[p]) == path


def test_per_request_features_equal_the_routers_batch_featurizer(pipe):
    batch = pipe.router.featurize(PROMPTS, model=pipe.featurizer_model, tokenizer=pipe.tokenizer, show_progress=False)
    for text, expected in zip(PROMPTS, batch):
        prefix = torch.tensor([pipe.encode(text)[: pipe.routing_prefix_tokens()]])
        features = lm_prefix_features(pipe.featurizer_model, pipe.router.featurizer, prefix, pipe.precision)
        assert torch.allclose(features[0], expected, atol=1e-6)


def test_concurrent_routes_equal_sequential_ones_bit_for_bit_and_are_counted(pipe):
    alone = [pipe.route(text) for text in PROMPTS * 4]
    requests, seconds = pipe.router_stats.requests, pipe.router_stats.pass_seconds
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(pipe.route, PROMPTS * 4))
    assert together == alone
    assert pipe.router_stats.requests - requests == 16 and pipe.router_stats.pass_seconds > seconds
    assert pipe.router_stats.request_seconds >= pipe.router_stats.pass_seconds


def test_greedy_generation_equals_hf_generate_on_the_composed_path(pipe):
    out = pipe.generate(PROMPTS[0], max_new_tokens=12)
    assert out.path == pipe.route(PROMPTS[0])[0] and out.scores is not None
    ids = pipe.encode(PROMPTS[0])
    assert out.prompt_tokens == len(ids) and 1 <= out.completion_tokens <= 12 and out.latency_ms > 0
    model = build_model(pipe.loaded.llama_config(), seed=0)
    pipe.bank.compose(out.path, model).eval()
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                         pad_token_id=pipe.tokenizer.pad_token_id, eos_token_id=pipe.tokenizer.eos_token_id)
    assert out.text == pipe.tokenizer.decode(ref[0, len(ids):], skip_special_tokens=True)
    assert pipe.generate(PROMPTS[0], max_new_tokens=12).text == out.text  # greedy is deterministic
    forced = pipe.generate(PROMPTS[0], max_new_tokens=6, path=3)
    assert forced.path == 3 and forced.scores is None


def test_seeded_sampling_reproduces_and_leaves_the_global_rng_alone(pipe):
    rng = torch.get_rng_state()
    a = pipe.generate(PROMPTS[1], max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    b = pipe.generate(PROMPTS[1], max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    c = pipe.generate(PROMPTS[1], max_new_tokens=16, temperature=1.0, seed=8)
    assert a.text == b.text and a.seed == 7
    assert c.text != a.text
    assert torch.equal(rng, torch.get_rng_state())
    unseeded = pipe.generate(PROMPTS[1], max_new_tokens=4, temperature=1.0)
    assert unseeded.seed is not None


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-12])
def test_a_tiny_temperature_samples_the_greedy_tokens(pipe, temperature):
    """T -> 0 is greedy decoding: a tiny positive temperature (issue 34: 1e-45 and 1e-300 raised NaN
    probabilities) samples exactly the greedy continuation, whatever the seed."""
    greedy = pipe.generate(PROMPTS[0], max_new_tokens=6)
    for seed in (0, 1):
        assert pipe.generate(PROMPTS[0], max_new_tokens=6, temperature=temperature, seed=seed).text == greedy.text


@pytest.mark.parametrize("temperature", [1e-3, 0.7, 1.0, 5.0, 100.0])
def test_sampling_works_across_the_temperature_range(pipe, temperature):
    out = pipe.generate(PROMPTS[1], max_new_tokens=6, temperature=temperature, top_p=0.9, top_k=20, seed=3)
    assert out.completion_tokens > 0 and isinstance(out.text, str)


def test_invalid_generation_arguments_are_clear_errors(pipe):
    for kwargs, match in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
                          (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(path=4), "0..3")]:
        with pytest.raises(DipacoError, match=match):
            pipe.generate(PROMPTS[0], **kwargs)
    with pytest.raises(DipacoError, match="empty"):
        pipe.generate("")


def test_path_cache_is_lru(served_run):
    pipe = Pipeline.from_run(served_run.run.dir, cache_size=2)
    for p in (0, 1, 0, 2):
        pipe.generate(PROMPTS[2], max_new_tokens=2, path=p)
    stats = pipe.cache.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 3, 1)
    assert stats["cached"] == [0, 2]


def test_experiment_choice_and_runs_without_a_router(served_run, tmp_path):
    run = copy_run(served_run, tmp_path)
    src = run / "train" / served_run.train.name
    iid = run / "train" / "iid_copy"
    shutil.copytree(src, iid)
    cfg_text = (iid / "config.yaml").read_text()
    (iid / "config.yaml").write_text(cfg_text.replace("sharding: kmeans", "sharding: iid"))
    spec_text = (iid / "experiment.json").read_text()  # what serving reads since issue 50: the experiment spec
    (iid / "experiment.json").write_text(spec_text.replace('"rule": "kmeans"', '"rule": "iid"'))
    with pytest.raises(DipacoError, match=f"--experiment: {served_run.train.name}, iid_copy"):
        Pipeline.from_run(run)
    with pytest.raises(DipacoError, match="no experiment 'nope'.*iid_copy"):
        Pipeline.from_run(run, experiment="nope")
    pipe = Pipeline.from_run(run, experiment="iid_copy")
    assert pipe.router is None
    with pytest.raises(DipacoError, match="no router"):
        pipe.route(PROMPTS[0])
    with pytest.raises(DipacoError, match="no router"):
        pipe.generate(PROMPTS[0])
    assert pipe.generate(PROMPTS[0], max_new_tokens=3, path=2).path == 2


def test_missing_or_bad_run_directories_fail_at_load(served_run, tmp_path):
    with pytest.raises(DipacoError, match="run directory not found"):
        Pipeline.from_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DipacoError, match="no trained experiment"):
        Pipeline.from_run(tmp_path / "empty")
    run = copy_run(served_run, tmp_path)
    shutil.rmtree(run / "routing" / "router")
    with pytest.raises(DipacoError, match="dipaco route"):
        Pipeline.from_run(run)
    ckpt = sorted((run / "train" / served_run.train.name / "checkpoints").iterdir())[-1]
    (ckpt / "bank.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="bank.safetensors"):
        Pipeline.from_run(run)


def test_generate_command(served_run, capsys):
    assert main(["generate", "--run", served_run.run.dir, PROMPTS[3], "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "path: " in out and "scores: " in out and f"text: {PROMPTS[3]}" in out
    assert main(["generate", "--run", served_run.run.dir, "x", "--path", "7"]) == 2
    assert "0..3" in capsys.readouterr().err
    assert main(["generate", "--run", "/nonexistent/run", "x"]) == 2
    assert "run directory not found" in capsys.readouterr().err


@pytest.mark.parametrize("featurizer", ["tfidf_svd", "doc_topics"])
def test_text_router_reads_only_the_routing_prefix(served_run, tmp_path, featurizer):
    """A text featurizer's router sees the first prefix_tokens tokens, as `dipaco route` gave it (doc_topics
    learned its word model from whole training documents, but routes the prefix too); re-routing eval runs too."""
    import shutil
    from dataclasses import replace

    from dipaco.run import Run

    cfg = replace(served_run, run=replace(served_run.run, dir=str(copy_run(served_run, tmp_path))),
                  route=replace(served_run.route, featurizer=featurizer, svd_components=8),
                  eval=replace(served_run.eval, max_docs=3))
    Run(cfg).route()
    # The experiment was trained on the LM-prefix routing, which serving now refuses: train it anew.
    shutil.rmtree(RunDir(cfg.run.dir).experiment(cfg.train.name))
    Run(cfg).train()
    pipe = Pipeline.from_run(cfg.run.dir)
    assert pipe.router.featurizer["kind"] == featurizer
    val = Run(cfg).prepared(routed=True).validation
    assert [pipe.route(t)[0] for t in val["text"]] == val["path"]
    report = Run(cfg).reroute_evaluate([32])
    assert report["featurizer"] == featurizer and report["results"][1]["decisions"] > 0


def test_a_damaged_experiment_record_is_one_error_line(served_run, tmp_path, capsys):
    """Issue 34: a truncated train/<name>/config.yaml, or garbage in routing.json, ended in a traceback.
    Since issue 50 serving reads the experiment spec (experiment.json), not config.yaml."""
    run = copy_run(served_run, tmp_path)
    exp_dir = RunDir(run).experiment(served_run.train.name)
    config = exp_dir / "experiment.json"
    config.write_text(config.read_text()[:200] + "\n  - [\n")
    assert main(["generate", "--run", str(run), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "experiment.json: not a valid experiment spec" in err and err.count("\n") == 1
    shutil.copy(Path(served_run.run.dir) / "train" / served_run.train.name / "experiment.json", config)
    (exp_dir / "routing.json").write_text("{garbage")
    assert main(["generate", "--run", str(run), "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "routing.json: unreadable" in err and err.count("\n") == 1


def test_a_one_path_experiment_needs_no_path(served_run, tmp_path):
    """Issue 34: a dense (one-path) experiment has no router, and generate asked for --path anyway."""
    run = copy_run(served_run, tmp_path)
    dense = replace(served_run, run=replace(served_run.run, dir=str(run)),
                    topology=replace(served_run.topology, preset="dense"),
                    train=replace(served_run.train, name="dense", sharding="iid", rounds=1))
    Run(dense).train()
    out = Pipeline.from_run(run, experiment="dense").generate(PROMPTS[0], max_new_tokens=3)
    assert out.path == 0 and out.scores is None and out.completion_tokens > 0


def test_concurrent_callers_share_at_most_tokenizer_copies(pipe):
    """Each tokenizer copy keeps a BPE word cache for its life: the pool, not the callers, bounds them (issue 62)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dipaco.serve.pipeline import TOKENIZER_COPIES

    callers, barrier = 4 * TOKENIZER_COPIES, threading.Barrier(4 * TOKENIZER_COPIES)
    expected = pipe.encode(PROMPTS[0] * 20)

    def call(i: int) -> list[int]:
        barrier.wait()  # every caller at once: without the bound, one copy each
        return pipe.encode(PROMPTS[0] * 20)

    with ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(call, range(callers)))
    assert all(r == expected for r in results)
    assert 1 <= pipe._tokenizer_copies <= TOKENIZER_COPIES and len(pipe._tokenizer_pool) == pipe._tokenizer_copies
