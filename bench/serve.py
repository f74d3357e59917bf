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
   ``--modes``, all up at once, each warmed up first, then loaded in turn for ``--rounds`` rounds of
   ``--seconds / rounds`` (the order turned each round: a drift of the machine's speed falls on every mode):
   ``unbatched`` (``--max-batch 1``), ``path`` (per-path
   batching), ``module`` (module batching: rows of any paths, level by level), ``inline`` (the same with the
   router's forward in the server's process, ``--no-router-process``), ``named`` (module batching,
   each request naming the path the router picks for its prompt, routed ahead: the module load without the
   server's routing) and ``pinned`` (module batching, every request naming ``--pin-path``, default 0: one
   model). Prompts are validation texts cut to
   between half of ``--prompt-tokens`` and all of it (so batches hold prompts of different lengths), greedy,
   ``--new-tokens`` each. Reports generated tokens/s, p50/p99 latency, rows per forward pass and, under
   module batching, rows per level module and the time per stage (embed, mask, layout, blocks, head),
   and, routed, the prompts and time per router pass, all from the server's ``/metrics``; and the cores
   busy (CPU seconds per second) in each server with its router process, and in the clients; where each
   server and its router process ran (``cpus_seen``: ``dipaco serve --router-cpus``, ``auto`` unless given).
   Targets (issue 61, on a 4x4 grid: ``--grid 4x4``): module >= 3x
   unbatched throughput and >= 0.8 of pinned (routed, and named), module p99 no worse than per-path batching.
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
9. **Soak** (``--soak N``): ``N`` closed-loop clients of traffic as varied as users send (:class:`VariedTraffic`:
   both APIs, streamed and not, prompts across the whole cap, greedy and seeded sampling, stops) against one
   `dipaco serve` (``--max-batch``, ``--batching``) for ``--seconds``, in windows of ``--window`` seconds; the RSS of
   the server with its router process, and the server's open descriptors (``/proc/PID``), sampled every
   ``--sample-every`` seconds. Reports p50/p99 and statuses per window, and RSS growth and slope (least squares)
   after ``--settle`` seconds. Targets: RSS from ``--settle`` to the end grows <= 2%, every window's p99 within
   20% of the first's, 0 responses of 500.

With no ``--run`` it builds a small run first (configs/demo.yaml: BBC News, 4-layer d=128 paths,
2x2 grid, LM-prefix k-means routing) with few training steps: quality is irrelevant to latency.
Parts 5-9 (those asked for) share one report; parts 1-3 and part 4 each write their own. Every report
records the command, the machine (``environment``: :func:`bench.harness.environment`) and the run served.

    python -m bench serve --out bench_serve.json
    python -m bench serve --run runs/demo --experiment dipaco_2x2
    python -m bench serve --abuse --seconds 60 --out bench_serve_abuse.json
    python -m bench serve --concurrency 16 --seconds 60 --agreement 200 --out bench_serve_batching.json
    python -m bench serve --grid 4x4 --concurrency 16 --seconds 60 --agreement 200 --out bench_serve_modules.json
    python -m bench serve --hold-idle 300 --nofile 256 --seconds 70 --out bench_serve_held.json
    python -m bench serve --apis 16 --seconds 60 --out bench_serve_apis.json
    python -m bench serve --soak 16 --seconds 1800 --settle 300 --out bench_serve_soak.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import http.client
import itertools
import json
import math
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bench.harness import (
    REPO,
    Column,
    argument_parser,
    command_line,
    environment,
    free_port,
    markdown_table,
    process_tree,
    write_json,
)

if TYPE_CHECKING:
    from dipaco.serve.pipeline import Pipeline, PlannedGeneration

Json = dict[str, Any]
Body = bytes | Callable[[], Iterable[bytes]]  # a body, or a function giving the chunks of a chunked one
NO_ANSWER = (OSError, http.client.HTTPException)  # a request the server never answered


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argument_parser("serve", __doc__)
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
    p.add_argument("--server-cpus", help="concurrency: every server's CPUs (taskset -c list; default: any)")
    p.add_argument("--router-cpus", help="concurrency: dipaco serve --router-cpus (a list, auto or none: where the "
                                         "router process runs, the server off it) in every mode that has one (not "
                                         "inline); default: dipaco serve's (auto)")
    p.add_argument("--client-cpus", help="concurrency: the clients' CPUs (this process's, while it loads the servers)")
    p.add_argument("--modes", default="unbatched,path,module,inline,named,pinned",
                   help=f"concurrency: the servers to compare, of {', '.join(SERVER_MODES)}")
    p.add_argument("--grid", default="2x2", help="the grid of the run built when --run has none (e.g. 4x4: 16 paths)")
    p.add_argument("--agreement", type=int, help="part 6: this many prompts, batched against alone")
    p.add_argument("--hold-idle", type=int, help="part 7: hold this many idle / slow-header connections open")
    p.add_argument("--nofile", type=int, default=256, help="hold-idle: the server's ulimit -n")
    p.add_argument("--apis", type=int, help="part 8: this many closed-loop clients through generate and completions")
    p.add_argument("--rounds", type=int, default=3,
                   help="concurrency and apis: rounds, the servers (or APIs) loaded in turn --seconds / rounds each")
    p.add_argument("--soak", type=int, help="part 9: this many closed-loop clients for --seconds, RSS and descriptors sampled")
    p.add_argument("--window", type=float, default=60.0, help="soak: p50/p99 per window of this many seconds")
    p.add_argument("--settle", type=float, default=300.0, help="soak: RSS growth and slope measured after this many seconds")
    p.add_argument("--sample-every", type=float, default=10.0, help="soak: seconds between RSS / descriptor samples")
    p.add_argument("--batching", choices=("module", "path"), default="module", help="soak: the server's --batching")
    p.add_argument("--heap-trim-s", type=float, help="soak: the server's --heap-trim-s (default: dipaco serve's)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


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


# --- measuring: latencies, loads of client threads ---------------------------------------------------
def percentiles(ms: list[float]) -> Json:
    a = np.asarray(ms)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean()), "n": int(a.size)}


def ms_since(start: float) -> float:
    """Milliseconds since ``start``, a ``time.perf_counter()`` reading: every latency here is one."""
    return (time.perf_counter() - start) * 1000


def run_clients(client: Callable[[int], None], clients: int) -> float:
    """``client(0)`` .. ``client(clients - 1)`` on as many threads at once; the wall seconds until the last returns.
    Every HTTP load here (a fixed number of requests, a closed loop, the abuse mix) is this with its own client."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    return time.perf_counter() - start


def latency_text(row: Mapping[str, Any]) -> str:
    """A load's p50 and p99 for a progress line (0 when nothing was answered)."""
    return f"p50 {row.get('p50_ms', 0):.0f} ms, p99 {row.get('p99_ms', 0):.0f} ms"


def fixed(key: str, spec: str) -> Callable[[Mapping[str, Any]], str | None]:
    """A table cell: ``row[key]`` formatted with ``spec``, or none when the row lacks it."""
    return lambda row: None if row.get(key) is None else format(row[key], spec)


LATENCY_COLUMNS: list[Column] = [("p50 ms", fixed("p50_ms", ".1f")), ("p99 ms", fixed("p99_ms", ".1f"))]


