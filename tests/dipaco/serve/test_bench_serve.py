"""bench/serve.py's serving parts (``python -m bench serve``), briefly, on the tiny run: concurrency (unbatched,
per-path, module-batched and pinned servers), agreement (batched against alone), held connections, APIs and soak.

Here rather than in tests/bench/: the tiny served run (``served_run``) is a fixture of tests/dipaco/conftest.py."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_serve import PROMPTS, needs_web

from bench import serve as bench
from dipaco.serve.pipeline import Pipeline


def test_concurrency_measures_every_server_mode_from_its_metrics(served_run):
    needs_web()
    routed = [Pipeline.from_run(served_run.run.dir).route(p)[0] for p in PROMPTS]
    out = bench.bench_concurrency(Path(served_run.run.dir), None, PROMPTS, clients=4, seconds=1.0, warmup_s=0.3,
                                  new_tokens=6, threads=1, max_batch=8, batch_wait_ms=20,
                                  modes=tuple(bench.SERVER_MODES), routed_paths=routed, rounds=2)
    unbatched, path, module, named, pinned = (out[m] for m in ("unbatched", "path", "module", "named", "pinned"))
    assert unbatched["mean_batch_size"] == 1.0 and unbatched["server_flags"].startswith("--max-batch 1 ")
    assert path["mean_batch_size"] > 1.0 and module["mean_batch_size"] > 1.0  # 4 clients, a 20 ms window
    assert "--batching path" in path["server_flags"] and "--batching module" in module["server_flags"]
    assert "rows_per_module" not in path and module["rows_per_module"] > 1.0
    # a pinned load runs every module of its path on every row; a routed one splits rows between a level's modules
    assert pinned["rows_per_module"] == pytest.approx(pinned["mean_batch_size"])
    assert set(module["module_time_share"]) == {"embed", "mask", "layout", "blocks", "head"}
    assert (module["paths"], named["paths"], pinned["paths"]) == ("routed", "named", "pinned")
    assert sum(module["module_time_share"].values()) == pytest.approx(1.0)
    inline = out["inline"]
    assert "--no-router-process" in inline["server_flags"] and "--no-router-process" not in module["server_flags"]
    for row in (module, inline):  # routed by the server: its router's passes, each scoring one or more prompts
        assert row["router"]["prompts_per_pass"] >= 1.0 and row["router"]["request_ms"] > 0
    assert "router" not in named and "router" not in pinned
    for row in (unbatched, path, module, inline, named, pinned):
        assert row["requests"] > 4 and row["tokens"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
        assert set(row["statuses"]) == {"200"} and row["batches"] >= 1
        assert row["server_cores"] > 0.05
    assert out["rounds"] == 2 and out["client_cores"] > 0
    assert out["ratios"]["module_vs_unbatched"] > 0 and set(out["targets"]) == {
        "module_ge_3x_unbatched", "module_ge_0.8_of_pinned", "named_ge_0.8_of_pinned", "module_p99_no_worse_than_path"}


def test_placement_puts_servers_routers_and_clients_on_their_cpus(served_run):
    needs_web()
    last = max(os.sched_getaffinity(0))
    with bench.dipaco_serve(Path(served_run.run.dir), None, 1, extra_args=("--router-cpus", str(last)),
                            cpus=(0,)) as (_, server):
        assert os.sched_getaffinity(server.pid) == {0}
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        # the router process where it was put (multiprocessing's resource tracker, if started, stays with the server)
        assert {last} in [os.sched_getaffinity(int(child)) for child in children]
    # dipaco serve's default (--router-cpus auto): the router process on the last CPU, the server moved off it
    allowed = os.sched_getaffinity(0)
    with bench.dipaco_serve(Path(served_run.run.dir), None, None) as (_, server):
        seen = bench.affinities(server.pid)
        if len(allowed) >= 2:
            assert seen["server"] == sorted(allowed - {last}) and [last] in seen["children"]
        else:
            assert seen["server"] == sorted(allowed)
    with bench.dipaco_serve(Path(served_run.run.dir), None, 1, extra_args=("--router-cpus", "none")) as (_, server):
        seen = bench.affinities(server.pid)
        assert seen["server"] == sorted(allowed) and seen["children"] and all(c == sorted(allowed) for c in seen["children"])
    before = os.sched_getaffinity(0)
    with bench.running_on((last,)):
        assert os.sched_getaffinity(0) == {last}
    assert os.sched_getaffinity(0) == before
    placement = bench.Placement(server=(0,), router=(last,), clients=(last,))
    out = bench.bench_concurrency(Path(served_run.run.dir), None, PROMPTS, clients=2, seconds=0.5, warmup_s=0.2,
                                  new_tokens=4, threads=1, max_batch=4, batch_wait_ms=5, modes=("module", "inline"),
                                  placement=placement)
    assert out["cpus"] == {"server": [0], "router": [last], "clients": [last]}
    assert out["module"]["cpus_seen"] == {"server": [0], "children": out["module"]["cpus_seen"]["children"]}
    assert [last] in out["module"]["cpus_seen"]["children"]
    assert f"--router-cpus {last}" in out["module"]["server_flags"] and "--router-cpus" not in out["inline"]["server_flags"]
    assert out["module"]["requests"] > 0 and out["inline"]["requests"] > 0


def test_agreement_compares_batched_and_lone_decoding(served_run):
    pipe = Pipeline.from_run(served_run.run.dir)
    out = bench.bench_agreement(pipe, PROMPTS, new_tokens=6, max_batch=4)
    for mode in ("greedy", "seeded"):
        for batching in ("path", "module"):
            result = out[mode][batching]
            assert result["equal"] + len(result["differ"]) == len(PROMPTS)
            assert result["mean_batch_size"] > 1.0
        assert out[mode]["module"]["equal"] == len(PROMPTS)
    assert out["targets"] == {"path_greedy_ge_99pct": True, "module_greedy_ge_99pct": True}


def test_held_connections_do_not_keep_a_valid_request_waiting(served_run):
    needs_web()
    # A valid request 0.25 s after each answer: 4 s hold 4 or more up to about 0.75 s a request (a loaded 2-core CPU
    # gave 0.2 s on average, 0.67 s at most).
    out = bench.bench_hold_idle(Path(served_run.run.dir), None, PROMPTS, n=150, nofile=128, seconds=4.0, threads=1)
    held = out["held_connections"]
    assert held["opened"] >= 150 and held["closed_by_server"] > 0 and out["server_closed"].get("evicted", 0) > 0
    assert out["valid"]["n"] >= 4 and out["valid"]["failures"] == {}
    # Not kept waiting for a held place, which the server's 5 s header deadline would free: most answers in well
    # under a second and none near 5 s. The benchmark's own target (every one within 1 s) is a figure of the
    # machine's load, reported here, not asserted.
    assert out["valid"]["p50_ms"] < 1000 and out["valid"]["max_ms"] < 4000
    assert "every_valid_request_within_1s" in out["targets"]
    assert out["server_descriptors_max"] < 128


def test_apis_drive_one_load_through_generate_and_completions(served_run):
    needs_web()
    experiment = Pipeline.from_run(served_run.run.dir).experiment
    out = bench.bench_apis(Path(served_run.run.dir), experiment, PROMPTS, clients=4, seconds=1.5, warmup_s=0.2,
                           new_tokens=6, threads=1, max_batch=8, batch_wait_ms=5, rounds=3)
    for name in ("generate", "completions", "completions_stream"):
        row = out[name]
        assert row["statuses"] == {"200": row["requests"]} and row["requests"] > 4, (name, row)
        assert row["tokens"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0
    for name in ("completions", "completions_stream"):
        assert out[name]["throughput_vs_generate"] > 0 and out[name]["p99_vs_generate"] > 0
    assert set(out["targets"]) == {"completions_within_10pct", "completions_stream_within_10pct"}


def test_the_soak_traffic_is_as_varied_as_users_send(served_run):
    """Issue 76: the soak's narrow load (one API, short sampled prompts) hid a leak that varied traffic showed."""
    pipe = Pipeline.from_run(served_run.run.dir)
    traffic = bench.VariedTraffic.of(pipe, new_tokens=8)
    rng = np.random.default_rng(0)
    drawn = [(endpoint, json.loads(body)) for endpoint, body in (traffic.draw(rng) for _ in range(400))]
    streamed = [b for e, b in drawn if b.get("stream")]
    assert {e for e, _ in drawn} == {"/v1/generate", "/v1/completions"} and 80 < len(streamed) < 200
    assert all(b["stream_options"] == {"include_usage": True} for b in streamed)
    sampled = [b for _, b in drawn if b["temperature"] > 0]
    assert 120 < len(sampled) < 280 and len({b["seed"] for b in sampled}) == len(sampled)
    assert any(b.get("stop") for _, b in drawn)
    lengths = [len(pipe.encode(b["prompt"])) for _, b in drawn]
    positions = pipe.spec.served_positions().limit
    assert min(lengths) <= 3 and max(lengths) >= positions * 0.7  # across the whole cap
    new = [b.get("max_new_tokens", b.get("max_tokens")) for _, b in drawn]
    assert min(new) == 1 and max(new) == 8
    assert all(n + m <= positions for n, m in zip(lengths, new))  # what the server accepts


