"""Asynchronous DiPaCo on Ray against synchronous rounds, with slow workers (issue 13).

One embedded Ray (``ray.init(num_cpus=2)``), four workers at simulated speeds [1, 1, 0.5, 0.25]
(a worker at speed s sleeps (1/s - 1) times as long as it computed), the 2x2 grid, and the same
total inner steps (rounds x inner_steps x paths) for every variant:

    sync          lock-step rounds (ray.schedule=rounds): per-module DiLoCo; each round waits for the slowest
    async_plain   asynchronous, a full Nesterov step per arrival (outer.nesterov_delay=1)
    async_dn      asynchronous, delayed Nesterov (N = paths through the module)
    async_dn_dyn  delayed Nesterov + dynamic local steps (floor(v / v_max x H) per task)

Every run checkpoints every 4 completed tasks; each checkpoint is evaluated afterwards, so the
perplexity curve costs no training time. "Outer updates" on the x axis are inner steps done /
(paths x inner_steps): one per synchronous round. Then a fault run (async_dn_dyn) kills one worker
three times mid-task and checks from the executors' update logs that every completed task was
applied exactly once to each of its modules.

    python -m bench async_sync                       # ~20 min on 2 busy CPU cores
    python -m bench async_sync --rounds 2 --inner-steps 5 --skip-fault   # a quick smoke run

Writes results.json (with the command and the machine, :func:`bench.harness.environment`) and
async_ppl_vs_updates.png into --out-dir (default runs/bench_async), and prints the table in markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import Column, argument_parser, command_line, environment, markdown_table, write_json
from dipaco.checkpoint.store import CheckpointManager, SavedCheckpoint
from dipaco.config import Config
from dipaco.metrics import echo, read_metrics
from dipaco.model.topology import topology_from_config
from dipaco.run import Run, apply_overrides, load_config
from dipaco.runtime import quiet_library_progress_bars
from dipaco.sync.async_nesterov import staleness_summary

SPEEDS = [1.0, 1.0, 0.5, 0.25]
BASE = [
    "data.corpus=bbc", "data.seq_len=64", "data.prefix_tokens=16", "tokenizer.vocab_size=2048",
    "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=192", "model.num_heads=4",
    "topology.preset=grid:2x2", "pretrain.steps=150", "pretrain.optim.batch_size=16", "pretrain.optim.warmup_steps=15",
    "train.sharding=iid", "train.optim.batch_size=8", "train.optim.warmup_steps=10", "run.progress=false",
    "run.device=cpu", "eval.batch_size=32",
]
ASYNC = ["train.driver=ray", "outer.sync=async_nesterov", f"ray.simulate_speeds=[{','.join(map(str, SPEEDS))}]",
         "ray.num_cpus=2", "ray.checkpoint_every=4", "train.keep_checkpoints=1000"]
VARIANTS = {
    "sync": ["ray.schedule=rounds"],
    "async_plain": ["outer.nesterov_delay=1"],
    "async_dn": [],
    "async_dn_dyn": ["train.dynamic_local_steps=true"],
}


def prepared(out: Path, args: argparse.Namespace) -> Config:
    """The shared run in ``out/run``: prepared and pretrained once, reused by every variant and later runs."""
    cfg = load_config(None, [*BASE, f"run.dir={out / 'run'}", f"train.rounds={args.rounds}",
                             f"train.inner_steps={args.inner_steps}", f"eval.max_docs={args.eval_docs}", *ASYNC])
    if not (out / "run" / "pretrain" / "config.json").is_file():
        Run(cfg).prepare()
        Run(cfg).pretrain()
    return cfg


def curve(cfg: Config, exp_dir: Path, per_round: int) -> list[dict[str, Any]]:
    """Validation perplexity of every checkpoint, against outer updates (inner steps / per_round)."""
    done = {r["step"]: r["inner_steps"] for r in read_metrics(exp_dir / "metrics.jsonl", "checkpoint")}
    points = []
    for ckpt in CheckpointManager(exp_dir / "checkpoints").checkpoints():
        tasks = int(ckpt.name.split("_")[1])
        report = Run(cfg).evaluate(checkpoint=str(ckpt))
        points.append({"tasks": tasks, "inner_steps": done[tasks], "updates": done[tasks] / per_round,
                       "ppl": report["overall"]["ppl"]})
    return points


def run_variant(cfg: Config, name: str, overrides: list[str], per_round: int,
                on_start: Callable[[Any], None] | None = None) -> tuple[dict[str, Any], Path, Config]:
    """Trains one variant from the shared pretrained model and evaluates its checkpoints."""
    vcfg = apply_overrides(cfg, [f"train.name={name}", *overrides])
    exp_dir = Path(vcfg.run.dir) / "train" / name
    shutil.rmtree(exp_dir, ignore_errors=True)
    Run(vcfg).train(on_start=on_start)
    summary = read_metrics(exp_dir / "metrics.jsonl", "async")[-1]
    tasks = read_metrics(exp_dir / "metrics.jsonl", "task")
    points = curve(vcfg, exp_dir, per_round)
    staleness = [s for t in tasks for s in t["staleness"].values()]
    # The machine's load moves between variants: the wall-clock also in units of the run's own median
    # full-speed inner step (compute time only; the simulated slowness is a sleep on top).
    step_s = statistics.median(t["compute_seconds"] / t["steps"] for t in tasks)
    result = {"name": name, "overrides": overrides, "wall_seconds": summary["wall_seconds"],
              "step_seconds": step_s, "wall_in_steps": summary["wall_seconds"] / step_s,
              "tasks": len(tasks), "inner_steps": summary["inner_steps"], "requeues": summary["requeues"],
              "final_ppl": points[-1]["ppl"], "curve": points, "staleness": staleness_summary(staleness),
              "steps_per_task": sorted({t["steps"] for t in tasks})}
    echo(f"[bench] {name}: {result['wall_seconds']:.1f}s, ppl {result['final_ppl']:.2f}, {len(tasks)} tasks, "
         f"staleness {result['staleness']}")
    return result, exp_dir, vcfg


def fault_run(cfg: Config, per_round: int, kills: int) -> dict[str, Any]:
    """async_dn_dyn with one worker (the fastest) killed ``kills`` times, each while it runs a task."""
    killed: list[str] = []

    def drill(run: Any) -> None:
        def kill() -> None:
            import ray

            # The driver gives a restarted worker tasks only once it answers, so a task running on
            # worker 0 for 0.2 s is running on a live worker: killing it kills a task mid-way.
            while len(killed) < kills:
                busy = [t for t in list(run.flight.queue.running.values())
                        if t.worker == 0 and time.monotonic() - t.started > 0.2 and t.id not in killed]
                if busy:
                    ray.kill(run.flight.workers[0], no_restart=False)
                    killed.append(busy[0].id)
                time.sleep(0.02)

        threading.Thread(target=kill, daemon=True).start()

    result, exp_dir, vcfg = run_variant(cfg, "fault_async_dn_dyn", VARIANTS["async_dn_dyn"], per_round, on_start=drill)
    tasks = read_metrics(exp_dir / "metrics.jsonl", "task")
    topo = topology_from_config(vcfg.topology, vcfg.model.num_layers)
    last = CheckpointManager(exp_dir / "checkpoints").latest()
    if last is None:
        raise RuntimeError(f"the fault run wrote no checkpoint in {exp_dir / 'checkpoints'}: no update log to check")
    latest = SavedCheckpoint(last).state()
    applied = Counter((name, u["task"]) for name, counters in latest["scheduler"]["executors"].items() for u in counters["log"])
    expected = {(topo.modules[m].name, t["task"]) for t in tasks for m in topo.path_modules(t["path"])}
    result.update(killed_tasks=killed, requeue_events=len(read_metrics(exp_dir / "metrics.jsonl", "requeue")),
                  updates_expected=len(expected), updates_logged=sum(applied.values()),
                  exactly_once=set(applied) == expected and set(applied.values()) == {1})
    return result


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Validation perplexity against outer updates, a line per variant (wall time in its label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in results:
        ax.plot([p["updates"] for p in r["curve"]], [p["ppl"] for p in r["curve"]], marker="o", ms=3,
                label=f"{r['name']} ({r['wall_seconds']:.0f}s)")
    ax.set_xlabel("outer updates (inner steps / (paths x inner_steps))")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"2x2 DiPaCo on Ray, worker speeds {SPEEDS}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


TABLE: list[Column] = [
    ("variant", "name"), ("wall s", lambda r: f"{r['wall_seconds']:.1f}"), ("speed-up", lambda r: f"{r['speedup_vs_sync']:.2f}x"),
    ("step s", lambda r: f"{r['step_seconds']:.3f}"), ("wall / step", lambda r: f"{r['wall_in_steps']:.0f}"),
    ("speed-up (normalized)", lambda r: f"{r['normalized_speedup_vs_sync']:.2f}x"),
    ("final ppl", lambda r: f"{r['final_ppl']:.2f}"), ("vs sync", lambda r: f"{100 * r['ppl_vs_sync']:+.1f}%"),
    ("tasks", "tasks"),
    ("staleness mean / p90 / max",
     lambda r: f"{r['staleness']['mean']:.2f} / {r['staleness']['p90']:.0f} / {r['staleness']['max']}"),
]


def main(argv: list[str] | None = None) -> int:
    """Runs the variants (and the fault run); 1 when a variant's final perplexity is not finite."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argument_parser("async_sync", __doc__)
    parser.add_argument("--out-dir", default="runs/bench_async")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--eval-docs", type=int, default=100)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--skip-fault", action="store_true")
    parser.add_argument("--only-fault", action="store_true", help="only the fault run, added to OUT_DIR/results.json")
    parser.add_argument("--plot", default=None, help="PNG path (default: OUT_DIR/async_ppl_vs_updates.png)")
    args = parser.parse_args(argv)
    quiet_library_progress_bars()
    out = Path(args.out_dir)
    if args.only_fault and not (out / "results.json").is_file():
        sys.exit(f"--only-fault adds the fault run to {out / 'results.json'}, which does not exist: "
                 f"run without --only-fault first (or with --skip-fault for the variants alone)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = prepared(out, args)
    per_round = args.inner_steps * 4
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    command = command_line("async_sync", argv)
    payload: dict[str, Any] = {"command": command, "speeds": SPEEDS, "rounds": args.rounds, "inner_steps": args.inner_steps,
                               "eval_docs": args.eval_docs, "results": [], "fault": None, "environment": environment("cpu")}
    if args.only_fault:  # add the fault run to an earlier run's results
        payload = {**json.loads((out / "results.json").read_text()), "fault_command": command,
                   "fault_environment": environment("cpu")}
    results = payload["results"]
    for name, overrides in ({} if args.only_fault else VARIANTS).items():
        results.append(run_variant(cfg, name, overrides, per_round)[0])
        sync = results[0]
        for r in results:
            r["speedup_vs_sync"] = sync["wall_seconds"] / r["wall_seconds"]
            r["normalized_speedup_vs_sync"] = sync["wall_in_steps"] / r["wall_in_steps"]
            r["ppl_vs_sync"] = r["final_ppl"] / sync["final_ppl"] - 1.0
        write_json(out / "results.json", payload)  # kept as the variants finish
    fault = payload["fault"] = None if args.skip_fault else fault_run(cfg, per_round, args.kills)
    write_json(out / "results.json", payload)
    ray.shutdown()
    plot(results, Path(args.plot) if args.plot else out / "async_ppl_vs_updates.png")
    print(markdown_table(results, TABLE))
    if fault:
        print(f"fault run: killed during {fault['killed_tasks']}, {fault['requeue_events']} re-queued, "
              f"{fault['updates_logged']}/{fault['updates_expected']} updates logged, exactly once: "
              f"{fault['exactly_once']}, {fault['wall_seconds']:.1f}s, ppl {fault['final_ppl']:.2f}")
    return 0 if all(math.isfinite(r["final_ppl"]) for r in results) else 1
