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

4. **Abuse** (``--abuse``, alone): ``dipaco serve`` on loopback and ``--abuse-clients`` clients for
   ``--seconds`` mixing small valid requests with invalid ones: bodies far over the size limit
   (50 MB with Content-Length, 10 MB chunked), 10 MB ``/v1/route`` bodies, prompts over the
   character and token caps, NaN/Infinity numbers, malformed JSON, unknown fields, broken Unicode,
   too many new tokens. Records requests, status codes per kind, dropped connections (no HTTP
   answer), p50/p99 latency of the small valid requests (all, and those sent while a large invalid
   request was in flight), and the server's RSS (``/proc/PID/status``) before and after.
   Targets: 0 responses of 500, 0 dropped connections, that p99 <= 2 s, RSS growth <= 10%.

With no ``--run`` it builds a small run first (configs/demo.yaml: BBC News, 4-layer d=128 paths,
2x2 grid, LM-prefix k-means routing) with few training steps: quality is irrelevant to latency.

    python scripts/bench_serve.py --out bench_serve.json
    python scripts/bench_serve.py --run runs/demo --experiment dipaco_2x2
    python scripts/bench_serve.py --abuse --seconds 60 --out bench_serve_abuse.json
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections import Counter
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
    p.add_argument("--abuse", action="store_true", help="run only the abuse benchmark (part 4)")
    p.add_argument("--seconds", type=float, default=60.0, help="abuse: how long the clients send")
    p.add_argument("--abuse-clients", type=int, default=8, help="abuse: concurrent clients")
    p.add_argument("--abuse-control", action="store_true",
                   help="abuse: first the same clients for --seconds with only the small valid requests (a fresh server)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args()


def build_run(run_dir: Path) -> Path:
    """prepare -> pretrain -> route -> train (1 round of 5 steps) on the demo config."""
    from dipaco.run import Run, load_config
    from dipaco.runtime import quiet_library_progress_bars

    quiet_library_progress_bars()
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"run.dir={run_dir}", "run.progress=false", "pretrain.steps=30", "train.rounds=1", "train.inner_steps=5",
        # the path size the recorded figures used (the demo's own paths are smaller since issue 34)
        "model.num_layers=4", "model.hidden_size=128", "model.intermediate_size=384", "model.num_heads=4",
    ])
    run = Run(cfg)
    for job in (run.prepare, run.pretrain, run.route, run.train, run.evaluate):
        start = time.perf_counter()
        job()
        print(f"[bench] {job.__name__}: {time.perf_counter() - start:.1f}s", flush=True)
    return Path(cfg.run.dir)


def percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean()), "n": int(a.size)}


def prompts_from_run(pipe, n: int, n_tokens: int) -> list[str]:
    from dipaco.run import Run

    val = Run(pipe.cfg).prepared().validation
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
    with dipaco_serve(run, experiment, threads) as (port, _):
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