def test_soak_samples_memory_descriptors_and_latency_over_time(served_run):
    needs_web()
    traffic = bench.VariedTraffic.of(Pipeline.from_run(served_run.run.dir), new_tokens=4)
    out = bench.bench_soak(Path(served_run.run.dir), None, traffic, clients=3, seconds=3.0, window_s=1.0, settle_s=1.0,
                           sample_s=0.3, threads=1, max_batch=8, batching="path")
    assert out["server_flags"] == "--max-batch 8 --batching path"
    t, rss, fds, tree = (out["samples"][k] for k in ("t_s", "rss_mb", "fds", "tree_rss_mb"))
    # sampled over the whole run: up to the load's end, less a sample's own time (it samples every 0.3 s plus that
    # time, which a loaded machine lengthens, until 0.3 s after the load; a last sample past 3.0 s held by tens of ms)
    assert len(t) >= 5 and all(b > a for a, b in zip(t, t[1:])) and t[-1] >= out["windows"][-1]["end_s"] - 0.3
    assert min(rss) > 10 and min(fds) > 0 and out["fds"]["max"] >= out["fds"]["min"] > 0
    assert all(whole >= server for whole, server in zip(tree, rss))  # the server and its router process
    assert len(out["windows"]) >= 2 and all(w["requests"] > 0 for w in out["windows"])
    assert all(w["p99_ms"] >= w["p50_ms"] > 0 for w in out["windows"])
    assert out["responses_500"] == 0 and set(out["statuses"]) == {"200"} and out["answers"] > 0
    for key in ("rss_mb", "server_rss_mb"):
        assert out[key]["slope_mb_per_min_after_settle"] is not None and out[key]["peak"] >= out[key]["end"]
    assert set(out["targets"]) == {"rss_growth_after_settle_le_2pct", "p99_within_20pct_of_first_window", "no_500"}


