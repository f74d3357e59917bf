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

5. **Concurrency** (``--concurrency N``): ``N`` closed-loop clients (each sends its next request when
   its answer arrives, on a kept-alive connection) for ``--seconds`` against one `dipaco serve` per mode of
   ``--modes``, in turn, each warmed up first: ``unbatched`` (``--max-batch 1``), ``path`` (per-path
   batching), ``module`` (module batching: rows of any paths, level by level) and ``pinned`` (module
   batching, every request naming ``--pin-path``, default 0: one model). Prompts are validation texts cut to
   between half of ``--prompt-tokens`` and all of it (so batches hold prompts of different lengths), greedy,
   ``--new-tokens`` each. Reports generated tokens/s, p50/p99 latency, rows per forward pass and, under
   module batching, rows per level module and the time per stage (embed, gather, blocks, scatter, head),
   all from the server's ``/metrics``. Targets (issue 61, on a 4x4 grid: ``--grid 4x4``): module >= 3x
   unbatched throughput and >= 0.8 of pinned, module p99 no worse than per-path batching.
6. **Agreement** (``--agreement N``): in one process, N prompts decoded alone (batches of one) and in
   batches, through the server's own code: per path (``Pipeline.run_batch``, ``--max-batch`` rows of one
   path at a time) and module-batched (``Pipeline.run_module_batch``: one running batch of up to
   ``--max-batch`` rows of any paths, the next prompts joining as rows end); greedy texts, then seeded samples
   with temperature, top-k and top-p differing row to row. Names each prompt whose text differs, with the step
   where it diverges and the gap between the two best logits there. Target: >= 99% of the greedy texts equal.
7. **Held connections** (``--hold-idle N``): `dipaco serve` under ``ulimit -n --nofile``; N connections
   held open for ``--seconds`` (half idle, half slow headers: a header line a second; each reopened as
   soon as the server closes it) while a valid request is sent every 0.25 s on a new connection.
   Reports their latency, how the server closed the held connections, and the longest any stayed open.
   Target: every valid request answered within 1 s.

8. **APIs** (``--apis N``): the concurrency part's load (``N`` closed-loop clients, the batched server)
   through ``/v1/generate``, ``/v1/completions`` and streamed ``/v1/completions`` (server-sent events,
   the whole stream timed; ``stream_options.include_usage`` counts its tokens), one server, the three
   interleaved in ``--rounds`` rounds of ``--seconds / rounds`` each (the order turned each round).
   Reports tokens/s and p50/p99 of each. Target: completions within 10% of generate, both ways.
9. **Soak** (``--soak N``): ``N`` closed-loop clients (sampled, temperature 0.8, prompts of 12-40 words cut
   from validation texts) against one `dipaco serve` (``--max-batch``) for ``--seconds``, in windows of
   ``--window`` seconds; the server's RSS and open descriptors (``/proc/PID``) sampled every ``--sample-every``
   seconds. Reports p50/p99 and statuses per window, and RSS growth and slope (least squares) after
   ``--settle`` seconds. Targets: RSS from ``--settle`` to the end grows <= 2%, every window's p99 within
   20% of the first's, 0 responses of 500.

With no ``--run`` it builds a small run first (configs/demo.yaml: BBC News, 4-layer d=128 paths,
2x2 grid, LM-prefix k-means routing) with few training steps: quality is irrelevant to latency.

    python scripts/bench_serve.py --out bench_serve.json
    python scripts/bench_serve.py --run runs/demo --experiment dipaco_2x2
    python scripts/bench_serve.py --abuse --seconds 60 --out bench_serve_abuse.json
    python scripts/bench_serve.py --concurrency 16 --seconds 60 --agreement 200 --out bench_serve_batching.json
    python scripts/bench_serve.py --grid 4x4 --concurrency 16 --seconds 60 --agreement 200 --out bench_serve_modules.json
    python scripts/bench_serve.py --hold-idle 300 --nofile 256 --seconds 70 --out bench_serve_held.json
    python scripts/bench_serve.py --apis 16 --seconds 60 --out bench_serve_apis.json
    python scripts/bench_serve.py --soak 16 --seconds 1800 --settle 300 --out bench_serve_soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import selectors
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