# --- prompts -------------------------------------------------------------------------------------------
def validation_split(pipe: Pipeline) -> Any:
    """The validation documents of the served experiment's run (its stored config, read by the root)."""
    from dipaco.run import Run, load_config

    cfg = load_config(pipe.loaded.dir / "config.yaml", [f"run.dir={pipe.loaded.run.root}"])
    return Run(cfg).prepared().validation


def prompts_from_run(pipe: Pipeline, n: int, n_tokens: int) -> list[str]:
    ids = [d[:n_tokens] for d in validation_split(pipe)["input_ids"] if len(d) >= n_tokens]
    return [pipe.decode(d) for d in ids[:n]]


def varied_prompts(pipe: Pipeline, n: int, max_tokens: int) -> list[str]:
    """``n`` validation texts cut to between ``max_tokens // 2`` and ``max_tokens`` tokens (a fixed cycle),
    so a batch holds prompts of different lengths and is left-padded."""
    docs = [d for d in validation_split(pipe)["input_ids"] if len(d) >= max_tokens]
    if len(docs) < n:
        docs = (docs * (n // max(len(docs), 1) + 1))[:n]
    low = max(1, max_tokens // 2)
    return [pipe.decode(d[: low + (i * 7) % (max_tokens - low + 1)]) for i, d in enumerate(docs[:n])]


def encode_bodies(prompts: list[str], paths: Sequence[int] | None = None, **fields: Any) -> list[bytes]:
    """A JSON request body per prompt: ``{"prompt": ..., **fields}``, with ``"path"`` the prompt's of ``paths``."""
    named = [{} for _ in prompts] if paths is None else [{"path": k} for k in paths]
    return [json.dumps({"prompt": p, **fields, **n}).encode() for p, n in zip(prompts, named, strict=True)]


# --- parts 1 and 2: in one process -----------------------------------------------------------------------
def bench_latency(pipe: Pipeline, prompts: list[str], new_tokens: int, warmup: int) -> Json:
    """Parts 1 and 2, interleaved per prompt in rotating order: routed pipeline, dense model, every path."""
    tok = pipe.tokenizer
    dense = copy.deepcopy(pipe.cache.template)  # same shape; its own (untrained) weights: the compute is the same
    every = copy.deepcopy(pipe.cache.template)  # recomposed for each path in turn
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def encode(prompt: str) -> torch.Tensor:
        return torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])

    def generate(model: Any, ids: torch.Tensor) -> None:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert out.shape[1] - ids.shape[1] == new_tokens

    def run_pipeline(prompt: str) -> None:
        assert pipe.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens).completion_tokens == new_tokens

    def run_all_paths(prompt: str) -> None:
        ids = encode(prompt)
        for p in range(pipe.num_paths):
            pipe.bank.load_path(p, every)
            generate(every, ids)

    sides: dict[str, Callable[[str], None]] = {"pipeline": run_pipeline, "dense": lambda p: generate(dense, encode(p)),
                                               "all_paths": run_all_paths}
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
            start_cpu, start = time.process_time(), time.perf_counter()
            sides[side](prompt)
            times[side].append(ms_since(start))
            cpu[side].append((time.process_time() - start_cpu) * 1000)
        start = time.perf_counter()
        paths.append(pipe.route(prompt)[0])
        times["route_only"].append(ms_since(start))
    out: Json = {k: percentiles(v) for k, v in times.items()}
    for k in sides:
        out[k]["cpu_p50_ms"] = float(np.median(cpu[k]))
    # Per prompt, the pipeline and the dense model ran back to back: the median of those paired
    # ratios is robust to load that drifts over the run.
    pipeline, dense, every_path = out["pipeline"], out["dense"], out["all_paths"]
    for k in (pipeline, dense):
        k["tokens_per_s"] = new_tokens / (k["p50_ms"] / 1000)
    every_path.update(paths=pipe.num_paths, tokens_per_s_per_prompt=new_tokens / (every_path["p50_ms"] / 1000))
    out.update(paired_ratio_median=float(np.median(np.array(times["pipeline"]) / np.array(times["dense"]))),
               cpu_ratio_p50=pipeline["cpu_p50_ms"] / dense["cpu_p50_ms"], ratio_p50=pipeline["p50_ms"] / dense["p50_ms"],
               ratio_mean=pipeline["mean_ms"] / dense["mean_ms"], all_paths_ratio_p50=every_path["p50_ms"] / pipeline["p50_ms"],
               paths_used=np.bincount(paths, minlength=pipe.num_paths).tolist(), cache=pipe.cache.stats())
    return out


# --- the server: started, asked, scraped ------------------------------------------------------------------
def exchange(conn: http.client.HTTPConnection, method: str, path: str, body: Body | None = None) -> tuple[int, bytes]:
    """One request on ``conn`` (reconnected if closed): its status and whole answer. A callable ``body`` gives the
    chunks of a chunked body (no Content-Length). Raises OSError/HTTPException when the server does not answer."""
    headers = {} if body is None else {"Content-Type": "application/json"}
    if callable(body):
        conn.request(method, path, body=body(), headers=headers, encode_chunked=True)
    else:
        conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


def request(port: int, method: str, path: str, body: Body | None = None, timeout: float = 300) -> tuple[int, bytes]:
    """:func:`exchange` on a new connection to the server on loopback ``port``, closed after."""
    with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)) as conn:
        return exchange(conn, method, path, body)


class Tally:
    """What a load's requests got, added up from its client threads: each answer's status (the exception's name for
    a request the server never answered) and, for the answers of 200, their latency and new tokens (``tokens_of``).
    Parts 3, 4, 5, 8 and 9 all count their requests with it."""

    def __init__(self, tokens_of: Callable[[bytes], int] | None = None) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[int | str] = Counter()
        self.latencies: list[float] = []
        self.tokens = 0
        self.tokens_of = tokens_of

    def post(self, conn: http.client.HTTPConnection, path: str, body: Body) -> tuple[int | None, float]:
        """POSTs ``body`` on ``conn`` and records what came back: (its status, or None with no answer; milliseconds).
        With no answer ``conn`` is closed, so that its next request opens a new connection."""
        start = time.perf_counter()
        try:
            status, reply = exchange(conn, "POST", path, body)
        except NO_ANSWER as exc:
            conn.close()
            with self.lock:
                self.statuses[type(exc).__name__] += 1
            return None, ms_since(start)
        elapsed = ms_since(start)
        tokens = self.tokens_of(reply) if status == 200 and self.tokens_of else 0
        with self.lock:
            self.statuses[status] += 1
            if status == 200:
                self.latencies.append(elapsed)
                self.tokens += tokens
        return status, elapsed

    def summary(self, clients: int, wall: float, keep_latencies: bool = False) -> Json:
        """The load's figures over ``wall`` seconds; the latencies themselves with ``keep_latencies``."""
        n = len(self.latencies)
        return {"clients": clients, "wall_s": wall, "requests": n, "tokens": self.tokens, "tokens_per_s": self.tokens / wall,
                "requests_per_s": n / wall, "statuses": {str(k): v for k, v in self.statuses.items()},
                **(percentiles(self.latencies) if n else {}), **({"latencies_ms": self.latencies} if keep_latencies else {})}


def generated_tokens(reply: bytes) -> int:
    """The new tokens of a /v1/generate answer."""
    return json.loads(reply)["completion_tokens"]