def test_the_command_line_runs_parts_1_to_3_into_one_report(served_run, tmp_path, capsys):
    needs_web()
    path = tmp_path / "serve.json"
    argv = ["--run", str(served_run.run.dir), "--prompts", "3", "--warmup", "1", "--prompt-tokens", "8",
            "--new-tokens", "4", "--clients", "1,2", "--requests", "2", "--out", str(path)]
    assert bench.main(argv) == 0
    report = json.loads(path.read_text())
    assert report["command"] == "python -m bench serve " + " ".join(argv)
    assert report["environment"]["device"].startswith("cpu") and report["run"]["params_per_path"] > 0
    single = report["single_path"]
    assert single["pipeline"]["n"] == single["dense"]["n"] == single["route_only"]["n"] == 3
    assert single["ratio_p50"] > 0 and sum(single["paths_used"]) == 3
    # part 3: a fixed number of requests per client, every one answered
    assert [(r["clients"], r["requests"], r["statuses"]) for r in report["http"]["runs"]] == [
        (1, 2, {"200": 2}), (2, 4, {"200": 4})]
    printed = capsys.readouterr().out
    assert "| generate 4 tokens | p50 ms |" in printed and "| dipaco serve, clients |" in printed


def test_a_bad_mode_fails_before_any_run_is_built(tmp_path):
    with pytest.raises(SystemExit, match="--modes: fast: choose from unbatched, path, module, inline, named, pinned"):
        bench.main(["--run", str(tmp_path / "none"), "--concurrency", "2", "--modes", "module,fast"])
    assert not (tmp_path / "none").exists()


def test_a_bad_cpu_list_is_one_line_before_any_server_starts():
    """`python -m bench serve` turns a DipacoError from its options into one line and status 2."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "bench", "serve", "--run", "no_such_run", "--concurrency", "2",
                           "--server-cpus", str(os.cpu_count())], cwd=Path(bench.__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"python -m bench serve: error: --server-cpus '{os.cpu_count()}': this machine has CPUs 0-{os.cpu_count() - 1}"]
