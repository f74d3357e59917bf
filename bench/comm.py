"""Communication of multi-worker DiPaCo training: bytes per round against DDP, outer-step time, int8 quality.

Runs real ``torchrun`` jobs (gloo, CPU) of the same experiment with ``dist.comm_dtype`` = fp32,
bf16 and int8, then reads the ``comm`` records of ``metrics.jsonl`` and evaluates each experiment:

* bytes sent per rank per round (the cost models of ``dipaco.comm``: ring all-reduce for fp32,
  ring all-gather for the lossy types), against what DDP would send for the same inner steps
  (one fp32 ring all-reduce of every gradient of a path-sized model per inner step, on the same
  ranks); targets: >= inner_steps x less at fp32, >= 4 x inner_steps x less at int8;
* the outer step's wall time (local sums + exchange + Nesterov step) as a fraction of the round
  (inner steps + outer step; checkpoint writing excluded), median over the rounds after the first.
  A rank that finishes its inner steps early waits for its peers inside the exchange, which is
  load imbalance, not outer-step cost; so the figure is taken on the last rank to arrive (the one
  with the shortest exchange) and, for reference, as measured on every rank ("incl. wait");
  target <= 3% at inner_steps=50 with 2 ranks;
* validation perplexity (routing prefix excluded) of the int8 and bf16 runs against fp32; target:
  int8 within 1%.

The data is a slice of the shared corpora (``--data``), or ``--corpus FILE``, prepared and pretrained once in
``--work``.

    python -m bench comm --out /tmp/bench_comm.json

``--rows`` runs the outer-sync table instead (issue 12): DiLoCo fp32/int8, Streaming DiLoCo
(``outer.sync=streaming``: F fragments, tau overlapped steps, mixing alpha; fp32 or fp4; rows ending
in ``_blocksK`` cut fragments from K-block slices, ``outer.streaming.fragment=blocks:K``) and the
one-step-delay sync (``outer.sync=delayed``: int8 or adaptive codecs). Each row gives total bytes
per rank and round over DDP's, the peak bytes of one sync over DiLoCo fp32's peak, the share of the
round spent issuing and waiting for exchanges (on the last rank to arrive at each sync, so that a
peer's lag is not counted), and validation perplexity against DiLoCo fp32. With ``--rate`` (root
needed) every row runs a second time with both ranks in a network namespace this script creates,
whose loopback is limited by a token bucket (``tc qdisc ... tbf rate RATE``), and the wait share
is measured there too.

    python -m bench comm --rows all --inner-steps 48 --rate 20mbit --out /tmp/bench_sync.json

A row name may carry extra dipaco overrides, ``ROW@key=value@key=value`` (a sweep of one setting):

    python -m bench comm --rows diloco_fp32,delayed_eager_int8@outer.delayed.momentum=0.7

Both tables print in markdown; ``--out`` writes the figures as JSON under ``meta`` (the settings, the command
and the machine, :func:`bench.harness.environment`) and ``results``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.harness import (
    REPO,
    Column,
    argument_parser,
    command_line,
    environment,
    free_port,
    markdown_table,
    parse_row,
    safe_name,
    unknown_rows,
    write_json,
)
from dipaco import json_text
from dipaco.config import Config, save_config
from dipaco.metrics import read_metrics
from dipaco.run import load_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags; ``--data`` defaults to the shared corpora next to the repository (``../shared/data``)."""
    p = argument_parser("comm", __doc__)
    p.add_argument("--work", default="/tmp/dipaco_bench_comm", help="run directory (prepared once, reused)")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--corpus", help="a JSONL corpus (id, label, text) to train on instead of a slice of --data's")
    p.add_argument("--docs-per-source", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--topology", default="grid:2x2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inner-steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="sequences of 128 tokens per inner step")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128, help="model width (the MLP is 3x)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--dtypes", default="fp32,bf16,int8")
    p.add_argument("--rows", help="outer-sync rows: comma-separated names of ROWS, 'default' or 'all' (the issue-12 table)")
    p.add_argument("--rate", help="also run every row over a loopback limited to this rate (tc syntax, e.g. 20mbit)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


def write_corpus(data: Path, out: Path, per_source: int) -> Path:
    """The first documents of each shared corpus (20 Newsgroups without its Usenet headers)."""
    from dipaco.data.corpus import strip_header

    rows = []
    for name in ("20news_bydate.jsonl.gz", "bbc_news.jsonl.gz", "brown_genres.jsonl.gz"):
        with gzip.open(data / name, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= per_source:
                    break
                doc = json.loads(line)
                text = strip_header(doc["text"]) if name.startswith("20news") else doc["text"]
                if text.strip():
                    rows.append({"id": f"{doc['source']}/{doc['id']}", "label": doc["label"], "text": text[:4000]})
    out.write_text("".join(json_text.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


def base_overrides(args: argparse.Namespace, work: Path, corpus: Path) -> list[str]:
    """The shared experiment every row and dtype starts from (the model, the data, the rounds)."""
    return [
        f"run.dir={work / 'run'}", f"data.corpus={corpus}", "run.progress=false",
        "run.device=cpu", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={3 * args.hidden}", f"model.num_heads={max(1, args.hidden // 32)}",
        f"tokenizer.vocab_size={args.vocab}", "data.seq_len=128", "data.prefix_tokens=32",
        f"pretrain.steps={args.pretrain_steps}", "pretrain.optim.warmup_steps=15", "pretrain.optim.batch_size=16",
        f"topology.preset={args.topology}", f"train.rounds={args.rounds}", f"train.inner_steps={args.inner_steps}",
        f"train.optim.batch_size={args.batch}", "train.optim.warmup_steps=20", "eval.batch_size=32", "eval.max_docs=300",
    ]


def run_job(cfg_file: Path, nproc: int, name: str, overrides: list[str], netns: str | None = None) -> float:
    """One ``torchrun`` training job (inside network namespace ``netns`` when given); its wall seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "dipaco", "train", "--config", str(cfg_file), f"train.name={name}", *overrides]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        out = proc.communicate()[0]
    finally:  # interrupted: take the agent's workers down with it
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out[-4000:]}")
    return time.perf_counter() - start


class LimitedLoopback:
    """A network namespace whose loopback is rate-limited by a token bucket; both ranks run in it."""

    def __init__(self, rate: str) -> None:
        self.name, self.rate = f"dipaco_bench_{os.getpid()}", rate

    def __enter__(self) -> str:
        for cmd in (["ip", "netns", "add", self.name], ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"],
                    ["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                     "rate", self.rate, "burst", "256kb", "limit", "4mb"]):
            subprocess.run(cmd, check=True)
        return self.name

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def summarize(exp_dir: Path, inner_steps: int) -> dict[str, Any]:
    """Bytes per rank and round against DDP's, and the outer step's share of the round (issue 4's table)."""
    comm = read_metrics(exp_dir / "metrics.jsonl", "comm")
    later = [r for r in comm if r["round"] > 1] or comm
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in later:
        by_round.setdefault(r["round"], []).append(r)
    last = [min(rs, key=lambda r: r["comm_seconds"]) for rs in by_round.values()]
    sent = statistics.mean(r["bytes_sent"] for r in comm)
    ddp = statistics.mean(r["ddp_bytes"] for r in comm)
    return {
        "bytes_sent_per_rank_round": sent,
        "bytes_received_per_rank_round": statistics.mean(r["bytes_received"] for r in comm),
        "ddp_bytes_per_rank_round": ddp,
        "ddp_over_ours": ddp / sent if sent else None,
        "inner_steps_per_rank_round": statistics.mean(r["inner_steps"] for r in comm),
        "outer_fraction_median": statistics.median(r["outer_seconds"] / r["round_seconds"] for r in last),
        "outer_seconds_median": statistics.median(r["outer_seconds"] for r in last),
        "comm_seconds_median": statistics.median(r["comm_seconds"] for r in last),
        "outer_fraction_incl_wait_median": statistics.median(r["outer_seconds"] / r["round_seconds"] for r in later),
        "round_seconds_median": statistics.median(r["round_seconds"] for r in later),
        "modules_communicated": sorted(comm[0]["modules"]),
        "inner_steps": inner_steps,
    }


# name -> dipaco overrides. "peak / DiLoCo" compares with diloco_fp32's peak.
ROWS = {
    "diloco_fp32": ["outer.sync=diloco", "dist.comm_dtype=fp32"],
    "diloco_int8": ["outer.sync=diloco", "dist.comm_dtype=int8"],
    **{f"streaming_F{f}_tau{tau}_a{alpha}_{dtype}": [
        "outer.sync=streaming", f"outer.streaming.num_fragments={f}", f"outer.streaming.overlap_steps={tau}",
        f"outer.streaming.mix_alpha={alpha}", "outer.streaming.pattern=balanced", f"dist.comm_dtype={dtype}"]
       for f in (2, 4) for tau in (0, 2) for alpha in ("0", "0.5") for dtype in ("fp32", "fp4")},
    # sub-module fragments: units of K decoder blocks, the embedding and head in pieces of at most K blocks
    **{f"streaming_F{f}_tau{tau}_a{alpha}_{dtype}_blocks{k}": [
        "outer.sync=streaming", f"outer.streaming.num_fragments={f}", f"outer.streaming.overlap_steps={tau}",
        f"outer.streaming.mix_alpha={alpha}", "outer.streaming.pattern=balanced",
        f"outer.streaming.fragment=blocks:{k}", f"dist.comm_dtype={dtype}"]
       for f in (2, 4) for tau in (0, 2) for alpha in ("0", "0.5") for dtype in ("fp32", "fp4") for k in (1,)},
    "delayed_int8": ["outer.sync=delayed", "dist.comm_dtype=int8"],
    "delayed_adaptive": ["outer.sync=delayed", "dist.comm_dtype=int8", "dist.adaptive=true"],
    "delayed_eager_int8": ["outer.sync=delayed", "outer.delayed.eager=true", "dist.comm_dtype=int8"],
    "delayed_eager_adaptive": ["outer.sync=delayed", "outer.delayed.eager=true", "dist.comm_dtype=int8",
                               "dist.adaptive=true"],
    # A stale outer gradient under Nesterov momentum 0.9 overshoots: the same delays with a damped outer step.
    "delayed_int8_momentum0": ["outer.sync=delayed", "dist.comm_dtype=int8", "outer.momentum=0.0"],
    "delayed_eager_int8_momentum0": ["outer.sync=delayed", "outer.delayed.eager=true", "dist.comm_dtype=int8",
                                     "outer.momentum=0.0"],
}
DEFAULT_ROWS = ["diloco_fp32", "diloco_int8", "streaming_F2_tau0_a0_fp32", "streaming_F4_tau0_a0_fp32",
                "streaming_F4_tau2_a0_fp4", "streaming_F4_tau2_a0.5_fp4", "delayed_int8", "delayed_adaptive",
                "delayed_eager_int8", "delayed_eager_adaptive"]


def row_overrides(name: str) -> list[str]:
    """A row's dipaco overrides: ``ROW`` is a name in ROWS, ``ROW@key=value@key=value`` adds overrides to it
    (:func:`bench.harness.parse_row`; a malformed name raises its RowSyntaxError, an unknown row KeyError)."""
    base, extra = parse_row(name)
    return [*ROWS[base], *extra]


def wait_share(exp_dir: Path) -> dict[str, Any]:
    """Share of the round spent issuing and waiting for exchanges, on the rank that arrived last
    (the smaller comm_seconds of each round). Steady state: median over the rounds after the first
    and before the last (the last round lands every exchange still in flight at once)."""
    comm = read_metrics(exp_dir / "metrics.jsonl", "comm")
    rounds = max(r["round"] for r in comm)
    steady = [r for r in comm if 1 < r["round"] < rounds] or comm
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in steady:
        by_round.setdefault(r["round"], []).append(r)
    last = [min(rs, key=lambda r: r["comm_seconds"]) for rs in by_round.values()]
    final = [r for r in comm if r["round"] == rounds]
    return {"wait_share_median": statistics.median(r["comm_seconds"] / r["round_seconds"] for r in last),
            "wait_share_incl_lag_median": statistics.median(r["comm_seconds"] / r["round_seconds"] for r in steady),
            "last_round_wait_share": min(r["comm_seconds"] / r["round_seconds"] for r in final),
            "round_seconds_median": statistics.median(r["round_seconds"] for r in steady)}


def _percent(share: float) -> str:
    return f"{share * 100:.2f}%"


SYNC_TABLE: list[Column] = [
    ("row", "name"), ("DDP/total", lambda r: f"{1 / r['total_over_ddp']:.0f}x"),
    ("total/DDP", lambda r: f"{r['total_over_ddp']:.2e}"), ("peak/DiLoCo", lambda r: f"{r['peak_over_diloco']:.3f}"),
    ("wait lo", lambda r: _percent(r["loopback"]["wait_share_median"])),
    ("wait lim", lambda r: _percent(r["limited"]["wait_share_median"]) if "limited" in r else None),
    ("val ppl", lambda r: f"{r['val_ppl']:.2f}"), ("vs fp32", lambda r: f"{r['ppl_vs_diloco_fp32'] * 100:+.2f}%"),
]


def row_names(spec: str) -> list[str]:
    """``--rows``: 'all', 'default' or comma-separated names; exits naming the unknown or malformed ones."""
    names = {"all": list(ROWS), "default": list(DEFAULT_ROWS)}.get(spec) or spec.split(",")
    unknown = unknown_rows(names, ROWS)
    if unknown:
        sys.exit(f"--rows: unknown or malformed {unknown}; one of {', '.join(ROWS)} (ROW@key=value@... adds overrides)")
    return names


def sync_table(args: argparse.Namespace, cfg: Config, cfg_file: Path, work: Path) -> dict[str, dict[str, Any]]:
    """The outer-sync rows (issue 12): each a torchrun job, on loopback and, with --rate, on a limited link."""
    from dipaco.run import Run, apply_overrides

    names = row_names(args.rows)
    if "diloco_fp32" not in names:
        names.insert(0, "diloco_fp32")  # the baseline of every ratio
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        exp_name = safe_name(name)  # ROW@key=value: a directory-safe train.name
        exp_dir = work / "run" / "train" / exp_name
        shutil.rmtree(exp_dir, ignore_errors=True)
        overrides = row_overrides(name)
        wall = run_job(cfg_file, args.nproc, exp_name, overrides)
        comm = read_metrics(exp_dir / "metrics.jsonl", "comm")
        row: dict[str, Any] = {"overrides": overrides, "job_wall_seconds": wall,
                               "bytes_sent_per_rank_round": statistics.mean(r["bytes_sent"] for r in comm),
                               "ddp_bytes_per_rank_round": statistics.mean(r["ddp_bytes"] for r in comm),
                               "peak_sync_bytes": max(r["peak_sync_bytes"] for r in comm),
                               "ddp_peak_sync_bytes": comm[0]["ddp_peak_sync_bytes"], "loopback": wait_share(exp_dir)}
        row["val_ppl"] = Run(apply_overrides(cfg, [f"train.name={exp_name}", *overrides])).evaluate()["overall"]["ppl"]
        if args.rate:
            limited = f"{exp_name}_limited"
            shutil.rmtree(work / "run" / "train" / limited, ignore_errors=True)
            with LimitedLoopback(args.rate) as netns:
                row["limited_wall_seconds"] = run_job(cfg_file, args.nproc, limited, overrides, netns=netns)
            row["limited"] = wait_share(work / "run" / "train" / limited)
        results[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    base = results["diloco_fp32"]
    h = args.inner_steps
    print(f"\n{args.nproc} ranks, {args.topology}, {args.rounds} rounds x {h} inner steps, gloo on CPU; "
          f"bytes per rank per round; limited link: {args.rate or '-'}")
    for r in results.values():
        r["total_over_ddp"] = r["bytes_sent_per_rank_round"] / r["ddp_bytes_per_rank_round"]
        r["peak_over_diloco"] = r["peak_sync_bytes"] / base["peak_sync_bytes"]
        r["ppl_vs_diloco_fp32"] = r["val_ppl"] / base["val_ppl"] - 1
    print(markdown_table([{"name": name, **r} for name, r in results.items()], SYNC_TABLE))
    return results


def dtype_table(results: dict[str, dict[str, Any]], h: int) -> str:
    """Issue 4's table, a row per comm_dtype; the ppl change is against fp32 when it ran."""
    fp32 = results.get("fp32")
    columns: list[Column] = [
        ("dtype", "dtype"), ("sent", lambda r: f"{r['bytes_sent_per_rank_round'] / 1e6:.3f}MB"),
        ("DDP", lambda r: f"{r['ddp_bytes_per_rank_round'] / 1e6:.1f}MB"), ("DDP/ours", lambda r: f"{r['ddp_over_ours']:.0f}x"),
        ("target", lambda r: None if r["target_ddp_over_ours"] is None else f"{r['target_ddp_over_ours']}x"),
        ("outer s", lambda r: f"{r['outer_seconds_median']:.3f}"), ("round s", lambda r: f"{r['round_seconds_median']:.2f}"),
        ("outer %", lambda r: _percent(r["outer_fraction_median"])),
        ("incl. wait", lambda r: _percent(r["outer_fraction_incl_wait_median"])), ("val ppl", lambda r: f"{r['val_ppl']:.2f}"),
        ("vs fp32", lambda r: f"{(r['val_ppl'] / fp32['val_ppl'] - 1) * 100:+.2f}%" if fp32 else None),
    ]
    return markdown_table([{"dtype": dtype, **r} for dtype, r in results.items()], columns)


def main(argv: list[str] | None = None) -> int:
    """Runs the comm_dtype comparison, or with --rows the outer-sync table."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.rows:
        row_names(args.rows)  # a typo ends here, before the corpus is written and the model pretrained
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else work / "corpus.jsonl"
    if not corpus.is_file():
        write_corpus(Path(args.data), corpus, args.docs_per_source)
    cfg = load_config(None, base_overrides(args, work, corpus))
    if not (work / "run" / "pretrain" / "config.json").is_file():
        from dipaco.run import Run

        Run(cfg).prepare()
        Run(cfg).pretrain()
    cfg_file = work / "bench.yaml"
    save_config(cfg, cfg_file)
    env = environment("cpu")
    meta = {"nproc": args.nproc, "topology": args.topology, "rounds": args.rounds, "inner_steps": args.inner_steps,
            "torch": env["torch"], "threads_per_rank": 1, "backend": "gloo", "rate": args.rate,
            "command": command_line("comm", argv), "environment": env}
    if args.rows:
        rows = sync_table(args, cfg, cfg_file, work)
        if args.out:
            write_json(args.out, {"meta": meta, "results": rows}, indent=2)
        return 0

    from dipaco.run import Run

    results: dict[str, dict[str, Any]] = {}
    for dtype in args.dtypes.split(","):
        name = f"comm_{dtype}_{args.nproc}r_{args.inner_steps}s"
        exp_dir = work / "run" / "train" / name
        shutil.rmtree(exp_dir, ignore_errors=True)
        wall = run_job(cfg_file, args.nproc, name, [f"dist.comm_dtype={dtype}"])
        row = summarize(exp_dir, args.inner_steps)
        run_cfg = replace(cfg, train=replace(cfg.train, name=name), dist=replace(cfg.dist, comm_dtype=dtype))
        row["val_ppl"] = Run(run_cfg).evaluate()["overall"]["ppl"]
        row["job_wall_seconds"] = wall
        results[dtype] = row

    h = args.inner_steps
    for dtype, r in results.items():
        r["target_ddp_over_ours"] = {"fp32": h, "int8": 4 * h}.get(dtype)
    print(f"{args.nproc} ranks, {args.topology}, {args.rounds} rounds x {h} inner steps, gloo on CPU "
          f"(bytes per rank per round; DDP = fp32 gradient all-reduce of a path every inner step)")
    print(dtype_table(results, h))
    if args.out:
        write_json(args.out, {"meta": meta, "results": results}, indent=2)
    return 0