def write_report(path: str, report: dict) -> None:
    """The report as strict JSON (dipaco.json_text: NaN and infinities become null, with the reason beside them),
    written atomically (dipaco.atomic: a reader never sees half a file); prints where it went."""
    from dipaco import atomic, json_text

    atomic.write_text(path, json_text.dumps(report, indent=2))
    print(f"[bench] wrote {path}")


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
    p.add_argument("--concurrency", type=int, help="part 5: this many closed-loop clients, unbatched then batched")
    p.add_argument("--warmup-seconds", type=float, default=5.0, help="concurrency: closed-loop warm-up per server")
    p.add_argument("--max-batch", type=int, default=16, help="concurrency / agreement: the batched server's --max-batch")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="concurrency: the batched server's --batch-wait-ms")
    p.add_argument("--decode-workers", type=int, default=1, help="concurrency: both servers' --decode-workers")
    p.add_argument("--pin-path", type=int, help="concurrency: the path the pinned mode's requests name (default 0)")
    p.add_argument("--modes", default="unbatched,path,module,pinned",
                   help=f"concurrency: the servers to compare, of {', '.join(SERVER_MODES)}")
    p.add_argument("--grid", default="2x2", help="the grid of the run built when --run has none (e.g. 4x4: 16 paths)")
    p.add_argument("--agreement", type=int, help="part 6: this many prompts, batched against alone")
    p.add_argument("--hold-idle", type=int, help="part 7: hold this many idle / slow-header connections open")
    p.add_argument("--nofile", type=int, default=256, help="hold-idle: the server's ulimit -n")
    p.add_argument("--apis", type=int, help="part 8: this many closed-loop clients through generate and completions")
    p.add_argument("--rounds", type=int, default=3, help="apis: rounds of the three interleaved")
    p.add_argument("--soak", type=int, help="part 9: this many closed-loop clients for --seconds, RSS and descriptors sampled")
    p.add_argument("--window", type=float, default=60.0, help="soak: p50/p99 per window of this many seconds")
    p.add_argument("--settle", type=float, default=300.0, help="soak: RSS growth and slope measured after this many seconds")
    p.add_argument("--sample-every", type=float, default=10.0, help="soak: seconds between RSS / descriptor samples")
    p.add_argument("--batching", choices=("module", "path"), default="module", help="soak: the server's --batching")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args()


