"""lm-evaluation-harness's ``local-completions`` model against the served tiny run, on two tasks defined
here (a task YAML and a local JSONL each): a multiple-choice task (loglikelihood requests) and a
``generate_until`` task. Its scores must be the routed model's own: every loglikelihood lm-eval reports
equals dipaco's scoring of the continuation on the path the whole text routes to, and every generation
equals the pipeline's greedy continuation. Nothing may leave the machine: the hub is offline and any
connection to a non-loopback address fails the test."""

import json
import socket
from pathlib import Path

import pytest
from test_serve import needs_web, running

from dipaco.model.scoring import Scoring, score_documents
from dipaco.serve.http import AppOptions, create_app
from dipaco.serve.pipeline import Pipeline

MC_DOCS = [
    {"text": "The striker scored twice in the", "choices": ["second half", "bank", "election"], "label": 0},
    {"text": "Shares in the bank rose after the", "choices": ["results", "goal", "film"], "label": 0},
    {"text": "The election campaign entered its final", "choices": ["week", "album", "match"], "label": 0},
]
GEN_DOCS = [
    {"text": "The government said on Tuesday that", "target": "the"},
    {"text": "The film won three", "target": "awards"},
]
GEN_TOKENS = 8


def write_tasks(root: Path, mc_docs: list[dict] = MC_DOCS, gen_docs: list[dict] = GEN_DOCS) -> Path:
    """Two lm-eval tasks over local JSONL files (``dataset_path: json``), in ``root``."""
    cache = root / "datasets_cache"
    for name, docs in (("mc", mc_docs), ("gen", gen_docs)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / '{name}.jsonl'}\n"
              f"  cache_dir: {cache}\ntest_split: test\n")
    (root / "dipaco_mc.yaml").write_text(
        "task: dipaco_mc\n" + common.replace("{name}", "mc") +
        'output_type: multiple_choice\ndoc_to_text: "{{text}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n')
    (root / "dipaco_gen.yaml").write_text(
        "task: dipaco_gen\n" + common.replace("{name}", "gen") +
        'output_type: generate_until\ndoc_to_text: "{{text}}"\ndoc_to_target: "{{target}}"\n'
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return root


@pytest.fixture
def offline(monkeypatch):
    """The hub offline, and any connection to an address other than loopback an error (nothing downloads)."""
    import datasets.config
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    attempts: list = []
    connect = socket.socket.connect

    def loopback_only(sock, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in ("127.0.0.1", "::1", "localhost") and sock.family != socket.AF_UNIX:
            attempts.append(address)
            raise OSError(f"test is offline: connection to {address} refused")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    yield attempts
    assert attempts == [], f"something tried to reach the network: {attempts}"


def test_lm_eval_scores_the_routed_model_through_completions(served_run, tmp_path, offline):
    needs_web()
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("openai")
    from lm_eval.tasks import TaskManager

    pipe = Pipeline.from_run(served_run.run.dir)
    tokenizer_dir = pipe.loaded.run.root / pipe.spec.tokenizer.dir
    tasks = TaskManager(include_path=str(write_tasks(tmp_path)), include_defaults=False)
    with running(create_app(pipe, AppOptions())) as port:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": pipe.experiment, "base_url": f"http://127.0.0.1:{port}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir), "tokenized_requests": True,
                        "max_length": pipe.spec.seq_len, "max_gen_toks": GEN_TOKENS, "max_retries": 1},
            tasks=["dipaco_mc", "dipaco_gen"], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    check_scores(pipe, out, MC_DOCS, GEN_DOCS)


def check_scores(pipe: Pipeline, out: dict, mc_docs: list[dict], gen_docs: list[dict]) -> None:
    """lm-eval's results are the served model's own: every loglikelihood dipaco's scoring of the continuation
    on the path the whole text routes to, every generation the pipeline's greedy continuation."""
    results, samples = out["results"], out["samples"]
    assert results["dipaco_mc"]["sample_len"] == len(mc_docs) and 0.0 <= results["dipaco_mc"]["acc,none"] <= 1.0
    assert results["dipaco_gen"]["sample_len"] == len(gen_docs) and 0.0 <= results["dipaco_gen"]["exact_match,none"] <= 1.0

    # Every loglikelihood: dipaco's own score of the continuation's tokens (the context as unscored prefix) on
    # the path the whole text routes to, in one window of the served positions. lm-eval put its target
    # delimiter (" ") before each choice.
    positions = pipe.spec.served_positions().limit
    checked = 0
    for sample in samples["dipaco_mc"]:
        for (context, continuation), [(loglik, _greedy)] in zip(sample["arguments"], sample["resps"]):
            ctx, cont = pipe.encode(context), pipe.encode(continuation)
            whole = ctx + cont
            path = pipe.plan("", ids=whole, max_new_tokens=1).path
            scores = score_documents(pipe.cache.get(path).model, [whole],
                                     Scoring(positions, len(ctx), 1, pipe.tokenizer.pad_token_id))
            assert loglik == pytest.approx(-float(scores.nll[0]), abs=1e-3)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in mc_docs)

    # Every generation: the pipeline's greedy continuation of the context, cut at the task's "until".
    for sample in samples["dipaco_gen"]:
        [(context, _)] = sample["arguments"]
        expected = pipe.generate(context, max_new_tokens=GEN_TOKENS).text.split("\n")[0]
        assert sample["resps"] == [[expected]]


def long_documents(pipe: Pipeline) -> tuple[list[dict], list[dict]]:
    """MC_DOCS and GEN_DOCS, each context after a passage of their own sentences that makes it 2 to 3 times as
    long as the run's data.seq_len."""
    seq_len = pipe.spec.seq_len
    passage = pipe.decode(pipe.encode(" ".join(d["text"] for d in MC_DOCS + GEN_DOCS) * 8)[: 2 * seq_len]) + " "
    mc = [{**d, "text": passage + d["text"]} for d in MC_DOCS]
    gen = [{**d, "text": passage + d["text"]} for d in GEN_DOCS]
    assert all(seq_len < len(pipe.encode(d["text"])) < 3 * seq_len for d in mc + gen)
    return mc, gen


def test_lm_eval_with_its_default_lengths_on_documents_longer_than_seq_len(imported_run, tmp_path, offline):
    """An imported run trained at data.seq_len=64 serves its checkpoint's 2048 positions, which lm-eval's
    default max_length (2048) fits: lm-eval runs with no length given, on contexts longer than data.seq_len
    (before issue 76 the server refused each, and lm-eval retried, then crashed)."""
    needs_web()
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("openai")
    from lm_eval.tasks import TaskManager

    pipe = Pipeline.from_run(imported_run.run.dir)
    mc_docs, gen_docs = long_documents(pipe)
    tokenizer_dir = pipe.loaded.run.root / pipe.spec.tokenizer.dir
    tasks = TaskManager(include_path=str(write_tasks(tmp_path, mc_docs, gen_docs)), include_defaults=False)
    with running(create_app(pipe, AppOptions())) as port:
        out = lm_eval.simple_evaluate(
            model="local-completions",  # no max_length, max_gen_toks or max_retries: lm-eval's own
            model_args={"model": pipe.experiment, "base_url": f"http://127.0.0.1:{port}/v1/completions",
                        "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir)},
            tasks=["dipaco_mc", "dipaco_gen"], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    check_scores(pipe, out, mc_docs, gen_docs)