def closed_loop(port: int, bodies: list[bytes], clients: int, seconds: float = math.inf, endpoint: str = "/v1/generate",
                tokens_of: Callable[[bytes], int] = generated_tokens, keep_latencies: bool = False,
                requests: int | None = None, keep_alive: bool = True) -> Json:
    """``clients`` threads, each sending its next request as soon as the last is answered (its whole body read), for
    ``seconds`` or ``requests`` requests each, on its own kept-alive connection or (``keep_alive=False``) a new one per
    request. Request r of client c is ``bodies[(c + r * clients) % len(bodies)]``; ``tokens_of(body)``: the new
    tokens of an answer."""
    tally = Tally(tokens_of)
    deadline = time.monotonic() + seconds

    def client(c: int) -> None:
        with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=120)) as conn:
            r = 0
            while time.monotonic() < deadline and r != requests:
                tally.post(conn, endpoint, bodies[(c + r * clients) % len(bodies)])
                r += 1
                if not keep_alive:
                    conn.close()

    return tally.summary(clients, run_clients(client, clients), keep_latencies)


def healthy(port: int) -> bool:
    """Whether the server on ``port`` answers /healthz with 200 (False while it starts)."""
    try:
        return request(port, "GET", "/healthz", timeout=2)[0] == 200
    except NO_ANSWER:
        return False


@contextlib.contextmanager
def dipaco_serve(run: Path, experiment: str | None, threads: int | None, cache_size: int = 16,
                 extra_args: tuple[str, ...] = (), nofile: int | None = None,
                 cpus: tuple[int, ...] | None = None) -> Iterator[tuple[int, subprocess.Popen]]:
    """`dipaco serve` in a subprocess on a free loopback port, up and healthy; yields (port, process).

    ``extra_args``: more `dipaco serve` flags (``--max-batch 1``); ``nofile``: its RLIMIT_NOFILE
    (``ulimit -n``); ``cpus``: the CPUs it runs on (``taskset -c``). Its stderr (the access log: a line per
    request) goes to a file, not a pipe that nobody reads: a full pipe blocks the server.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "dipaco", "serve", "--run", str(run), "--port", str(port),
           "--cache-size", str(cache_size), "--host", "127.0.0.1", *extra_args]
    if experiment:
        cmd += ["--experiment", experiment]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))

    def limit() -> None:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if cpus:
            os.sched_setaffinity(0, cpus)
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=REPO, preexec_fn=limit)

    def failed(why: str) -> RuntimeError:
        log.seek(0)
        return RuntimeError(f"dipaco serve {why}: {log.read().decode(errors='replace')[-2000:]}")

    try:
        deadline = time.monotonic() + 300
        while not healthy(port):
            if server.poll() is not None:
                raise failed("exited")
            if time.monotonic() > deadline:
                raise failed("did not come up")
            time.sleep(0.5)
        yield port, server
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def rss_kb(pid: int) -> dict[str, int]:
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


def server_descriptors(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def scrape(port: int) -> list:
    """The server's /metrics samples, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = request(port, "GET", "/metrics", timeout=30)[1].decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def metric_total(samples: list, name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def metric_by_label(samples: list, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in samples if s.name == name}


# --- part 3: a fixed number of requests per client ---------------------------------------------------------
def bench_http(run: Path, experiment: str | None, prompts: list[str], new_tokens: int, clients: list[int],
               requests: int, threads: int | None) -> Json:
    """Part 3: `dipaco serve` in a subprocess; for each N of ``clients``, N concurrent clients sending ``requests``
    requests each, a new connection per request. An answer other than 200 stops the benchmark."""
    bodies = encode_bodies(prompts, max_new_tokens=new_tokens)
    with dipaco_serve(run, experiment, threads) as (port, _):
        for body in bodies[:8]:  # warm up every path the prompts route to
            request(port, "POST", "/v1/generate", body)
        runs = []
        for n in clients:
            row = closed_loop(port, bodies, n, requests=requests, keep_alive=False)
            if row["statuses"] != {"200": row["requests"]}:
                raise RuntimeError(f"dipaco serve answered {row['statuses']} to {n} clients (only 200 expected)")
            runs.append(row)
            print(f"[bench] http clients={n}: {row['requests_per_s']:.2f} req/s, {row['tokens_per_s']:.0f} tok/s, "
                  f"p50 {row['p50_ms']:.0f} ms", flush=True)
        return {"port": port, "runs": runs}


def print_latency(report: Json) -> None:
    """Parts 1-3 as tables."""
    s = report["single_path"]
    a, dense_p50 = s["all_paths"], s["dense"]["p50_ms"]
    rows = [{"name": "dense LlamaForCausalLM.generate (no routing)", **s["dense"]},
            {"name": "Pipeline: route + cached path + generate", **s["pipeline"]},
            {"name": f"every path per prompt ({a['paths']} compose+generate)", **a,
             "tokens_per_s": a["tokens_per_s_per_prompt"]},
            {"name": "of which routing alone", **s["route_only"]}]
    print()
    print(markdown_table(rows, [(f"generate {report['new_tokens']} tokens", "name"), *LATENCY_COLUMNS,
                                ("tok/s (p50)", fixed("tokens_per_s", ".0f")),
                                ("vs dense", lambda r: f"{r['p50_ms'] / dense_p50:.2f}x" if "tokens_per_s" in r else None)]))
    print(f"pipeline / dense: p50 {s['ratio_p50']:.3f}x, mean {s['ratio_mean']:.3f}x, median of paired ratios "
          f"{s['paired_ratio_median']:.3f}x, CPU time p50 {s['cpu_ratio_p50']:.3f}x (target <= 1.1x); "
          f"paths used {s['paths_used']}")
    if report["http"]:
        print()
        print(markdown_table(report["http"]["runs"], [
            ("dipaco serve, clients", "clients"), ("req/s", fixed("requests_per_s", ".2f")),
            ("tok/s", fixed("tokens_per_s", ".0f")), *LATENCY_COLUMNS]))


# --- part 4: abuse ----------------------------------------------------------------------------------
MB = 1024 * 1024
LARGE_KINDS = ("body_50mb", "chunked_10mb", "route_10mb")  # the large invalid requests


def abuse_requests(prompt: str, caps: Json) -> dict[str, tuple[str, Body, set[int]]]:
    """Per kind: (path, body: bytes or a function giving the chunks of a chunked body, expected statuses)."""
    max_chars = caps["max_prompt_chars"]
    positions = caps["positions"]  # a prompt and its new tokens together: data.seq_len, or an imported checkpoint's
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
        "too_many_new_tokens": ("/v1/generate", j({"prompt": prompt, "max_new_tokens": positions}), {422}),
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