def build_run(run_dir: Path, grid: str = "2x2") -> Path:
    """prepare -> pretrain -> route -> train (1 round of 5 steps) on the demo config, with a ``grid`` topology."""
    from dipaco.run import Run, load_config
    from dipaco.runtime import quiet_library_progress_bars

    quiet_library_progress_bars()
    cfg = load_config(REPO / "configs" / "demo.yaml", [
        f"run.dir={run_dir}", "run.progress=false", "pretrain.steps=30", "train.rounds=1", "train.inner_steps=5",
        # the path size the recorded figures used (the demo's own paths are smaller since issue 34)
        "model.num_layers=4", "model.hidden_size=128", "model.intermediate_size=384", "model.num_heads=4",
        f"topology.preset=grid:{grid}", f"train.name=dipaco_{grid}",
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


def validation_split(pipe):
    """The validation documents of the served experiment's run (its stored config, read by the root)."""
    from dipaco.run import Run, load_config

    cfg = load_config(pipe.loaded.dir / "config.yaml", [f"run.dir={pipe.loaded.run.root}"])
    return Run(cfg).prepared().validation


def prompts_from_run(pipe, n: int, n_tokens: int) -> list[str]:
    val = validation_split(pipe)
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
def dipaco_serve(run: Path, experiment: str | None, threads: int | None, cache_size: int = 16,
                 extra_args: tuple[str, ...] = (), nofile: int | None = None):
    """`dipaco serve` in a subprocess on a free loopback port, up and healthy; yields (port, process).

    ``extra_args``: more `dipaco serve` flags (``--max-batch 1``); ``nofile``: its RLIMIT_NOFILE
    (``ulimit -n``). Its stderr (the access log: a line per request) goes to a file, not a pipe that
    nobody reads: a full pipe blocks the server.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "dipaco", "serve", "--run", str(run), "--port", str(port),
           "--cache-size", str(cache_size), "--host", "127.0.0.1", *extra_args]
    if experiment:
        cmd += ["--experiment", experiment]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))

    def limit_descriptors() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log = tempfile.TemporaryFile()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO,
                              preexec_fn=limit_descriptors if nofile else None)

    def log_tail() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")[-2000:]

    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"dipaco serve exited: {log_tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dipaco serve did not come up: {log_tail()}")
            time.sleep(0.5)
        yield port, server
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


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


# --- part 5: concurrency, batched against unbatched ---------------------------------------------------
def varied_prompts(pipe, n: int, max_tokens: int) -> list[str]:
    """``n`` validation texts cut to between ``max_tokens // 2`` and ``max_tokens`` tokens (a fixed cycle),
    so a batch holds prompts of different lengths and is left-padded."""
    val = validation_split(pipe)
    docs = [d for d in val["input_ids"] if len(d) >= max_tokens]
    if len(docs) < n:
        docs = (docs * (n // max(len(docs), 1) + 1))[:n]
    low = max(1, max_tokens // 2)
    return [pipe.decode(d[: low + (i * 7) % (max_tokens - low + 1)]) for i, d in enumerate(docs[:n])]


def scrape(port: int) -> list:
    """The server's /metrics samples, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_total(samples: list, name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def metric_by_label(samples: list, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in samples if s.name == name}


def generated_tokens(reply: bytes) -> int:
    """The new tokens of a /v1/generate answer."""
    return json.loads(reply)["completion_tokens"]


def closed_loop(port: int, bodies: list[bytes], clients: int, seconds: float, endpoint: str = "/v1/generate",
                tokens_of=generated_tokens, keep_latencies: bool = False) -> dict:
    """``clients`` threads, each on its own kept-alive connection, sending its next request as soon as the
    last is answered (its whole body read), for ``seconds``. Request r of client c is
    ``bodies[(c + r * clients) % len(bodies)]``; ``tokens_of(body)``: the new tokens of an answer."""
    lock = threading.Lock()
    latencies: list[float] = []
    tokens = [0]
    statuses: Counter = Counter()
    deadline = time.monotonic() + seconds

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        r = 0
        while time.monotonic() < deadline:
            body = bodies[(c + r * clients) % len(bodies)]
            r += 1
            start = time.perf_counter()
            try:
                conn.request("POST", endpoint, body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                reply = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                with lock:
                    statuses[type(exc).__name__] += 1
                continue
            elapsed = (time.perf_counter() - start) * 1000
            with lock:
                statuses[status] += 1
                if status == 200:
                    latencies.append(elapsed)
                    tokens[0] += tokens_of(reply)
        conn.close()

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - start
    return {"clients": clients, "wall_s": wall, "requests": len(latencies), "tokens": tokens[0],
            "tokens_per_s": tokens[0] / wall, "requests_per_s": len(latencies) / wall,
            "statuses": {str(k): v for k, v in statuses.items()}, **(percentiles(latencies) if latencies else {}),
            **({"latencies_ms": latencies} if keep_latencies else {})}


# The servers part 5 compares: (name, flags, every request on --pin-path (default 0) instead of routed).
SERVER_MODES = {
    "unbatched": (("--max-batch", "1", "--batching", "path"), False),
    "path": (("--batching", "path"), False),  # per-path batching: rows of one path per forward pass
    "module": (("--batching", "module"), False),  # module batching: rows of any paths, level by level
    "pinned": (("--batching", "module"), True),  # module batching, every request naming one path
}


def bench_concurrency(run: Path, experiment: str | None, prompts: list[str], clients: int, seconds: float,
                      warmup_s: float, new_tokens: int, threads: int | None, max_batch: int, batch_wait_ms: float,
                      decode_workers: int = 1, path: int | None = None,
                      modes: tuple[str, ...] = ("unbatched", "path", "module", "pinned"), cache_size: int = 4) -> dict:
    """Part 5: the same closed-loop load on one `dipaco serve` per mode (:data:`SERVER_MODES`), in turn.
    ``path``: the path of the pinned mode (default 0); ``cache_size``: the servers' composed paths (at least the
    run's paths, or the per-path modes would compose a path per request)."""
    out: dict = {"clients": clients, "seconds": seconds, "new_tokens": new_tokens, "prompts": len(prompts),
                 "pinned_path": path or 0}
    for name in modes:
        flags, pinned = SERVER_MODES[name]
        named = {"path": path or 0} if pinned else {}
        bodies = [json.dumps({"prompt": p, "max_new_tokens": new_tokens, **named}).encode() for p in prompts]
        flags = (*flags, "--batch-wait-ms", str(batch_wait_ms), "--decode-workers", str(decode_workers))
        if "--max-batch" not in flags:
            flags = (*flags, "--max-batch", str(max_batch))
        with dipaco_serve(run, experiment, threads, cache_size=cache_size, extra_args=flags) as (port, _):
            closed_loop(port, bodies, clients, warmup_s)
            before = scrape(port)
            row = closed_loop(port, bodies, clients, seconds)
            after = scrape(port)
        row.update(forward_passes(before, after))
        row["cache_size"] = cache_size
        row["server_flags"] = " ".join(flags)
        row["requests_name_a_path"] = pinned
        out[name] = row
        module = f", {row['rows_per_module']:.1f} rows per module" if row.get("rows_per_module") else ""
        print(f"[bench] {name} ({row['server_flags']}), {clients} clients: {row['tokens_per_s']:.0f} tok/s, "
              f"p50 {row.get('p50_ms', 0):.0f} ms, p99 {row.get('p99_ms', 0):.0f} ms, "
              f"{row['mean_batch_size'] or 0:.1f} rows per pass{module}", flush=True)
    out.update(concurrency_targets(out))
    return out


def forward_passes(before: list, after: list) -> dict:
    """What the server's forward passes held over a load, from its /metrics before and after: rows per pass,
    and under module batching the rows per level module and the share of time per stage."""
    def delta(name: str) -> float:
        return metric_total(after, name) - metric_total(before, name)

    passes, rows = delta("dipaco_batch_size_count"), delta("dipaco_batch_size_sum")
    out: dict = {"batches": int(passes), "mean_batch_size": rows / passes if passes else None}
    calls = delta("dipaco_module_calls_total")
    if calls:
        out["rows_per_module"] = delta("dipaco_module_rows_total") / calls
        was = metric_by_label(before, "dipaco_module_seconds_total", "stage")
        now = metric_by_label(after, "dipaco_module_seconds_total", "stage")
        spent = {stage: now[stage] - was.get(stage, 0.0) for stage in now}
        total = sum(spent.values())
        out["module_seconds"] = spent
        out["module_time_share"] = {stage: t / total for stage, t in spent.items()} if total else {}
    return out


def concurrency_targets(out: dict) -> dict:
    """Throughput and p99 ratios between the modes measured, and issue 61's targets for module batching."""
    def ratio(a: str, b: str, key: str) -> float | None:
        if a in out and b in out and out[b].get(key):
            return out[a][key] / out[b][key]
        return None

    ratios = {"path_vs_unbatched": ratio("path", "unbatched", "tokens_per_s"),
              "module_vs_unbatched": ratio("module", "unbatched", "tokens_per_s"),
              "module_vs_path": ratio("module", "path", "tokens_per_s"),
              "module_vs_pinned": ratio("module", "pinned", "tokens_per_s"),
              "module_p99_vs_path": ratio("module", "path", "p99_ms")}
    targets = {}
    if ratios["module_vs_unbatched"] is not None:
        targets["module_ge_3x_unbatched"] = ratios["module_vs_unbatched"] >= 3.0
    if ratios["module_vs_pinned"] is not None:
        targets["module_ge_0.8_of_pinned"] = ratios["module_vs_pinned"] >= 0.8
    if ratios["module_p99_vs_path"] is not None:
        targets["module_p99_no_worse_than_path"] = ratios["module_p99_vs_path"] <= 1.0
    return {"ratios": ratios, "targets": targets}


# --- part 8: the same load through /v1/generate and OpenAI's /v1/completions --------------------------
def completion_tokens(reply: bytes) -> int:
    """The new tokens of a /v1/completions answer, whole or streamed (its usage chunk, before [DONE])."""
    if reply.startswith(b"data: "):
        events = [e[len(b"data: "):] for e in reply.split(b"\n\n") if e.startswith(b"data: {")]
        return json.loads(events[-1])["usage"]["completion_tokens"]
    return json.loads(reply)["usage"]["completion_tokens"]


def bench_apis(run: Path, experiment: str, prompts: list[str], clients: int, seconds: float, warmup_s: float,
               new_tokens: int, threads: int | None, max_batch: int, batch_wait_ms: float, rounds: int = 3) -> dict:
    """Part 8: one batched server, the same closed-loop load through the three APIs, interleaved in ``rounds``."""
    openai = {"model": experiment, "max_tokens": new_tokens, "temperature": 0}
    apis = {  # name: (endpoint, request bodies, tokens of an answer)
        "generate": ("/v1/generate", [{"prompt": p, "max_new_tokens": new_tokens} for p in prompts], generated_tokens),
        "completions": ("/v1/completions", [{**openai, "prompt": p} for p in prompts], completion_tokens),
        "completions_stream": ("/v1/completions", [{**openai, "prompt": p, "stream": True,
                                                    "stream_options": {"include_usage": True}} for p in prompts],
                               completion_tokens),
    }
    encoded = {name: (endpoint, [json.dumps(b).encode() for b in bodies], count)
               for name, (endpoint, bodies, count) in apis.items()}
    flags = ("--max-batch", str(max_batch), "--batch-wait-ms", str(batch_wait_ms))
    runs: dict[str, list[dict]] = {name: [] for name in apis}
    with dipaco_serve(run, experiment, threads, cache_size=4, extra_args=flags) as (port, _):
        for endpoint, bodies, count in encoded.values():
            closed_loop(port, bodies, clients, warmup_s, endpoint, count)
        names = list(apis)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                endpoint, bodies, count = encoded[name]
                runs[name].append(closed_loop(port, bodies, clients, seconds / rounds, endpoint, count, keep_latencies=True))
    out: dict = {"clients": clients, "seconds": seconds, "rounds": rounds, "new_tokens": new_tokens,
                 "server_flags": " ".join(flags)}
    for name, parts in runs.items():
        latencies = [ms for part in parts for ms in part.pop("latencies_ms")]
        wall, tokens = sum(part["wall_s"] for part in parts), sum(part["tokens"] for part in parts)
        statuses: Counter = Counter()
        for part in parts:
            statuses.update(part["statuses"])
        out[name] = {"requests": len(latencies), "tokens": tokens, "tokens_per_s": tokens / wall,
                     "statuses": dict(statuses), **(percentiles(latencies) if latencies else {})}
        print(f"[bench] {name}, {clients} clients: {out[name]['tokens_per_s']:.0f} tok/s, "
              f"p50 {out[name].get('p50_ms', 0):.0f} ms, p99 {out[name].get('p99_ms', 0):.0f} ms", flush=True)
    base = out["generate"]
    out["targets"] = {}
    for name in ("completions", "completions_stream"):
        row = out[name]
        row["throughput_vs_generate"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
        row["p99_vs_generate"] = row["p99_ms"] / base["p99_ms"] if "p99_ms" in row and "p99_ms" in base else None
        out["targets"][f"{name}_within_10pct"] = ((row["throughput_vs_generate"] or 0) >= 0.9
                                                  and (row["p99_vs_generate"] or 2) <= 1.1)
    return out


# --- part 9: soak: memory, descriptors and latency over a long closed-loop load --------------------------
def word_prompts(pipe, n: int, low: int = 12, high: int = 40, seed: int = 0) -> list[str]:
    """``n`` runs of ``low`` to ``high`` words from validation texts, each from a random place (fixed seed)."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    for doc in validation_split(pipe)["input_ids"]:
        words = pipe.decode(doc).split()
        k = int(rng.integers(low, high + 1))
        if len(words) >= k:
            at = int(rng.integers(0, len(words) - k + 1))
            out.append(" ".join(words[at:at + k]))
        if len(out) == n:
            break
    return out


class ProcSampler(threading.Thread):
    """Every ``every`` seconds: (seconds since start, VmRSS in MB, open descriptors) of process ``pid``."""

    def __init__(self, pid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.stop = pid, every, threading.Event()
        self.samples: list[tuple[float, float, int | None]] = []
        self.start_time = time.monotonic()

    def run(self) -> None:
        while True:
            rss = rss_kb(self.pid).get("VmRSS")
            if rss is not None:
                self.samples.append((time.monotonic() - self.start_time, rss / 1024, server_descriptors(self.pid)))
            if self.stop.wait(self.every):
                return


def bench_soak(run: Path, experiment: str | None, prompts: list[str], clients: int, seconds: float, window_s: float,
               settle_s: float, sample_s: float, new_tokens: int, threads: int | None, max_batch: int,
               batching: str = "module") -> dict:
    """Part 9: one server (``--batching``), ``clients`` closed-loop clients for ``seconds`` in windows of ``window_s``.
    Each window is a fresh ``closed_loop`` (its clients reconnect): a gap of a few ms, and latency per window."""
    bodies = [json.dumps({"prompt": p, "max_new_tokens": new_tokens, "temperature": 0.8}).encode() for p in prompts]
    flags = ("--max-batch", str(max_batch), "--batching", batching)
    windows = []
    with dipaco_serve(run, experiment, threads, cache_size=4, extra_args=flags) as (port, server):
        sampler = ProcSampler(server.pid, sample_s)
        sampler.start()
        while (left := seconds - (time.monotonic() - sampler.start_time)) > 0.05:
            row = closed_loop(port, bodies, clients, min(window_s, left))
            row["end_s"] = time.monotonic() - sampler.start_time
            windows.append(row)
            print(f"[bench] soak {row['end_s']:.0f} s: {row['requests']} answers, p50 {row.get('p50_ms', 0):.0f} ms, "
                  f"p99 {row.get('p99_ms', 0):.0f} ms, RSS {sampler.samples[-1][1]:.0f} MB, "
                  f"{sampler.samples[-1][2]} descriptors", flush=True)
        time.sleep(min(sample_s, 5.0))  # one sample after the load
        sampler.stop.set()
        sampler.join()
    t, rss, fds = (np.array([s[i] for s in sampler.samples], dtype=float) for i in range(3))
    late = t >= min(settle_s, t[-1])  # a run shorter than settle_s: its last sample alone
    statuses: Counter = Counter()
    for row in windows:
        statuses.update(row["statuses"])
    slope = float(np.polyfit(t[late], rss[late], 1)[0]) * 60 if late.sum() >= 2 else None
    out = {"clients": clients, "seconds": seconds, "window_s": window_s, "settle_s": settle_s, "new_tokens": new_tokens,
           "server_flags": " ".join(flags), "statuses": dict(statuses),
           "responses_500": sum(v for k, v in statuses.items() if k.isdigit() and int(k) >= 500),
           "windows": [{k: row.get(k) for k in ("end_s", "requests", "p50_ms", "p99_ms", "statuses")} for row in windows],
           "samples": {"t_s": t.tolist(), "rss_mb": rss.tolist(), "fds": fds.tolist()},
           "rss_mb": {"first": rss[0], "at_settle": rss[late][0], "end": rss[-1], "peak": rss.max(),
                      "growth_after_settle": rss[-1] / rss[late][0] - 1, "slope_mb_per_min_after_settle": slope},
           "fds": {"min": fds.min(), "max": fds.max()}}
    p99 = [row["p99_ms"] for row in windows if "p99_ms" in row]
    out["targets"] = {"rss_growth_after_settle_le_2pct": bool(out["rss_mb"]["growth_after_settle"] <= 0.02),
                      "p99_within_20pct_of_first_window": bool(p99) and max(p99) <= 1.2 * p99[0],
                      "no_500": out["responses_500"] == 0}
    r = out["rss_mb"]
    print(f"[bench] soak: RSS {r['first']:.0f} MB at start, {r['at_settle']:.0f} MB at {settle_s:g} s, {r['end']:.0f} MB "
          f"at the end ({100 * r['growth_after_settle']:+.1f}%, {slope if slope is not None else float('nan'):.2f} "
          f"MB/min after settling); descriptors {out['fds']['min']:.0f}-{out['fds']['max']:.0f}; statuses "
          f"{dict(statuses)}; targets {out['targets']}", flush=True)
    return out


# --- part 6: batched against alone, token for token ----------------------------------------------------
SAMPLING_CYCLE = ((0.7, 1.0, 0), (1.0, 0.95, 50), (1.3, 0.9, 0))  # (temperature, top_p, top_k) by row


def _decode_all(pipe, prompts: list[str], new_tokens: int, batch: int, sampled: bool, batching: str = "path") -> list:
    """Plans every prompt, then decodes them in batches of up to ``batch`` rows: of one path at a time, in order
    (``path``), or (``module``) one running batch of any paths that rows join, in order, as others end."""
    plans = []
    for i, prompt in enumerate(prompts):
        kwargs = {}
        if sampled:
            temperature, top_p, top_k = SAMPLING_CYCLE[i % len(SAMPLING_CYCLE)]
            kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=1000 + i)
        plans.append(pipe.plan(prompt, max_new_tokens=new_tokens, **kwargs))
    if batching == "module":
        waiting = [plan.row for plan in plans]
        first, waiting = waiting[:batch], waiting[batch:]

        def admit(decoding: int) -> list:
            nonlocal waiting
            joining, waiting = waiting[:batch - decoding], waiting[batch - decoding:]
            return joining

        pipe.run_module_batch(-1, first, admit=admit)
        return plans
    by_path: dict[int, list] = {}
    for plan in plans:
        by_path.setdefault(plan.path, []).append(plan)
    for path, group in by_path.items():
        for i in range(0, len(group), batch):
            pipe.run_batch(path, [plan.row for plan in group[i:i + batch]])
    return plans


@torch.inference_mode()
def top2_gap(pipe, path: int, ids: list[int]) -> float:
    """The gap between the two best next-token logits after ``ids``, on ``path``'s model (one forward)."""
    model = pipe.cache.get(path).model
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def bench_agreement(pipe, prompts: list[str], new_tokens: int, max_batch: int) -> dict:
    """Part 6: each prompt alone and in batches (per path, and module-batched), greedy and seeded-sampled; which
    texts differ, and where."""
    out: dict = {"prompts": len(prompts), "new_tokens": new_tokens, "max_batch": max_batch}
    for mode in ("greedy", "seeded"):
        sampled = mode == "seeded"
        start = time.perf_counter()
        alone = _decode_all(pipe, prompts, new_tokens, 1, sampled)
        alone_s = time.perf_counter() - start
        out[mode] = {"alone_s": alone_s}
        for batching in ("path", "module"):
            start = time.perf_counter()
            batched = _decode_all(pipe, prompts, new_tokens, max_batch, sampled, batching)
            batched_s = time.perf_counter() - start
            differ = []
            for i, (a, b) in enumerate(zip(alone, batched)):
                if pipe.decode(a.row.tokens) == pipe.decode(b.row.tokens):
                    continue
                step = next((k for k, (x, y) in enumerate(zip(a.row.tokens, b.row.tokens)) if x != y),
                            min(len(a.row.tokens), len(b.row.tokens)))
                gap = top2_gap(pipe, a.path, a.row.prompt_ids + a.row.tokens[:step])
                differ.append({"prompt": i, "path": a.path, "batch_size": b.row.batch_size, "diverges_at_token": step,
                               "top2_logit_gap_there": gap, "prompt_text": prompts[i][:80]})
            sizes = [p.row.batch_size for p in batched]
            out[mode][batching] = {"equal": len(prompts) - len(differ), "equal_fraction": 1 - len(differ) / len(prompts),
                                   "differ": differ, "mean_batch_size": float(np.mean(sizes)), "batched_s": batched_s}
            print(f"[bench] agreement {mode}, {batching} batching: {len(prompts) - len(differ)}/{len(prompts)} texts "
                  f"equal batched and alone (mean batch {np.mean(sizes):.1f}; alone {alone_s:.1f} s, batched "
                  f"{batched_s:.1f} s)", flush=True)
            for d in differ:
                print(f"    prompt {d['prompt']} (path {d['path']}, batch of {d['batch_size']}): diverges at token "
                      f"{d['diverges_at_token']}, top-2 logit gap {d['top2_logit_gap_there']:.2e}", flush=True)
    out["targets"] = {f"{batching}_greedy_ge_99pct": out["greedy"][batching]["equal_fraction"] >= 0.99
                      for batching in ("path", "module")}
    return out


# --- part 7: idle and slow-header connections held open ------------------------------------------------
SLOW_HEADER_START = b"POST /v1/generate HTTP/1.1\r\nHost: bench\r\n"


class ConnectionHolder(threading.Thread):
    """Holds ``n`` connections open to ``port``: even ones idle, odd ones sending a header line every second
    and never finishing; each one the server closes is reopened at once. Records how long each stayed open."""

    def __init__(self, port: int, n: int) -> None:
        super().__init__(daemon=True)
        self.port, self.n = port, n
        self.stop = threading.Event()
        self.selector = selectors.DefaultSelector()
        self.opened = self.closed_by_server = self.connect_failures = 0
        self.lifetimes: list[float] = []  # seconds each connection the server closed stayed open
        self.open_ages_at_end: list[float] = []
        self.held_samples: list[int] = []

    def _open(self, slot: int) -> None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        except OSError:
            self.connect_failures += 1
            return
        sock.setblocking(False)
        slow = slot % 2 == 1
        if slow:
            with contextlib.suppress(OSError):
                sock.send(SLOW_HEADER_START)
        self.selector.register(sock, selectors.EVENT_READ, {"slot": slot, "slow": slow, "opened": time.monotonic()})
        self.opened += 1

    def _held(self) -> list:
        return list(self.selector.get_map().values())

    def _drop(self, key, by_server: bool) -> None:
        self.selector.unregister(key.fileobj)
        key.fileobj.close()
        if by_server:
            self.closed_by_server += 1
            self.lifetimes.append(time.monotonic() - key.data["opened"])

    def run(self) -> None:
        next_header = time.monotonic() + 1.0
        while not self.stop.is_set():
            held = {key.data["slot"] for key in self._held()}
            for slot in range(self.n):
                if slot not in held and not self.stop.is_set():
                    self._open(slot)
            self.held_samples.append(len(self.selector.get_map()))
            for key, _ in self.selector.select(timeout=0.1):
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(key, by_server=True)
            if time.monotonic() >= next_header:
                next_header += 1.0
                for key in self._held():
                    if key.data["slow"]:
                        try:
                            key.fileobj.send(b"X-Slow: 1\r\n")
                        except OSError:
                            self._drop(key, by_server=True)
        now = time.monotonic()
        for key in self._held():
            self.open_ages_at_end.append(now - key.data["opened"])
            self._drop(key, by_server=False)


def server_descriptors(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def bench_hold_idle(run: Path, experiment: str | None, prompts: list[str], n: int, nofile: int, seconds: float,
                    threads: int | None) -> dict:
    """Part 7: valid requests while ``n`` idle and slow-header connections are held open, server at ``ulimit -n nofile``."""
    bodies = [json.dumps({"prompt": p, "max_new_tokens": 8}).encode() for p in prompts]
    with dipaco_serve(run, experiment, threads, cache_size=4, nofile=nofile) as (port, server):
        for body in bodies[:8]:
            _send(port, "/v1/generate", body, 60)
        baseline = []
        for body in bodies[:20]:
            start = time.perf_counter()
            _send(port, "/v1/generate", body, 60)
            baseline.append((time.perf_counter() - start) * 1000)
        holder = ConnectionHolder(port, n)
        holder.start()
        time.sleep(2.0)  # the first n are open (or being closed and reopened)
        latencies, failures, descriptors = [], Counter(), []
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                status = _send(port, "/v1/generate", bodies[i % len(bodies)], 30)
                if status != 200:
                    failures[str(status)] += 1
            except (OSError, http.client.HTTPException) as exc:
                failures[type(exc).__name__] += 1
            latencies.append((time.perf_counter() - start) * 1000)
            descriptors.append(server_descriptors(server.pid))
            i += 1
            time.sleep(0.25)
        holder.stop.set()
        holder.join(30)
        metrics = scrape(port)
    over = [ms for ms in latencies if ms > 1000]
    out = {
        "held": n, "server_nofile": nofile, "seconds": seconds,
        "valid": {**percentiles(latencies), "max_ms": max(latencies), "over_1s": len(over), "failures": dict(failures)},
        "baseline_without_held_connections": percentiles(baseline),
        "held_connections": {"opened": holder.opened, "closed_by_server": holder.closed_by_server,
                             "connect_failures": holder.connect_failures,
                             "median_held": float(np.median(holder.held_samples)) if holder.held_samples else 0,
                             "longest_lifetime_s": max(holder.lifetimes, default=0.0),
                             "longest_open_at_end_s": max(holder.open_ages_at_end, default=0.0),
                             "lifetime_p50_s": float(np.median(holder.lifetimes)) if holder.lifetimes else None},
        "server_closed": metric_by_label(metrics, "dipaco_connections_closed_total", "reason"),
        "server_descriptors_max": max((d for d in descriptors if d is not None), default=None),
    }
    out["targets"] = {"every_valid_request_within_1s": not over and not failures}
    print(f"[bench] {n} held connections (server ulimit -n {nofile}), {len(latencies)} valid requests: p50 "
          f"{out['valid']['p50_ms']:.0f} ms, p99 {out['valid']['p99_ms']:.0f} ms, max {out['valid']['max_ms']:.0f} ms, "
          f"{len(over)} over 1 s, failures {dict(failures) or 'none'}; held connections closed by the server "
          f"{holder.closed_by_server}, longest open {out['held_connections']['longest_lifetime_s']:.1f} s", flush=True)
    return out


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in SERVER_MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: {', '.join(unknown) or 'none given'}: choose from {', '.join(SERVER_MODES)}")
    return modes


def run_batching_parts(args: argparse.Namespace, run: Path, pipe, prompts: list[str]) -> None:
    """Parts 5-8, those asked for, into one report."""
    report: dict = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(),
                    "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "run": {"experiment": pipe.experiment, "checkpoint": pipe.checkpoint, "topology": pipe.topology.describe(),
                "params_per_path": sum(p.numel() for p in pipe.cache.template.parameters())},
        "prompt_tokens": f"{args.prompt_tokens // 2}..{args.prompt_tokens}",
    }
    if args.agreement:
        report["agreement"] = bench_agreement(pipe, varied_prompts(pipe, args.agreement, args.prompt_tokens),
                                              args.new_tokens, args.max_batch)
    if args.concurrency:
        report["concurrency"] = bench_concurrency(run, pipe.experiment, varied_prompts(pipe, args.prompts, args.prompt_tokens),
                                                  args.concurrency, args.seconds, args.warmup_seconds, args.new_tokens,
                                                  args.threads, args.max_batch, args.batch_wait_ms, args.decode_workers,
                                                  args.pin_path, parse_modes(args.modes), max(4, pipe.num_paths))
    if args.apis:
        report["apis"] = bench_apis(run, pipe.experiment, varied_prompts(pipe, args.prompts, args.prompt_tokens), args.apis,
                                    args.seconds, args.warmup_seconds, args.new_tokens, args.threads, args.max_batch,
                                    args.batch_wait_ms, args.rounds)
    if args.soak:
        report["soak"] = bench_soak(run, pipe.experiment, word_prompts(pipe, max(args.prompts, 200)), args.soak,
                                    args.seconds, args.window, args.settle, args.sample_every, args.new_tokens,
                                    args.threads, args.max_batch, args.batching)
    if args.hold_idle:
        report["hold_idle"] = bench_hold_idle(run, pipe.experiment, prompts, args.hold_idle, args.nofile, args.seconds,
                                              args.threads)
    if args.out:
        write_report(args.out, report)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dipaco.serve.pipeline import Pipeline

    tmp = None
    if args.run:
        run = Path(args.run)
        if not any((run / "train").glob("*/config.yaml")):
            build_run(run, args.grid)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_serve_")
        run = build_run(Path(tmp.name) / "run", args.grid)
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
                write_report(args.out, report)
            return
        if args.concurrency or args.agreement or args.hold_idle or args.apis or args.soak:
            run_batching_parts(args, run, pipe, prompts)
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
            write_report(args.out, report)
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