@contextlib.contextmanager
def dipaco_serve(run: Path, experiment: str | None, threads: int | None, cache_size: int = 16):
    """`dipaco serve` in a subprocess on a free loopback port, up and healthy; yields (port, process)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dipaco", "serve", "--run", str(run), "--port", str(port),
           "--cache-size", str(cache_size), "--host", "127.0.0.1"]
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
        yield port, server
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


# --- part 4: abuse ----------------------------------------------------------------------------------
MB = 1024 * 1024
LARGE_KINDS = ("body_50mb", "chunked_10mb", "route_10mb")  # the large invalid requests


def rss_kb(pid: int) -> dict:
    """VmRSS (now) and VmHWM (peak) of a process, in kB, from /proc/PID/status (Linux)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def abuse_requests(prompt: str, caps: dict) -> dict:
    """Per kind: (path, body: bytes or an iterable of chunks for a chunked body, expected statuses)."""
    max_chars = caps["max_prompt_chars"]
    seq_len = caps["seq_len"]
    huge = json.dumps({"prompt": "The economy grew. " * (50 * MB // 18)}).encode()  # ~50 MB with Content-Length
    chunked = json.dumps({"prompt": "word " * (10 * MB // 5)}).encode()  # ~10 MB, sent in 64 kB chunks
    route_huge = json.dumps({"text": "Shares in the bank rose. " * (10 * MB // 25)}).encode()
    j = lambda d: json.dumps(d).encode()  # noqa: E731
    return {
        "valid_generate": ("/v1/generate", j({"prompt": prompt, "max_new_tokens": 8}), {200}),
        "valid_route": ("/v1/route", j({"text": prompt}), {200}),
        "body_50mb": ("/v1/generate", huge, {413}),
        "chunked_10mb": ("/v1/generate", lambda: (chunked[i:i + 65536] for i in range(0, len(chunked), 65536)), {413}),
        "route_10mb": ("/v1/route", route_huge, {413}),
        "prompt_over_chars": ("/v1/generate", j({"prompt": "x" * (max_chars + 1)}), {422}),
        "prompt_over_tokens": ("/v1/generate", j({"prompt": " x" * (caps["max_prompt_tokens"] + 1)}), {422}),
        "too_many_new_tokens": ("/v1/generate", j({"prompt": prompt, "max_new_tokens": seq_len}), {422}),
        "nan_temperature": ("/v1/generate", b'{"prompt": "hello", "temperature": NaN}', {422}),
        "tiny_temperature": ("/v1/generate", j({"prompt": prompt, "max_new_tokens": 4, "temperature": 1e-45}), {200}),
        "denormal_temperature": ("/v1/generate", j({"prompt": prompt, "max_new_tokens": 4, "temperature": 5e-324}), {200}),
        "inf_top_p": ("/v1/generate", b'{"prompt": "hello", "top_p": Infinity}', {422}),
        "inf_max_new_tokens": ("/v1/generate", b'{"prompt": "hello", "max_new_tokens": -Infinity}', {422}),
        "overflow_seed": ("/v1/generate", b'{"prompt": "hello", "temperature": 1, "seed": 1e999}', {422}),
        "nan_unknown_field": ("/v1/generate", b'{"prompt": "hello", "bogus": NaN}', {422}),
        "malformed_json": ("/v1/generate", b'{"prompt": "hello",', {422}),
        "unknown_field": ("/v1/generate", j({"prompt": "hello", "max_tokens": 4}), {422}),
        "lone_surrogate": ("/v1/generate", b'{"prompt": "hi \\ud800"}', {422}),
        "route_nan": ("/v1/route", b'{"text": NaN}', {422}),
    }


def _send(port: int, path: str, body, timeout: float) -> int:
    """The status of one POST on a fresh connection; raises OSError/HTTPException when there is no answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if callable(body):  # chunked: no Content-Length
            conn.request("POST", path, body=body(), headers=headers, encode_chunked=True)
        else:
            conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def bench_abuse(run: Path, experiment: str | None, prompts: list[str], clients: int, seconds: float,
                threads: int | None, invalid: bool = True) -> dict:
    """Part 4: mixed valid and invalid requests from ``clients`` clients for ``seconds``.

    With ``invalid=False`` (the control) the same clients send only the small valid requests: the
    latency the machine gives them without abuse."""
    with dipaco_serve(run, experiment, threads, cache_size=4) as (port, server):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/healthz")
        caps = json.loads(conn.getresponse().read())
        conn.close()
        kinds = abuse_requests(prompts[0], caps)
        small = [json.dumps({"prompt": p, "max_new_tokens": 8}).encode() for p in prompts]
        for body in small[:16]:  # warm up: every path composed, every thread's tokenizer copied
            _send(port, "/v1/generate", body, 60)
        rss_before = rss_kb(server.pid)
        # Each client cycles through this schedule, from its own offset: half of the requests are small
        # valid ones, the rest every invalid kind once per cycle (the large ones included).
        bad = [k for k in kinds if not k.startswith("valid_")]
        schedule = []
        for k in bad:
            schedule += [k if invalid else "valid_generate", "valid_generate" if len(schedule) % 4 else "valid_route"]
        lock = threading.Lock()
        statuses: dict[str, Counter] = {k: Counter() for k in kinds}
        dropped: Counter = Counter()
        unexpected: Counter = Counter()
        latency = {"valid_generate": [], "valid_route": []}
        during_large: list[float] = []  # small valid generate latencies while a large request was in flight
        in_flight = {"large": 0}
        deadline = time.monotonic() + seconds

        def client(c: int) -> None:
            i = c * 5
            while time.monotonic() < deadline:
                kind = schedule[i % len(schedule)]
                i += 1
                path, body, expected = kinds[kind]
                if kind == "valid_generate":
                    body = small[i % len(small)]
                large = kind in LARGE_KINDS
                with lock:
                    in_flight["large"] += large
                    large_before = in_flight["large"] > 0
                start = time.perf_counter()
                try:
                    status = _send(port, path, body, timeout=120)
                except (OSError, http.client.HTTPException) as exc:
                    status = None
                    with lock:
                        dropped[f"{kind}: {type(exc).__name__}"] += 1
                elapsed = (time.perf_counter() - start) * 1000
                with lock:
                    in_flight["large"] -= large
                    if status is not None:
                        statuses[kind][status] += 1
                        if status not in expected:
                            unexpected[f"{kind}: {status}"] += 1
                    if kind in latency and status == 200:
                        latency[kind].append(elapsed)
                        if kind == "valid_generate" and (large_before or in_flight["large"] > 0):
                            during_large.append(elapsed)

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            list(pool.map(client, range(clients)))
        wall = time.perf_counter() - start
        time.sleep(2.0)  # let the server finish and free what the last requests held
        rss_after = rss_kb(server.pid)
        alive = server.poll() is None
    counts = Counter()
    for c in statuses.values():
        counts.update(c)
    n = sum(counts.values()) + sum(dropped.values())
    out = {
        "invalid_requests": invalid, "clients": clients, "seconds": seconds, "wall_s": wall, "requests": n,
        "requests_per_s": n / wall,
        "caps": {k: caps.get(k) for k in ("seq_len", "max_prompt_tokens", "max_prompt_chars",
                                          "max_new_tokens_cap", "max_body_bytes", "routing_prefix_tokens")},
        "status_counts": {str(k): v for k, v in sorted(counts.items())},
        "status_by_kind": {k: {str(s): v for s, v in sorted(c.items())} for k, c in statuses.items()},
        "responses_500": sum(v for k, v in counts.items() if k >= 500),
        "dropped_connections": sum(dropped.values()), "dropped_by_kind": dict(dropped),
        "unexpected_status": dict(unexpected),
        "latency": {k: percentiles(v) if v else None for k, v in latency.items()},
        "valid_generate_while_large_in_flight": percentiles(during_large) if during_large else None,
        "server_rss_kb": {"before": rss_before.get("VmRSS"), "after": rss_after.get("VmRSS"),
                          "peak": rss_after.get("VmHWM")},
        "server_alive_after": alive,
    }
    before, after = out["server_rss_kb"]["before"], out["server_rss_kb"]["after"]
    out["server_rss_kb"]["growth"] = (after / before - 1) if before and after else None
    p99 = (out["valid_generate_while_large_in_flight"] or {}).get("p99_ms")
    out["targets"] = {
        "no_500": out["responses_500"] == 0,
        "no_dropped_connections": out["dropped_connections"] == 0,
        "p99_small_valid_while_large_in_flight_le_2s": p99 is not None and p99 <= 2000,
        "rss_growth_le_10pct": out["server_rss_kb"]["growth"] is not None and out["server_rss_kb"]["growth"] <= 0.10,
    }
    return out


def print_abuse(a: dict) -> None:
    print()
    print(f"abuse: {a['clients']} clients, {a['wall_s']:.1f} s, {a['requests']} requests ({a['requests_per_s']:.1f}/s); "
          f"status {a['status_counts']}; 500s {a['responses_500']}; dropped {a['dropped_connections']}; "
          f"unexpected {a['unexpected_status'] or 'none'}")
    for k, row in a["latency"].items():
        if row:
            print(f"  {k:<16} n={row['n']:<5} p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms")
    d = a["valid_generate_while_large_in_flight"]
    if d:
        print(f"  valid_generate while a large invalid request was in flight: n={d['n']} p50 {d['p50_ms']:.1f} ms "
              f"p99 {d['p99_ms']:.1f} ms")
    r = a["server_rss_kb"]
    growth = "?" if r["growth"] is None else f"{100 * r['growth']:+.1f}%"
    print(f"  server RSS: {r['before']} kB before, {r['after']} kB after ({growth}), peak {r['peak']} kB")
    print(f"  targets: {a['targets']}")


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
        if args.abuse:
            control = None
            if args.abuse_control:
                control = bench_abuse(run, pipe.experiment, prompts, args.abuse_clients, args.seconds, args.threads,
                                      invalid=False)
                print("control (valid requests only):", end="")
                print_abuse(control)
            abuse = bench_abuse(run, pipe.experiment, prompts, args.abuse_clients, args.seconds, args.threads)
            report = {
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                            "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
                "run": {"experiment": pipe.experiment, "checkpoint": pipe.checkpoint,
                        "topology": pipe.topology.describe()},
                "prompt_tokens": args.prompt_tokens, "abuse": abuse, "control_valid_only": control,
            }
            print_abuse(abuse)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2))
                print(f"[bench] wrote {args.out}")
            return
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
