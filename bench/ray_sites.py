"""The Ray driver across sites: the bytes a path task sends over a site's link, by ``ray.state_sync_every`` (issue 72).

Two sites (:mod:`bench.netns`: a network namespace each, its link shaped by ``tbf``), as a lab runs Ray on two
machines: site 0 holds the Ray head (one CPU) and the driver, site 1 a node started with ``ray start --address``
(one CPU); ``ray.worker_cpus=1`` places one path worker on each. A path task pulls the path's modules from their
executors on site 0 and pushes its deltas back; the AdamW state it makes (twice the path's parameters) stays on
its worker's node, where the path's next task goes first, and the driver fetches it every ``state_sync_every`` of
the path's tasks (1: after every task).

Per row: the bytes site 1's link carried in both directions during the run (its interface's counters: everything,
Ray's own control traffic included), over the tasks site 1's worker ran; the same link's idle traffic beforehand
(Ray's control plane, bytes/s); and what the model alone accounts for per task: modules + deltas + 2 x the path's
parameters / ``state_sync_every`` (fp32).

    python -m bench ray_sites --out docs/results/bench_ray_sites.json          # state_sync_every 1 and 8 over wan
    python -m bench ray_sites --profile poor --sync-every 1,4,16

Needs root (it makes namespaces); refuses in one line otherwise. Resumable: ``--resume`` keeps finished rows.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import lm_training as lm
from bench.harness import REPO, Column, Results, argument_parser, command_line, environment, markdown_table
from bench.netns import RayCluster, Sites, SitesUnavailable, profile, unavailable

IDLE_S = 10.0  # how long the idle link is measured before the driver starts


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argument_parser("ray_sites", __doc__)
    p.add_argument("--profile", default="wan", help="site links' profile (bench.netns.PROFILES) or a tc rate")
    p.add_argument("--sync-every", default="1,8", help="ray.state_sync_every of each row")
    p.add_argument("--work", default="/tmp/dipaco_bench_ray_sites")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--corpus", help="a JSONL corpus (id, label, text) instead of a slice of --data's")
    p.add_argument("--docs-per-source", type=int, default=300)
    p.add_argument("--rounds", type=int, default=8, help="rounds' worth of tasks: 4 paths x rounds")
    p.add_argument("--inner-steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--row-timeout", type=float, default=600.0, help="a run longer than this is killed: an error")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--resume", action="store_true")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace, work: Path, corpus: Path) -> list[str]:
    """The tiny run: a 2x2 grid of 2-layer paths."""
    return [f"run.dir={work / 'run'}", f"data.corpus={corpus}", "run.progress=false", "run.device=cpu",
            "model.num_layers=2", f"model.hidden_size={args.hidden}", f"model.intermediate_size={3 * args.hidden}",
            f"model.num_heads={max(1, args.hidden // 32)}", f"tokenizer.vocab_size={args.vocab}", "data.seq_len=64",
            "data.prefix_tokens=16", "data.empty_docs=skip", "pretrain.steps=50", "pretrain.optim.batch_size=16",
            "pretrain.optim.warmup_steps=10", "topology.preset=grid:2x2", f"train.rounds={args.rounds}",
            f"train.inner_steps={args.inner_steps}", "train.optim.batch_size=8", "train.optim.warmup_steps=20"]


def path_parameters(run_dir: Path) -> int:
    """A path's parameters: the pretrained dense model's (each path is a whole dense LM of its size)."""
    from safetensors import safe_open

    total = 0
    for file in sorted((run_dir / "pretrain").glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def link_total(sites: Sites, i: int) -> int:
    sent, received = sites.link_bytes(i)
    return sent + received


def run_row(sites: Sites, sync_every: int, name: str, cfg_file: Path, args: argparse.Namespace,
            work: Path) -> dict[str, Any]:
    """A fresh Ray cluster on the two sites, the idle link measured, then one run of the driver on site 0."""
    from dipaco.metrics import read_metrics

    exp = work / "run" / "train" / name
    shutil.rmtree(exp, ignore_errors=True)
    log = work / f"{name}.driver.log"
    try:
        with RayCluster(sites, {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}) as cluster:
            for i in range(len(sites)):
                cluster.start(i)
            idle_from = link_total(sites, 1)
            time.sleep(IDLE_S)
            idle_rate = (link_total(sites, 1) - idle_from) / IDLE_S
            cmd = sites[0].command([sys.executable, "-m", "dipaco", "train", "--config", str(cfg_file),
                                    f"train.name={name}", "train.driver=ray", "outer.sync=async_nesterov",
                                    f"ray.address={cluster.address}", "ray.num_workers=2", "ray.worker_cpus=1",
                                    "ray.executors=2", f"ray.state_sync_every={sync_every}"])
            before, start = link_total(sites, 1), time.perf_counter()
            with log.open("w") as out:
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=cluster.environment(0),
                                      timeout=args.row_timeout)
            wall, carried = time.perf_counter() - start, link_total(sites, 1) - before
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{name}: still running after --row-timeout={args.row_timeout:g}s; its log: {log}") from None
    if done.returncode:
        raise SystemExit(f"{name}: the driver failed ({done.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
    tasks = read_metrics(exp / "metrics.jsonl", "task")
    remote = [t for t in tasks if t["node"] == sites[1].address]
    if not remote:
        raise SystemExit(f"{name}: site 1's worker ran no task; its log: {log}")
    params = path_parameters(work / "run")
    return {"sync_every": sync_every, "tasks": len(tasks), "site1_tasks": len(remote), "wall_seconds": wall,
            "site1_bytes": carried, "bytes_per_task": carried / len(remote), "idle_bytes_per_s": idle_rate,
            "control_bytes": idle_rate * wall, "path_parameters": params,
            "model_bytes_per_task": 4 * params * (2 + 2 / sync_every)}


TABLE: list[Column] = [
    ("state_sync_every", "sync_every"), ("link", "profile"), ("site 1 tasks", lambda t: f"{t['site1_tasks']} of {t['tasks']}"),
    ("MB over site 1's link", lambda t: f"{t['site1_bytes'] / 1e6:.1f}"),
    ("MB per task", lambda t: f"{t['bytes_per_task'] / 1e6:.2f}"),
    ("model MB per task", lambda t: f"{t['model_bytes_per_task'] / 1e6:.2f}"),
    ("idle link KB/s", lambda t: f"{t['idle_bytes_per_s'] / 1e3:.1f}"),
    ("vs every task", lambda t: None if t["vs_first"] is None else f"{t['vs_first']:.2f}x"),
    ("wall s", lambda t: f"{t['wall_seconds']:.1f}"),
]


def summarize(results: Results, profile_name: str, every: list[int]) -> list[dict[str, Any]]:
    """One line per row; ``vs_first``: its bytes per task over the first row's (state_sync_every=1 by default)."""
    rows = [r for r in (results.get(f"sync_every_{k}@{profile_name}") for k in every) if r is not None]
    first = rows[0]["bytes_per_task"] if rows else None
    return [{**r, "profile": profile_name, "vs_first": r["bytes_per_task"] / first if first else None} for r in rows]