def bench_abuse(run: Path, experiment: str | None, prompts: list[str], clients: int, seconds: float,
                threads: int | None, invalid: bool = True) -> Json:
    """Part 4: mixed valid and invalid requests from ``clients`` clients for ``seconds``.

    With ``invalid=False`` (the control) the same clients send only the small valid requests: the
    latency the machine gives them without abuse."""
    with dipaco_serve(run, experiment, threads, cache_size=4) as (port, server):
        caps = json.loads(request(port, "GET", "/healthz", timeout=30)[1])
        kinds = abuse_requests(prompts[0], caps)
        small = encode_bodies(prompts, max_new_tokens=8)
        for body in small[:16]:  # warm up: every path composed, every thread's tokenizer copied
            request(port, "POST", "/v1/generate", body, 60)
        rss_before = rss_kb(server.pid)
        # Each client cycles through this schedule, from its own offset: half of the requests are small
        # valid ones, the rest every invalid kind once per cycle (the large ones included).
        schedule: list[str] = []
        for k in (k for k in kinds if not k.startswith("valid_")):
            schedule += [k if invalid else "valid_generate", "valid_generate" if len(schedule) % 4 else "valid_route"]
        tallies = {k: Tally() for k in kinds}
        lock = threading.Lock()
        during_large: list[float] = []  # small valid generate latencies while a large request was in flight
        large_in_flight = [0]
        deadline = time.monotonic() + seconds

        def client(c: int) -> None:
            i = c * 5
            while time.monotonic() < deadline:
                kind = schedule[i % len(schedule)]
                i += 1
                path, body, _ = kinds[kind]
                large = kind in LARGE_KINDS
                with lock:
                    large_in_flight[0] += large
                    large_before = large_in_flight[0] > 0
                with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=120)) as conn:
                    status, elapsed = tallies[kind].post(conn, path, small[i % len(small)] if kind == "valid_generate" else body)
                with lock:
                    large_in_flight[0] -= large
                    if kind == "valid_generate" and status == 200 and (large_before or large_in_flight[0] > 0):
                        during_large.append(elapsed)

        wall = run_clients(client, clients)
        time.sleep(2.0)  # let the server finish and free what the last requests held
        rss_after = rss_kb(server.pid)
        alive = server.poll() is None
    # A tally's int keys are the statuses answered; its str keys, the exceptions of requests with no answer.
    answered = {k: {s: n for s, n in sorted(t.statuses.items()) if isinstance(s, int)} for k, t in tallies.items()}
    counts: Counter[int] = sum((Counter(c) for c in answered.values()), Counter())
    dropped = {f"{k}: {s}": n for k, t in tallies.items() for s, n in t.statuses.items() if isinstance(s, str)}
    n = sum(counts.values()) + sum(dropped.values())
    out: Json = {
        "invalid_requests": invalid, "clients": clients, "seconds": seconds, "wall_s": wall, "requests": n,
        "requests_per_s": n / wall,
        "caps": {k: caps.get(k) for k in ("seq_len", "positions", "max_prompt_tokens", "max_prompt_chars",
                                          "max_new_tokens_cap", "max_body_bytes", "routing_prefix_tokens")},
        "status_counts": {str(k): v for k, v in sorted(counts.items())},
        "status_by_kind": {k: {str(s): v for s, v in c.items()} for k, c in answered.items()},
        "responses_500": sum(v for k, v in counts.items() if k >= 500),
        "dropped_connections": sum(dropped.values()), "dropped_by_kind": dropped,
        "unexpected_status": {f"{k}: {s}": v for k, c in answered.items() for s, v in c.items() if s not in kinds[k][2]},
        "latency": {k: percentiles(tallies[k].latencies) if tallies[k].latencies else None
                    for k in ("valid_generate", "valid_route")},
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


def print_abuse(a: Json) -> None:
    print()
    print(f"abuse: {a['clients']} clients, {a['wall_s']:.1f} s, {a['requests']} requests ({a['requests_per_s']:.1f}/s); "
          f"status {a['status_counts']}; 500s {a['responses_500']}; dropped {a['dropped_connections']}; "
          f"unexpected {a['unexpected_status'] or 'none'}")
    rows = [{"kind": k, **row} for k, row in a["latency"].items() if row]
    if a["valid_generate_while_large_in_flight"]:
        rows.append({"kind": "valid_generate while a large invalid request was in flight",
                     **a["valid_generate_while_large_in_flight"]})
    print(markdown_table(rows, [("requests", "kind"), ("n", "n"), *LATENCY_COLUMNS]))
    r = a["server_rss_kb"]
    growth = "?" if r["growth"] is None else f"{100 * r['growth']:+.1f}%"
    print(f"  server RSS: {r['before']} kB before, {r['after']} kB after ({growth}), peak {r['peak']} kB")
    print(f"  targets: {a['targets']}")


# --- parts 5, 8, 9: closed-loop loads -------------------------------------------------------------------
def all_statuses(loads: list[Json]) -> dict[str, int]:
    """The statuses of several closed-loop loads (rounds, windows), added up."""
    return dict(sum((Counter(load["statuses"]) for load in loads), Counter()))


def combined(loads: list[Json]) -> Json:
    """Closed-loop loads run with ``keep_latencies`` in parts (rounds) as one: their requests, tokens, tokens/s over
    their summed wall time, statuses, and the percentiles of every latency."""
    latencies = [ms for load in loads for ms in load.pop("latencies_ms")]
    wall, tokens = sum(load["wall_s"] for load in loads), sum(load["tokens"] for load in loads)
    return {"requests": len(latencies), "tokens": tokens, "tokens_per_s": tokens / wall,
            "statuses": all_statuses(loads), **(percentiles(latencies) if latencies else {})}


# The servers part 5 compares: name -> (flags, the requests' paths: "routed" by the server, "named" by the client
# (the path the router picks for the prompt, routed ahead: the same rows without the server's routing), or "pinned":
# every request naming --pin-path, default 0).
SERVER_MODES = {
    "unbatched": (("--max-batch", "1", "--batching", "path"), "routed"),
    "path": (("--batching", "path"), "routed"),  # per-path batching: rows of one path per forward pass
    "module": (("--batching", "module"), "routed"),  # module batching: rows of any paths, level by level
    "inline": (("--batching", "module", "--no-router-process"), "routed"),  # the same, the router in the server's process
    "named": (("--batching", "module"), "named"),  # module batching, the router's paths named by the clients
    "pinned": (("--batching", "module"), "pinned"),  # module batching, every request naming one path
}


def parse_modes(text: str) -> tuple[str, ...]:
    """``--modes``: names of SERVER_MODES. Not rows of the harness: a mode takes no ``@key=value`` overrides."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in SERVER_MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: {', '.join(unknown) or 'none given'}: choose from {', '.join(SERVER_MODES)}")
    return modes


@dataclass(frozen=True)
class Placement:
    """The CPUs each side of the concurrency part runs on (None: wherever the OS puts it): every server, the router
    process of every mode that has one, and the clients."""

    server: tuple[int, ...] | None = None
    router: tuple[int, ...] | str | None = None  # or dipaco serve's words: "auto" (its default), "none"
    clients: tuple[int, ...] | None = None

    def router_flags(self, flags: Sequence[str]) -> tuple[str, ...]:
        if self.router is None or "--no-router-process" in flags:
            return ()
        return ("--router-cpus", self.router if isinstance(self.router, str) else ",".join(map(str, self.router)))

    def as_json(self) -> Json:
        return {side: list(cpus) if isinstance(cpus, tuple) else cpus for side, cpus in vars(self).items()}


@contextlib.contextmanager
def running_on(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """This process (the clients' threads included) on ``cpus`` for the block, then where it was."""
    before = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def bench_concurrency(run: Path, experiment: str | None, prompts: list[str], clients: int, seconds: float,
                      warmup_s: float, new_tokens: int, threads: int | None, max_batch: int, batch_wait_ms: float,
                      decode_workers: int = 1, path: int | None = None,
                      modes: tuple[str, ...] = ("unbatched", "path", "module", "pinned"), cache_size: int = 4,
                      routed_paths: list[int] | None = None, rounds: int = 1, placement: Placement = Placement()) -> Json:
    """Part 5: the same closed-loop load on one `dipaco serve` per mode (:data:`SERVER_MODES`), every server up at
    once and loaded in turn, ``seconds / rounds`` at a time for ``rounds`` rounds (each round in another order), so
    that a drift of this shared machine's speed falls on every mode alike. ``path``: the path of the pinned mode
    (default 0); ``cache_size``: the servers' composed paths (at least the run's paths, or the per-path modes would
    compose a path per request); ``routed_paths``: each prompt's path as the router picks it, which the ``named``
    mode's requests name."""
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    out: Json = {"clients": clients, "seconds": seconds, "rounds": rounds, "new_tokens": new_tokens,
                 "prompts": len(prompts), "pinned_path": path or 0, "cpus": placement.as_json()}
    loads: dict[str, tuple[tuple[str, ...], str, list[bytes]]] = {}
    for name in modes:
        flags, paths = SERVER_MODES[name]
        if paths == "named" and routed_paths is None:
            raise ValueError("the named mode needs routed_paths: each prompt's path, as the router picks it")
        named = {"routed": None, "named": routed_paths, "pinned": [path or 0] * len(prompts)}[paths]
        flags = (*flags, "--batch-wait-ms", str(batch_wait_ms), "--decode-workers", str(decode_workers),
                 *placement.router_flags(flags))
        if "--max-batch" not in flags:
            flags = (*flags, "--max-batch", str(max_batch))
        loads[name] = flags, paths, encode_bodies(prompts, named, max_new_tokens=new_tokens)
    with contextlib.ExitStack() as stack:
        stack.enter_context(running_on(placement.clients))
        servers = {name: stack.enter_context(dipaco_serve(run, experiment, threads, cache_size=cache_size,
                                                          extra_args=flags, cpus=placement.server))
                   for name, (flags, _, _) in loads.items()}
        for name, (port, _) in servers.items():
            closed_loop(port, loads[name][2], clients, warmup_s)
        # An idle server neither decodes nor routes, so one scrape before its first round and one after its last
        # count its loaded seconds only.
        before = {name: (scrape(port), cpu_seconds(server.pid)) for name, (port, server) in servers.items()}
        parts: dict[str, list[Json]] = {name: [] for name in servers}
        names = list(servers)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                port = servers[name][0]
                parts[name].append(closed_loop(port, loads[name][2], clients, seconds / rounds, keep_latencies=True))
        after = {name: (scrape(port), cpu_seconds(server.pid)) for name, (port, server) in servers.items()}
        seen = {name: affinities(server.pid) for name, (_, server) in servers.items()}
    for name, (flags, paths, _) in loads.items():
        wall = sum(part["wall_s"] for part in parts[name])
        row = combined(parts[name])
        row.update(forward_passes(before[name][0], after[name][0]))
        # Cores busy over its load: the server with its router process (CPU seconds per second).
        row["server_cores"] = (after[name][1]["server"] - before[name][1]["server"]) / wall
        row.update(wall_s=wall, cache_size=cache_size, server_flags=" ".join(flags), paths=paths, cpus_seen=seen[name])
        out[name] = row
        module = f", {row['rows_per_module']:.1f} rows per module" if row.get("rows_per_module") else ""
        print(f"[bench] {name} ({row['server_flags']}), {clients} clients: {row['tokens_per_s']:.0f} tok/s, "
              f"{latency_text(row)}, {row['mean_batch_size'] or 0:.1f} rows per pass{module}; server cores busy "
              f"{row['server_cores']:.2f}", flush=True)
    first, last = before[names[0]][1], after[names[0]][1]
    out["client_cores"] = (last["clients"] - first["clients"]) / sum(out[name]["wall_s"] for name in names)
    out.update(concurrency_targets(out))
    return out


def affinities(server_pid: int) -> Json:
    """The CPUs the server process may run on, and each of its descendants' (the router's process among them):
    where ``dipaco serve --router-cpus`` put them."""
    out: Json = {"server": sorted(os.sched_getaffinity(server_pid)), "children": []}
    for pid in sorted(process_tree(server_pid) - {server_pid}):
        with contextlib.suppress(OSError):  # gone meanwhile
            out["children"].append(sorted(os.sched_getaffinity(pid)))
    return out


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the server process and its descendants (the router's process), read from
    /proc (Linux), and by this process (the clients)."""
    tick = os.sysconf("SC_CLK_TCK")
    server = 0.0
    for pid in process_tree(server_pid):
        try:  # utime and stime: the 12th and 13th fields after the ")" that ends the name
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        server += (int(fields[11]) + int(fields[12])) / tick
    return {"server": server, "clients": time.process_time()}


def forward_passes(before: list, after: list) -> Json:
    """What the server's forward passes held over a load, from its /metrics before and after: rows per pass,
    and under module batching the rows per level module and the share of time per stage."""
    def delta(name: str) -> float:
        return metric_total(after, name) - metric_total(before, name)

    passes, rows = delta("dipaco_batch_size_count"), delta("dipaco_batch_size_sum")
    out: Json = {"batches": int(passes), "mean_batch_size": rows / passes if passes else None}
    routed = delta("dipaco_routed_requests_total")
    if routed:  # requests the server routed: prompts and time per router pass, and a route from asking (waits included)
        was = metric_by_label(before, "dipaco_router_seconds_total", "stage")
        now = metric_by_label(after, "dipaco_router_seconds_total", "stage")
        router_passes = delta("dipaco_router_passes_total")
        out["router"] = {"prompts_per_pass": routed / router_passes,
                         "pass_ms": 1000 * (now["pass"] - was.get("pass", 0.0)) / router_passes,
                         "request_ms": 1000 * (now["request"] - was.get("request", 0.0)) / routed}
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


def concurrency_targets(out: Json) -> Json:
    """Throughput and p99 ratios between the modes measured, and issue 61's targets for module batching."""
    def ratio(a: str, b: str, key: str) -> float | None:
        if a in out and b in out and out[b].get(key):
            return out[a][key] / out[b][key]
        return None

    ratios = {"path_vs_unbatched": ratio("path", "unbatched", "tokens_per_s"),
              "module_vs_unbatched": ratio("module", "unbatched", "tokens_per_s"),
              "module_vs_path": ratio("module", "path", "tokens_per_s"),
              "module_vs_pinned": ratio("module", "pinned", "tokens_per_s"),
              "module_vs_inline": ratio("module", "inline", "tokens_per_s"),
              "named_vs_pinned": ratio("named", "pinned", "tokens_per_s"),
              "module_p99_vs_path": ratio("module", "path", "p99_ms")}
    checks = {"module_ge_3x_unbatched": ("module_vs_unbatched", lambda r: r >= 3.0),
              "module_ge_0.8_of_pinned": ("module_vs_pinned", lambda r: r >= 0.8),
              "named_ge_0.8_of_pinned": ("named_vs_pinned", lambda r: r >= 0.8),
              "module_p99_no_worse_than_path": ("module_p99_vs_path", lambda r: r <= 1.0)}
    targets = {name: check(ratios[key]) for name, (key, check) in checks.items() if ratios[key] is not None}
    return {"ratios": ratios, "targets": targets}


def completion_tokens(reply: bytes) -> int:
    """The new tokens of a /v1/completions answer, whole or streamed (its usage chunk, before [DONE])."""
    if reply.startswith(b"data: "):
        events = [e[len(b"data: "):] for e in reply.split(b"\n\n") if e.startswith(b"data: {")]
        return json.loads(events[-1])["usage"]["completion_tokens"]
    return json.loads(reply)["usage"]["completion_tokens"]


def bench_apis(run: Path, experiment: str, prompts: list[str], clients: int, seconds: float, warmup_s: float,
               new_tokens: int, threads: int | None, max_batch: int, batch_wait_ms: float, rounds: int = 3) -> Json:
    """Part 8: one batched server, the same closed-loop load through the three APIs, interleaved in ``rounds``."""
    openai: dict[str, Any] = {"model": experiment, "max_tokens": new_tokens, "temperature": 0}
    apis: dict[str, tuple[str, list[bytes], Callable[[bytes], int]]] = {  # name: (endpoint, bodies, tokens of an answer)
        "generate": ("/v1/generate", encode_bodies(prompts, max_new_tokens=new_tokens), generated_tokens),
        "completions": ("/v1/completions", encode_bodies(prompts, **openai), completion_tokens),
        "completions_stream": ("/v1/completions", encode_bodies(prompts, **openai, stream=True,
                                                                stream_options={"include_usage": True}),
                               completion_tokens),
    }
    flags = ("--max-batch", str(max_batch), "--batch-wait-ms", str(batch_wait_ms))
    runs: dict[str, list[Json]] = {name: [] for name in apis}
    with dipaco_serve(run, experiment, threads, cache_size=4, extra_args=flags) as (port, _):
        for endpoint, bodies, count in apis.values():
            closed_loop(port, bodies, clients, warmup_s, endpoint, count)
        names = list(apis)
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                endpoint, bodies, count = apis[name]
                runs[name].append(closed_loop(port, bodies, clients, seconds / rounds, endpoint, count, keep_latencies=True))
    out: Json = {"clients": clients, "seconds": seconds, "rounds": rounds, "new_tokens": new_tokens,
                 "server_flags": " ".join(flags)}
    for name, parts in runs.items():
        out[name] = combined(parts)
        print(f"[bench] {name}, {clients} clients: {out[name]['tokens_per_s']:.0f} tok/s, {latency_text(out[name])}",
              flush=True)
    base = out["generate"]
    out["targets"] = {}
    for name in ("completions", "completions_stream"):
        row = out[name]
        row["throughput_vs_generate"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
        row["p99_vs_generate"] = row["p99_ms"] / base["p99_ms"] if "p99_ms" in row and "p99_ms" in base else None
        out["targets"][f"{name}_within_10pct"] = ((row["throughput_vs_generate"] or 0) >= 0.9
                                                  and (row["p99_vs_generate"] or 2) <= 1.1)
    return out


class ProcSampler(threading.Thread):
    """Every ``every`` seconds: (seconds since start, VmRSS of process ``pid`` in MB, its open descriptors, VmRSS of
    ``pid`` and its descendants in MB: a server with its router process)."""

    def __init__(self, pid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.stop = pid, every, threading.Event()
        self.samples: list[tuple[float, float, int | None, float]] = []
        self.start_time = time.monotonic()

    def run(self) -> None:
        while True:
            rss = rss_kb(self.pid).get("VmRSS")
            if rss is not None:
                tree = sum(rss_kb(p).get("VmRSS", 0) for p in process_tree(self.pid))
                self.samples.append((time.monotonic() - self.start_time, rss / 1024, server_descriptors(self.pid),
                                     tree / 1024))
            if self.stop.wait(self.every):
                return


STOP_STRINGS = (".", " the", "\n", ",")


@dataclass(frozen=True)
class VariedTraffic:
    """The soak's requests, as varied as users send them (issue 76: a narrow load hid a per-request leak). Each
    request draws from its client's own seeded generator:

    - an API, in equal shares: ``/v1/generate``, ``/v1/completions``, ``/v1/completions`` streamed (server-sent
      events, usage in the last chunk);
    - a prompt: a validation text cut, from a random token, to a length uniform over the whole prompt cap (1 up to
      the positions the new tokens leave, less a margin for a cut text's tokens changing when re-encoded);
    - decoding: greedy, or sampled (temperature 0.7-1.3, top_p 1 or 0.9) with a fresh seed;
    - 1 to ``new_tokens`` new tokens, and one of :data:`STOP_STRINGS` for one request in four."""

    docs: tuple[tuple[int, ...], ...]
    decode: Callable[[Sequence[int]], str]
    model: str
    positions: int
    new_tokens: int
    margin: int = 4

    @classmethod
    def of(cls, pipe: Pipeline, new_tokens: int) -> VariedTraffic:
        docs = tuple(tuple(d) for d in validation_split(pipe)["input_ids"] if len(d) > 1)
        return cls(docs, pipe.decode, pipe.experiment, pipe.spec.served_positions().limit, new_tokens)

    def draw(self, rng: np.random.Generator) -> tuple[str, bytes]:
        """(endpoint, JSON body) of one request."""
        new = int(rng.integers(1, self.new_tokens + 1))
        doc = self.docs[int(rng.integers(len(self.docs)))]
        longest = max(1, min(len(doc), self.positions - new - self.margin))
        length = int(rng.integers(1, longest + 1))
        at = int(rng.integers(0, len(doc) - length + 1))
        prompt = self.decode(doc[at:at + length]) or "The"
        sampled = rng.random() < 0.5
        fields: Json = {"temperature": round(float(rng.uniform(0.7, 1.3)), 2), "top_p": float(rng.choice([1.0, 0.9])),
                        "seed": int(rng.integers(2**31))} if sampled else {"temperature": 0.0}
        api = int(rng.integers(3))
        if api == 0:
            return "/v1/generate", json.dumps({"prompt": prompt, "max_new_tokens": new, **fields}).encode()
        if rng.random() < 0.25:
            fields["stop"] = str(rng.choice(STOP_STRINGS))
        body: Json = {"model": self.model, "prompt": prompt, "max_tokens": new, **fields}
        if api == 2:
            body.update(stream=True, stream_options={"include_usage": True})
        return "/v1/completions", json.dumps(body).encode()


def answer_tokens(reply: bytes) -> int:
    """The new tokens of an answer of /v1/generate or /v1/completions, whole or streamed."""
    if reply.startswith(b"data: "):
        return completion_tokens(reply)
    answer = json.loads(reply)
    return answer["usage"]["completion_tokens"] if "usage" in answer else answer["completion_tokens"]


def varied_loop(port: int, traffic: VariedTraffic, rngs: list[np.random.Generator], seconds: float) -> Json:
    """``len(rngs)`` closed-loop clients for ``seconds``, client c sending ``traffic.draw(rngs[c])`` one after
    another on its own kept-alive connection."""
    tally = Tally(answer_tokens)
    deadline = time.monotonic() + seconds

    def client(c: int) -> None:
        with contextlib.closing(http.client.HTTPConnection("127.0.0.1", port, timeout=120)) as conn:
            while time.monotonic() < deadline:
                tally.post(conn, *traffic.draw(rngs[c]))

    return tally.summary(len(rngs), run_clients(client, len(rngs)))


def growth(t: np.ndarray, mb: np.ndarray, settle_s: float) -> Json:
    """RSS figures of one sampled series: at the start, at ``settle_s``, at the end, the growth after ``settle_s``
    and its slope (least squares, MB a minute)."""
    late = t >= min(settle_s, t[-1])  # a run shorter than settle_s: its last sample alone
    slope = float(np.polyfit(t[late], mb[late], 1)[0]) * 60 if late.sum() >= 2 else None
    return {"first": mb[0], "at_settle": mb[late][0], "end": mb[-1], "peak": mb.max(),
            "growth_after_settle": mb[-1] / mb[late][0] - 1, "slope_mb_per_min_after_settle": slope}


def bench_soak(run: Path, experiment: str | None, traffic: VariedTraffic, clients: int, seconds: float, window_s: float,
               settle_s: float, sample_s: float, threads: int | None, max_batch: int, batching: str = "module",
               seed: int = 0, heap_trim_s: float | None = None) -> Json:
    """Part 9: one server (``--batching``), ``clients`` closed-loop clients of ``traffic`` for ``seconds``, in windows
    of ``window_s``. Each window is a fresh ``varied_loop`` (its clients reconnect): a gap of a few ms, and latency
    per window."""
    flags = ("--max-batch", str(max_batch), "--batching", batching,
             *(() if heap_trim_s is None else ("--heap-trim-s", f"{heap_trim_s:g}")))
    rngs = [np.random.default_rng([seed, c]) for c in range(clients)]
    windows = []
    with dipaco_serve(run, experiment, threads, cache_size=4, extra_args=flags) as (port, server):
        sampler = ProcSampler(server.pid, sample_s)
        sampler.start()
        while (left := seconds - (time.monotonic() - sampler.start_time)) > 0.05:
            row = varied_loop(port, traffic, rngs, min(window_s, left))
            row["end_s"] = time.monotonic() - sampler.start_time
            windows.append(row)
            print(f"[bench] soak {row['end_s']:.0f} s: {row['requests']} answers, {latency_text(row)}, "
                  f"RSS {sampler.samples[-1][3]:.0f} MB (server {sampler.samples[-1][1]:.0f}), "
                  f"{sampler.samples[-1][2]} descriptors", flush=True)
        time.sleep(min(sample_s, 5.0))  # one sample after the load
        sampler.stop.set()
        sampler.join()
    t, rss, fds, tree = (np.array([s[i] for s in sampler.samples], dtype=float) for i in range(4))
    statuses = all_statuses(windows)
    out: Json = {"clients": clients, "seconds": seconds, "window_s": window_s, "settle_s": settle_s,
                 "new_tokens": traffic.new_tokens, "positions": traffic.positions, "traffic": VariedTraffic.__doc__,
                 "server_flags": " ".join(flags), "statuses": statuses,
                 "answers": sum(row["requests"] for row in windows),
                 "responses_500": sum(v for k, v in statuses.items() if k.isdigit() and int(k) >= 500),
                 "windows": [{k: row.get(k) for k in ("end_s", "requests", "p50_ms", "p99_ms", "statuses")}
                             for row in windows],
                 "samples": {"t_s": t.tolist(), "rss_mb": rss.tolist(), "tree_rss_mb": tree.tolist(), "fds": fds.tolist()},
                 # the server with its router process, as `ps` shows a user; and the server process alone
                 "rss_mb": growth(t, tree, settle_s), "server_rss_mb": growth(t, rss, settle_s),
                 "fds": {"min": fds.min(), "max": fds.max()}}
    p99 = [row["p99_ms"] for row in windows if "p99_ms" in row]
    out["targets"] = {"rss_growth_after_settle_le_2pct": bool(out["rss_mb"]["growth_after_settle"] <= 0.02),
                      "p99_within_20pct_of_first_window": bool(p99) and max(p99) <= 1.2 * p99[0],
                      "no_500": out["responses_500"] == 0}
    r = out["rss_mb"]
    slope = r["slope_mb_per_min_after_settle"]
    print(f"[bench] soak: RSS {r['first']:.0f} MB at start, {r['at_settle']:.0f} MB at {settle_s:g} s, {r['end']:.0f} MB "
          f"at the end ({100 * r['growth_after_settle']:+.1f}%, {slope if slope is not None else float('nan'):.2f} "
          f"MB/min after settling; server process {100 * out['server_rss_mb']['growth_after_settle']:+.1f}%); "
          f"{out['answers']} answers; descriptors {out['fds']['min']:.0f}-{out['fds']['max']:.0f}; statuses "
          f"{statuses}; targets {out['targets']}", flush=True)
    return out


# --- part 6: batched against alone, token for token ----------------------------------------------------
SAMPLING_CYCLE = ((0.7, 1.0, 0), (1.0, 0.95, 50), (1.3, 0.9, 0))  # (temperature, top_p, top_k) by row


def _decode_all(pipe: Pipeline, prompts: list[str], new_tokens: int, batch: int, sampled: bool,
                batching: str = "path") -> list[PlannedGeneration]:
    """Plans every prompt, then decodes them in batches of up to ``batch`` rows: of one path at a time, in order
    (``path``), or (``module``) one running batch of any paths that rows join, in order, as others end."""
    plans = []
    for i, prompt in enumerate(prompts):
        kwargs: Json = {}
        if sampled:
            temperature, top_p, top_k = SAMPLING_CYCLE[i % len(SAMPLING_CYCLE)]
            kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=1000 + i)
        plans.append(pipe.plan(prompt, max_new_tokens=new_tokens, **kwargs))
    if batching == "module":
        waiting = iter([plan.row for plan in plans])
        pipe.run_module_batch(-1, list(itertools.islice(waiting, batch)),
                              admit=lambda decoding: list(itertools.islice(waiting, max(0, batch - decoding))))
        return plans
    by_path: dict[int, list] = {}
    for plan in plans:
        by_path.setdefault(plan.path, []).append(plan)
    for path, group in by_path.items():
        for i in range(0, len(group), batch):
            pipe.run_batch(path, [plan.row for plan in group[i:i + batch]])
    return plans


@torch.inference_mode()
def top2_gap(pipe: Pipeline, path: int, ids: list[int]) -> float:
    """The gap between the two best next-token logits after ``ids``, on ``path``'s model (one forward)."""
    model = pipe.cache.get(path).model
    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def bench_agreement(pipe: Pipeline, prompts: list[str], new_tokens: int, max_batch: int) -> Json:
    """Part 6: each prompt alone and in batches (per path, and module-batched), greedy and seeded-sampled; which
    texts differ, and where."""
    out: Json = {"prompts": len(prompts), "new_tokens": new_tokens, "max_batch": max_batch}
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
        self.selector.register(sock, selectors.EVENT_READ,
                               {"sock": sock, "slot": slot, "slow": slow, "opened": time.monotonic()})
        self.opened += 1

    def _held(self) -> list[selectors.SelectorKey]:
        return list(self.selector.get_map().values())

    def _drop(self, key: selectors.SelectorKey, by_server: bool) -> None:
        self.selector.unregister(key.fileobj)
        key.data["sock"].close()
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
                    data = key.data["sock"].recv(4096)
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
                            key.data["sock"].send(b"X-Slow: 1\r\n")
                        except OSError:
                            self._drop(key, by_server=True)
        now = time.monotonic()
        for key in self._held():
            self.open_ages_at_end.append(now - key.data["opened"])
            self._drop(key, by_server=False)


def bench_hold_idle(run: Path, experiment: str | None, prompts: list[str], n: int, nofile: int, seconds: float,
                    threads: int | None) -> Json:
    """Part 7: valid requests while ``n`` idle and slow-header connections are held open, server at ``ulimit -n nofile``."""
    bodies = encode_bodies(prompts, max_new_tokens=8)
    with dipaco_serve(run, experiment, threads, cache_size=4, nofile=nofile) as (port, server):
        for body in bodies[:8]:
            request(port, "POST", "/v1/generate", body, 60)
        baseline = []
        for body in bodies[:20]:
            start = time.perf_counter()
            request(port, "POST", "/v1/generate", body, 60)
            baseline.append(ms_since(start))
        holder = ConnectionHolder(port, n)
        holder.start()
        time.sleep(2.0)  # the first n are open (or being closed and reopened)
        latencies: list[float] = []
        failures: Counter[str] = Counter()
        descriptors: list[int | None] = []
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            start = time.perf_counter()
            try:
                status = request(port, "POST", "/v1/generate", bodies[i % len(bodies)], 30)[0]
                if status != 200:
                    failures[str(status)] += 1
            except NO_ANSWER as exc:
                failures[type(exc).__name__] += 1
            latencies.append(ms_since(start))
            descriptors.append(server_descriptors(server.pid))
            i += 1
            time.sleep(0.25)
        holder.stop.set()
        holder.join(30)
        metrics = scrape(port)
    over = [ms for ms in latencies if ms > 1000]
    out: Json = {
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
    print(f"[bench] {n} held connections (server ulimit -n {nofile}), {len(latencies)} valid requests: "
          f"{latency_text(out['valid'])}, max {out['valid']['max_ms']:.0f} ms, "
          f"{len(over)} over 1 s, failures {dict(failures) or 'none'}; held connections closed by the server "
          f"{holder.closed_by_server}, longest open {out['held_connections']['longest_lifetime_s']:.1f} s", flush=True)
    return out


# --- the parts asked for, into one report -------------------------------------------------------------
def abuse_parts(args: argparse.Namespace, run: Path, pipe: Pipeline, prompts: list[str]) -> Json:
    """Part 4, after its control (valid requests only) when asked for."""
    control = None
    if args.abuse_control:
        control = bench_abuse(run, pipe.experiment, prompts, args.abuse_clients, args.seconds, args.threads, invalid=False)
        print("control (valid requests only):", end="")
        print_abuse(control)
    abuse = bench_abuse(run, pipe.experiment, prompts, args.abuse_clients, args.seconds, args.threads)
    print_abuse(abuse)
    return {"prompt_tokens": args.prompt_tokens, "abuse": abuse, "control_valid_only": control}


def placement(args: argparse.Namespace) -> Placement:
    from dipaco.serve.router_passes import parse_cpus

    def cpus(option: str) -> tuple[int, ...] | None:
        text = getattr(args, option.removeprefix("--").replace("-", "_"))
        return None if text is None else parse_cpus(text, option)

    router = args.router_cpus if args.router_cpus in ("auto", "none") else cpus("--router-cpus")
    return Placement(cpus("--server-cpus"), router, cpus("--client-cpus"))


def batching_parts(args: argparse.Namespace, run: Path, pipe: Pipeline, prompts: list[str]) -> Json:
    """Parts 5-9, those asked for."""
    report: Json = {"prompt_tokens": f"{args.prompt_tokens // 2}..{args.prompt_tokens}"}
    served = (run, pipe.experiment)
    if args.agreement:
        report["agreement"] = bench_agreement(pipe, varied_prompts(pipe, args.agreement, args.prompt_tokens),
                                              args.new_tokens, args.max_batch)
    if args.concurrency:
        load = varied_prompts(pipe, args.prompts, args.prompt_tokens)
        modes = parse_modes(args.modes)
        routed = [pipe.route(p)[0] for p in load] if "named" in modes else None
        report["concurrency"] = bench_concurrency(*served, load, args.concurrency, args.seconds, args.warmup_seconds,
                                                  args.new_tokens, args.threads, args.max_batch, args.batch_wait_ms,
                                                  args.decode_workers, args.pin_path, modes, max(4, pipe.num_paths),
                                                  routed, args.rounds, placement(args))
    if args.apis:
        report["apis"] = bench_apis(*served, varied_prompts(pipe, args.prompts, args.prompt_tokens), args.apis,
                                    args.seconds, args.warmup_seconds, args.new_tokens, args.threads, args.max_batch,
                                    args.batch_wait_ms, args.rounds)
    if args.soak:
        report["soak"] = bench_soak(*served, VariedTraffic.of(pipe, args.new_tokens), args.soak, args.seconds,
                                    args.window, args.settle, args.sample_every, args.threads, args.max_batch,
                                    args.batching, heap_trim_s=args.heap_trim_s)
    if args.hold_idle:
        report["hold_idle"] = bench_hold_idle(*served, prompts, args.hold_idle, args.nofile, args.seconds, args.threads)
    return report


def latency_parts(args: argparse.Namespace, run: Path, pipe: Pipeline, prompts: list[str]) -> Json:
    """Parts 1-3 (3 unless --skip-http)."""
    timed = prompts[args.warmup:] or prompts
    print(f"[bench] {pipe.experiment} {pipe.checkpoint}: {pipe.topology.describe()}, {params_per_path(pipe):,} "
          f"params/path, router {pipe.router.kind if pipe.router else None}; {len(timed)} prompts of {args.prompt_tokens} "
          f"tokens, {args.new_tokens} new tokens; torch threads {torch.get_num_threads()}; load avg {load_average()}",
          flush=True)
    report = {"new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
              "single_path": bench_latency(pipe, prompts[: args.warmup] + timed, args.new_tokens, args.warmup),
              "http": None if args.skip_http else bench_http(run, pipe.experiment, timed, args.new_tokens,
                                                            [int(c) for c in args.clients.split(",")],
                                                            args.requests, args.threads)}
    print_latency(report)
    return report


def params_per_path(pipe: Pipeline) -> int:
    return sum(p.numel() for p in pipe.cache.template.parameters())


def load_average() -> float | None:
    """The machine's 1-minute load average (None where there is none): other load skews every figure here."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


@contextlib.contextmanager
def run_to_serve(run: str | None, grid: str) -> Iterator[Path]:
    """``--run``, built there first when it has no trained experiment; without one, a small run in a temp dir."""
    if run:
        if not any((Path(run) / "train").glob("*/config.yaml")):
            build_run(Path(run), grid)
        yield Path(run)
        return
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        yield build_run(Path(tmp) / "run", grid)


def main(argv: list[str] | None = None) -> int:
    """Parts 4 (``--abuse``), 5-9 (any of their flags) or else 1-3; one report of the command, machine and run."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.concurrency:
        parse_modes(args.modes)  # a bad --modes or CPU list fails now, not after the run is built
        placement(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from dipaco.serve.pipeline import Pipeline

    with run_to_serve(args.run, args.grid) as run:
        pipe = Pipeline.from_run(run, experiment=args.experiment, cache_size=64)
        prompts = prompts_from_run(pipe, args.prompts + args.warmup, args.prompt_tokens)
        report: Json = {
            "command": command_line("serve", argv), "environment": environment("cpu"),
            "load_avg_1m_at_start": load_average(),
            "run": {"experiment": pipe.experiment, "checkpoint": pipe.checkpoint, "topology": pipe.topology.describe(),
                    "params_per_path": params_per_path(pipe), "router": pipe.router.kind if pipe.router else None},
        }
        batching = args.concurrency or args.agreement or args.hold_idle or args.apis or args.soak
        parts = abuse_parts if args.abuse else batching_parts if batching else latency_parts
        report.update(parts(args, run, pipe, prompts))
    if args.out:
        write_json(args.out, report, indent=2)
        print(f"[bench] wrote {args.out}")
    return 0
