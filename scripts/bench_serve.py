"""Inference cost of DiPaCo single-path serving.

1. **One routed path vs a dense model.** ``Pipeline.generate`` (tokenize, route the prompt with the
   router's featurizer, fetch the composed path from the LRU cache, HF ``generate``, decode)
   against a dense ``LlamaForCausalLM`` of the same size called directly (tokenize, ``generate``,
   decode; no routing). Both greedy, exactly ``--new-tokens`` tokens (EOS suppressed), alternating
   A B / B A per prompt in one process, so load from other processes hits both alike.
   Target: pipeline p50 <= 1.1x dense p50.
2. **Every path per prompt**, what a prompt costs without a router: compose each path into a model
   and generate with it.
3. **Throughput over HTTP**: ``dipaco serve`` in a subprocess on loopback, N concurrent clients
   (threads, one connection per request) each sending ``--requests`` generate requests.

With no ``--run`` it builds a small run first (configs/demo.yaml: BBC News, 4-layer d=128 paths,
2x2 grid, LM-prefix k-means routing) with few training steps: quality is irrelevant to latency.

    python scripts/bench_serve.py --out bench_serve.json
    python scripts/bench_serve.py --run runs/demo --experiment dipaco_2x2
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="run directory; built there first when it has no trained experiment "
                                  "(default: build a small one in a temp dir)")
    p.add_argument("--experiment", help="experiment name when the run has several")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=40, help="timed prompts for parts 1 and 2")
    p.add_argument("--prompt-tokens", type=int, default=48, help="prompts are validation texts cut to this many tokens")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--clients", default="1,2,4,8", help="concurrent HTTP clients to measure")
    p.add_argument("--requests", type=int, default=8, help="requests per client")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args()


def build_run(run_dir: Path) -> Path:
    """prepare -> pretrain -> route -> train (1 round of 5 steps) on the demo config."""
    from dipaco.config import load_config
    from dipaco.eval.evaluate import evaluate_experiment
    from dipaco.data.prepare import prepare
    from dipaco.train.pretrain import pretrain
    from dipaco.route.assign import route
    from dipaco.runtime import quiet_library_progress_bars
    from dipaco.train.loop import train

    quiet_library_progress_bars()
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"run.dir={run_dir}", "run.progress=false", "pretrain.steps=30", "train.rounds=1", "train.inner_steps=5",
    ])
    for job in (prepare, pretrain, route, train, evaluate_experiment):
        start = time.perf_counter()
        job(cfg)
        print(f"[bench] {job.__name__}: {time.perf_counter() - start:.1f}s", flush=True)
    return Path(cfg.run.dir)


def percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean()), "n": int(a.size)}


def prompts_from_run(pipe, n: int, n_tokens: int) -> list[str]:
    from dipaco.data.prepare import load_prepared

    val = load_prepared(pipe.cfg).validation
    ids = [d[:n_tokens] for d in val["input_ids"] if len(d) >= n_tokens]
    return [pipe.decode(d) for d in ids[:n]]


def bench_latency(pipe, prompts: list[str], new_tokens: int, warmup: int) -> dict:
    """Parts 1 and 2, interleaved per prompt in rotating order: routed pipeline, dense model, every path."""
    import copy
    import itertools

    tok = pipe.tokenizer
    dense = copy.deepcopy(pipe.cache.template)  # same shape; its own (untrained) weights: the compute is the same
    every = copy.deepcopy(pipe.cache.template)  # recomposed for each path in turn
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def generate(model, ids: torch.Tensor) -> None:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert out.shape[1] - ids.shape[1] == new_tokens

    def run_dense(prompt: str) -> float:
        start = time.perf_counter()
        generate(dense, torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]]))
        return (time.perf_counter() - start) * 1000

    def run_pipeline(prompt: str) -> float:
        start = time.perf_counter()
        result = pipe.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        assert result.completion_tokens == new_tokens
        return (time.perf_counter() - start) * 1000

    def run_all_paths(prompt: str) -> float:
        start = time.perf_counter()
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        for p in range(pipe.num_paths):
            pipe.bank.load_path(p, every)
            generate(every, ids)
        return (time.perf_counter() - start) * 1000

    def run_route(prompt: str) -> float:
        start = time.perf_counter()
        pipe.route(prompt)
        return (time.perf_counter() - start) * 1000

    sides = {"pipeline": run_pipeline, "dense": run_dense, "all_paths": run_all_paths}
    for p in range(pipe.num_paths):  # fill the cache: part 1 measures the hot path
        pipe.cache.get(p)
    for prompt in prompts[:warmup]:
        for run in sides.values():
            run(prompt)
    times: dict[str, list[float]] = {k: [] for k in [*sides, "route_only"]}
    cpu: dict[str, list[float]] = {k: [] for k in sides}  # process CPU time: less sensitive to other load
    orders = itertools.cycle(list(itertools.permutations(sides)))
    paths = []
    for prompt in prompts[warmup:]:
        for side in next(orders):
            start_cpu = time.process_time()
            times[side].append(sides[side](prompt))
            cpu[side].append((time.process_time() - start_cpu) * 1000)
        times["route_only"].append(run_route(prompt))
        paths.append(pipe.route(prompt)[0])
    out = {k: percentiles(v) for k, v in times.items()}
    for k in sides:
        out[k]["cpu_p50_ms"] = float(np.median(cpu[k]))
    # Per prompt, the pipeline and the dense model ran back to back: the median of those paired
    # ratios is robust to load that drifts over the run.
    out["paired_ratio_median"] = float(np.median(np.array(times["pipeline"]) / np.array(times["dense"])))
    out["cpu_ratio_p50"] = out["pipeline"]["cpu_p50_ms"] / out["dense"]["cpu_p50_ms"]
    for k in ("pipeline", "dense"):
        out[k]["tokens_per_s"] = new_tokens / (out[k]["p50_ms"] / 1000)
    out["all_paths"]["paths"] = pipe.num_paths
    out["all_paths"]["tokens_per_s_per_prompt"] = new_tokens / (out["all_paths"]["p50_ms"] / 1000)
    out["ratio_p50"] = out["pipeline"]["p50_ms"] / out["dense"]["p50_ms"]
    out["ratio_mean"] = out["pipeline"]["mean_ms"] / out["dense"]["mean_ms"]
    out["all_paths_ratio_p50"] = out["all_paths"]["p50_ms"] / out["pipeline"]["p50_ms"]
    out["paths_used"] = np.bincount(paths, minlength=pipe.num_paths).tolist()
    out["cache"] = pipe.cache.stats()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
        return data
    finally:
        conn.close()


def bench_http(run: Path, experiment: str | None, prompts: list[str], new_tokens: int, clients: list[int],
               requests: int, threads: int | None) -> dict:
    """Part 3: `dipaco serve` in a subprocess; N concurrent clients."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dipaco", "serve", "--run", str(run), "--port", str(port), "--cache-size", "16"]
    if experiment:
        cmd += ["--experiment", experiment]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"dipaco serve exited: {server.stderr.read().decode()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("dipaco serve did not come up")
            time.sleep(0.5)
        for prompt in prompts[:8]:  # warm up every path the prompts route to
            _post(port, {"prompt": prompt, "max_new_tokens": new_tokens})
        results = []
        for n in clients:
            latencies, tokens = [], []
            lock = threading.Lock()

            def client(c: int) -> None:
                for r in range(requests):
                    prompt = prompts[(c * requests + r) % len(prompts)]
                    start = time.perf_counter()
                    reply = _post(port, {"prompt": prompt, "max_new_tokens": new_tokens})
                    with lock:
                        latencies.append((time.perf_counter() - start) * 1000)
                        tokens.append(reply["completion_tokens"])

            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n) as pool:
                list(pool.map(client, range(n)))
            wall = time.perf_counter() - start
            row = {"clients": n, "requests": len(latencies), "wall_s": wall, "requests_per_s": len(latencies) / wall,
                   "tokens_per_s": sum(tokens) / wall, **percentiles(latencies)}
            results.append(row)
            print(f"[bench] http clients={n}: {row['requests_per_s']:.2f} req/s, {row['tokens_per_s']:.0f} tok/s, "
                  f"p50 {row['p50_ms']:.0f} ms", flush=True)
        return {"port": port, "runs": results}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dipaco.serve.pipeline import Pipeline

    tmp = None
    if args.run:
        run = Path(args.run)
        if not any((run / "train").glob("*/config.yaml")):
            build_run(run)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_serve_")
        run = build_run(Path(tmp.name) / "run")
    try:
        pipe = Pipeline.from_run(run, experiment=args.experiment, cache_size=64)
        prompts = prompts_from_run(pipe, args.prompts + args.warmup, args.prompt_tokens)
        timed = prompts[args.warmup:] or prompts
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        params = sum(p.numel() for p in pipe.cache.template.parameters())
        print(f"[bench] {pipe.experiment} {pipe.checkpoint}: {pipe.topology.describe()}, {params:,} params/path, "
              f"router {pipe.router.kind if pipe.router else None}; {len(timed)} prompts of {args.prompt_tokens} tokens, "
              f"{args.new_tokens} new tokens; torch threads {torch.get_num_threads()}; load avg {load}", flush=True)
        latency = bench_latency(pipe, prompts[: args.warmup] + timed, args.new_tokens, args.warmup)
        http = None
        if not args.skip_http:
            http = bench_http(run, pipe.experiment, timed, args.new_tokens, [int(c) for c in args.clients.split(",")],
                              args.requests, args.threads)
        report = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                        "torch_threads": torch.get_num_threads(), "load_avg_1m_at_start": load},
            "run": {"experiment": pipe.experiment, "checkpoint": pipe.checkpoint, "topology": pipe.topology.describe(),
                    "params_per_path": params, "router": pipe.router.kind if pipe.router else None},
            "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
            "single_path": latency, "http": http,
        }
        print_table(report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
            print(f"[bench] wrote {args.out}")
    finally:
        if tmp is not None:
            tmp.cleanup()


def print_table(r: dict) -> None:
    s = r["single_path"]
    a = s["all_paths"]
    print()
    print(f"{'generate ' + str(r['new_tokens']) + ' tokens':<42} {'p50 ms':>9} {'p99 ms':>9} {'tok/s (p50)':>12} {'vs dense':>9}")
    rows = [("dense LlamaForCausalLM.generate (no routing)", s["dense"], s["dense"]["tokens_per_s"]),
            ("Pipeline: route + cached path + generate", s["pipeline"], s["pipeline"]["tokens_per_s"]),
            (f"every path per prompt ({a['paths']} compose+generate)", a, a["tokens_per_s_per_prompt"])]
    for name, row, tps in rows:
        print(f"{name:<42} {row['p50_ms']:>9.1f} {row['p99_ms']:>9.1f} {tps:>12.0f} "
              f"{row['p50_ms'] / s['dense']['p50_ms']:>8.2f}x")
    print(f"{'  of which routing alone':<42} {s['route_only']['p50_ms']:>9.1f} {s['route_only']['p99_ms']:>9.1f}")
    print(f"pipeline / dense: p50 {s['ratio_p50']:.3f}x, mean {s['ratio_mean']:.3f}x, median of paired ratios "
          f"{s['paired_ratio_median']:.3f}x, CPU time p50 {s['cpu_ratio_p50']:.3f}x (target <= 1.1x); "
          f"paths used {s['paths_used']}")
    if r["http"]:
        print()
        print(f"{'dipaco serve, clients':<22} {'req/s':>8} {'tok/s':>8} {'p50 ms':>9} {'p99 ms':>9}")
        for row in r["http"]["runs"]:
            print(f"{row['clients']:<22} {row['requests_per_s']:>8.2f} {row['tokens_per_s']:>8.0f} "
                  f"{row['p50_ms']:>9.1f} {row['p99_ms']:>9.1f}")


if __name__ == "__main__":
    main()