def main(argv: list[str]) -> int | None:
    args = parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"python -m bench ray_sites: {reason}; run it as root on a machine that can make network namespaces",
              file=sys.stderr)
        return 2
    try:
        every = [int(k) for k in args.sync_every.split(",")]
    except ValueError:
        raise SystemExit(f"--sync-every: comma-separated integers, got {args.sync_every!r}") from None
    if any(k < 1 for k in every):
        raise SystemExit(f"--sync-every: each must be >= 1, got {args.sync_every!r}")
    link = profile(args.profile)
    work = Path(args.work)
    cfg_file = lm.prepared_once(work, lambda corpus: overrides(args, work, corpus), args.corpus, Path(args.data),
                                args.docs_per_source)
    results = Results.load(args.out or work / "results.json", "ray_sites", args.resume)
    results.meta = {"meta": {"command": command_line("ray_sites", argv), "machine": environment("cpu"),
                             "sites": 2, "link": link.describe(False)}}
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "resume", "sync_every", "row_timeout")}
    for k in every:
        row = f"sync_every_{k}@{args.profile}"
        if results.has(row, settings):
            continue
        print(f"[ray_sites] ray.state_sync_every={k} on 2 sites, {args.profile} links ...", flush=True)
        with Sites(2, link) as sites:
            record = run_row(sites, k, f"sync_every_{k}_{args.profile}", cfg_file, args, work)
        results.put(row, settings, record)
        results.write()
        print(f"[ray_sites] {row}: {record['bytes_per_task'] / 1e6:.2f} MB per site-1 task "
              f"({record['site1_tasks']} tasks)", flush=True)
    table = summarize(results, args.profile, every)
    results.meta["table"] = table
    results.write()
    print(markdown_table(table, TABLE))
    return None


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SitesUnavailable as exc:
        sys.exit(f"python -m bench ray_sites: {exc}")
