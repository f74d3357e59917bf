"""Training across sites: DiPaCo and DiLoCo against a real DDP, one torchrun node per site, over shaped links (issue 72).

Builds N sites (:mod:`bench.netns`: a network namespace each, joined by a switch, each link shaped by ``tbf``) once per
link profile, and runs every row as ``torchrun --nnodes N`` with one node per site (c10d rendezvous on site 0, gloo,
``OMP_NUM_THREADS=1``), on one prepared and pretrained tiny run:

* ``ddp``: a real ``torch.nn.parallel.DistributedDataParallel`` run of the dense path-sized model (this module's
  ``--ddp-worker``), from the same pretrained weights, with DiPaCo's global tokens per step (P paths x batch B,
  split over the N ranks), the same AdamW and schedule, for as many steps as a path does;
* ``diloco``: N replicas of the dense model, one per site (``topology.preset=diloco:N``);
* ``dipaco``: the N x N grid, N paths per site; ``dipaco_streaming`` (Streaming DiLoCo, 2 fragments, 2 overlapped
  steps, fp4) and ``dipaco_delayed_int8`` (the one-step-delay sync, int8);
* ``torchft_diloco`` (issue 75): the peer, torchft's own ``local_sgd.DiLoCo`` (the ``peers`` extra), one replica group
  per site joined by its Lighthouse on site 0, doing ``diloco``'s work (:mod:`bench.torchft_peer`); and
  ``diloco_uniform``, dipaco's DiLoCo averaging the replicas uniformly as torchft does (dipaco's default weights
  them by shard tokens): the fairness check compares these two at equal steps.

Per row and profile: training wall-clock to the target validation perplexity (DiPaCo rows: the rounds' own seconds,
slowest rank, eval.every=1; DDP: rank 0's step time, its evaluation excluded), the share of the time spent waiting
on exchanges, the bytes each site sent (its interface's tx counter, everything included) and the same against the
unshaped links (the compute-only limit) and against DDP. The target is the validation perplexity DDP reaches at the
end of its run on the best link (``lan``). A DDP run that cannot reach it within ``--ddp-seconds`` is stopped and its
time extrapolated from its measured step time and the steps it needed on the best link.

    python -m bench sites --out docs/bench_sites.json                  # 4 sites, unshaped + lan, wan, poor
    python -m bench sites --sites 2 --profiles wan,poor --rows ddp,dipaco
    python -m bench sites --sites 2 --profiles lan --rows diloco,diloco_uniform,torchft_diloco   # torchft beside

Needs root (it makes namespaces); refuses in one line otherwise. Resumable: ``--resume`` keeps finished rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from bench import lm_training as lm
from bench.harness import REPO, Column, Results, argument_parser, command_line, environment, markdown_table
from bench.netns import PROFILES, Sites, SitesUnavailable, netem_available, profile, unavailable

ROWS: dict[str, list[str]] = {
    "ddp": [],
    "diloco": ["topology.preset=diloco:{n}"],
    "dipaco": ["topology.preset=grid:{n}x{n}"],
    "dipaco_streaming": ["topology.preset=grid:{n}x{n}", "outer.sync=streaming", "outer.streaming.num_fragments=2",
                         "outer.streaming.overlap_steps=2", "outer.streaming.pattern=balanced", "dist.comm_dtype=fp4"],
    "dipaco_delayed_int8": ["topology.preset=grid:{n}x{n}", "outer.sync=delayed", "dist.comm_dtype=int8"],
    # torchft averages the replicas' changes uniformly; dipaco's default weights them by shard tokens (issue 75)
    "diloco_uniform": ["topology.preset=diloco:{n}", "outer.weighting=uniform"],
    "torchft_diloco": [],  # torchft's own DiLoCo, one replica group per site (bench/torchft_peer.py)
}
LIGHTHOUSE_PORT = 29510  # torchft's Lighthouse on site 0 (its default port)
TORCHFT_API = ("torchft.Manager", "torchft.ProcessGroupGloo", "torchft.local_sgd.DiLoCo")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argument_parser("sites", __doc__)
    p.add_argument("--sites", type=int, default=4)
    p.add_argument("--profiles", default="lan,wan,poor",
                   help="link profiles (bench.netns.PROFILES) or tc rates, beside the unshaped links ('': those alone)")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--work", default="/tmp/dipaco_bench_sites")
    p.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--corpus", help="a JSONL corpus (id, label, text) instead of a slice of --data's")
    p.add_argument("--docs-per-source", type=int, default=300)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per path and inner step")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--ddp-seconds", type=float, default=240.0, help="stop a DDP run after this much training")
    p.add_argument("--target-fraction", type=float, default=1.0,
                   help="the target: DDP's validation perplexity on the best link after this fraction of its steps")
    p.add_argument("--row-timeout", type=float, default=900.0, help="a row whose nodes run longer is killed: an error")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--resume", action="store_true")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the run every row starts from


def base_overrides(args: argparse.Namespace, work: Path, corpus: Path) -> list[str]:
    return [f"run.dir={work / 'run'}", f"data.corpus={corpus}", "run.progress=false", "run.device=cpu",
            f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={3 * args.hidden}", f"model.num_heads={max(1, args.hidden // 32)}",
            f"tokenizer.vocab_size={args.vocab}", "data.seq_len=64", "data.prefix_tokens=16", "data.empty_docs=skip",
            "pretrain.steps=100", "pretrain.optim.warmup_steps=10", "pretrain.optim.batch_size=16",
            f"train.rounds={args.rounds}", f"train.inner_steps={args.inner_steps}",
            f"train.optim.batch_size={args.batch}", "train.optim.warmup_steps=20",
            "eval.batch_size=32", "eval.max_docs=120", "eval.every=1", "train.checkpoint_background=true",
            "dist.timeout_s=600"]


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """Prepares and pretrains the run once (``work/cfg.yaml``); every row and profile trains from it."""
    return lm.prepared_once(work, lambda corpus: base_overrides(args, work, corpus), args.corpus, Path(args.data),
                            args.docs_per_source)


# ----------------------------------------------------------------------------- one row on the sites


def tx_bytes(sites: Sites) -> list[int]:
    """Bytes each site's interface has sent so far."""
    return [sites.link_bytes(i)[0] for i in range(len(sites))]


def torchft_version() -> str:
    """The installed torchft's version, once every name the peer rows use is there; else one line saying what lacks."""
    import importlib
    from importlib import metadata

    versions = []
    for package in ("torchft-nightly", "torchft"):
        try:
            versions.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            pass
    if not versions:
        raise SystemExit('the torchft rows need torchft: pip install -e ".[peers]"')
    version = versions[0]
    for name in TORCHFT_API:
        module, _, attr = name.rpartition(".")
        if not hasattr(importlib.import_module(module), attr):
            raise SystemExit(f"the torchft rows need {name}, which torchft {version} lacks")
    return version


def lighthouse(sites: Sites) -> list[str]:
    """torchft's Lighthouse (the wheel's ``torchft_lighthouse``) on site 0, for a quorum of every site."""
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    return sites[0].command([str(exe), "--min_replicas", str(len(sites)), "--bind",
                             f"{sites[0].address}:{LIGHTHOUSE_PORT}", "--join_timeout_ms", "600000"])


def peer_commands(sites: Sites, cfg_file: Path, outs: list[Path]) -> list[list[str]]:
    """A torchft replica per site, writing to ``outs[i]``: a process of its own (a replica group of one needs no
    launcher), joined by the Lighthouse on site 0."""
    url = f"http://{sites[0].address}:{LIGHTHOUSE_PORT}"
    return [sites[i].command([sys.executable, "-m", "bench.torchft_peer", "--config", str(cfg_file), "--replicas",
                              str(len(sites)), "--replica", str(i), "--address", sites[i].address, "--lighthouse", url,
                              "--out", str(out)])
            for i, out in enumerate(outs)]


Launch = tuple[dict[str, list[str]], list[list[str]], Callable[[], dict[str, Any]]]


def row_launch(sites: Sites, row: str, name: str, cfg_file: Path, args: argparse.Namespace, work: Path) -> Launch:
    """What ``row`` runs: the helpers each site's command needs started first (by log name), each site's
    command, and the reader of the row's figures once they have run."""
    n = len(sites)
    if row == "torchft_diloco":
        outs = [work / f"{name}.replica{i}.jsonl" for i in range(n)]
        return {"lighthouse": lighthouse(sites)}, peer_commands(sites, cfg_file, outs), lambda: torchft_figures(outs)
    if row == "ddp":
        out = work / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        program = ["-m", "bench.sites", "--ddp-worker", "--config", str(cfg_file), "--paths", str(n * n),
                   "--seconds", str(args.ddp_seconds), "--out", str(out)]
        figures = partial(ddp_figures, out)
    else:
        overrides = [o.format(n=n) for o in ROWS[row]]
        program = ["-m", "dipaco", "train", "--config", str(cfg_file), f"train.name={name}", *overrides]
        exp = work / "run" / "train" / name
        if exp.exists():
            shutil.rmtree(exp)
        figures = partial(dipaco_figures, exp)
    return {}, [sites.torchrun(i, program, nnodes=str(n), job=name, max_restarts=0) for i in range(n)], figures


def run_row(sites: Sites, row: str, name: str, cfg_file: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One row on the sites (:func:`row_launch`: torchrun nodes, one per site, or a torchft replica per site); its
    figures (see :func:`dipaco_figures`, :func:`ddp_figures`, :func:`torchft_figures`)."""
    helpers, commands, figures = row_launch(sites, row, name, cfg_file, args, work)
    before = tx_bytes(sites)

    def start_process(cmd: list[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        with log.open("w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)

    started = [start_process(cmd, work / f"{name}.{helper}.log") for helper, cmd in helpers.items()]
    procs, logs = [], []
    start = time.perf_counter()
    for i, cmd in enumerate(commands):
        logs.append(work / f"{name}.site{i}.log")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **sites.environment(i)}
        procs.append(start_process(cmd, logs[-1], env))
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, args.row_timeout - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{row} on {name}: still running after --row-timeout={args.row_timeout:g}s; logs in {work}") from None
    finally:
        for proc in [*procs, *started]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - start
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if failed:
        raise SystemExit(f"{row} on {name}: site {failed[0]} failed:\n{logs[failed[0]].read_text()[-3000:]}")
    sent = [after - b for after, b in zip(tx_bytes(sites), before)]
    return {**figures(), "wall_seconds": wall, "bytes_per_site": statistics.mean(sent), "bytes_sent": sent}


def dipaco_figures(exp: Path) -> dict[str, Any]:
    """The curve (training seconds, validation perplexity) after each round and the wait share of a DiPaCo row."""
    from dipaco.metrics import read_metrics

    comm = read_metrics(exp / "metrics.jsonl", "comm")
    evals = {r["round"]: r["overall_ppl"] for r in read_metrics(exp / "metrics.jsonl", "eval")}
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in comm:
        by_round.setdefault(r["round"], []).append(r)
    clock, curve, waits = 0.0, [], []
    for rnd in sorted(by_round):
        clock += max(r["round_seconds"] for r in by_round[rnd])
        curve.append([clock, evals[rnd]])
        last = min(by_round[rnd], key=lambda r: r["comm_seconds"])  # the last rank to arrive: no peer's lag
        waits.append(last["comm_seconds"] / last["round_seconds"])
    return {"curve": curve, "wait_share": statistics.median(waits), "train_seconds": clock}


def torchft_figures(outs: list[Path]) -> dict[str, Any]:
    """A torchft row's curve, as :func:`dipaco_figures` reads a DiPaCo row's: each sync's slowest replica's round
    seconds (its scoring included, as dipaco's rounds include theirs), and the perplexity of the replicas' validation
    documents summed; the wait share is the sync step's time (quorum, allreduce, outer step) over the round's."""
    replicas = [[json.loads(line) for line in out.read_text().splitlines()] for out in outs]
    syncs = [[r for r in records if r["event"] == "sync"] for records in replicas]
    if len({len(s) for s in syncs}) != 1 or not syncs[0]:
        raise SystemExit(f"torchft replicas logged {[len(s) for s in syncs]} syncs: {outs}")
    uncommitted = [(i, r["round"]) for i, s in enumerate(syncs) for r in s if r["committed"] != r["round"]]
    if uncommitted:  # a sync torchft did not commit leaves the weights where they were: not the same work
        raise SystemExit(f"torchft did not commit every sync (replica, round): {uncommitted[:5]}")
    clock, curve, waits = 0.0, [], []
    for rnd in zip(*syncs):
        clock += max(r["round_seconds"] for r in rnd)
        curve.append([clock, math.exp(sum(r["nll"] for r in rnd) / sum(r["tokens"] for r in rnd))])
        last = min(rnd, key=lambda r: r["sync_seconds"])  # the last replica to arrive: no peer's lag
        waits.append(last["sync_seconds"] / last["round_seconds"])
    return {"curve": curve, "wait_share": statistics.median(waits), "train_seconds": clock,
            "participants": sorted({r["participants"] for s in syncs for r in s})}


def ddp_figures(out: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in out.read_text().splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    end = records[-1]
    return {"curve": [[r["train_seconds"], r["ppl"]] for r in evals], "steps": end["step"],
            "steps_planned": end["steps_planned"], "seconds_per_step": end["train_seconds"] / max(end["step"], 1),
            "train_seconds": end["train_seconds"], "stopped_early": end["step"] < end["steps_planned"],
            "curve_steps": [r["step"] for r in evals]}


# ----------------------------------------------------------------------------- the DDP worker


def ddp_worker(argv: list[str]) -> None:
    """One rank of the DDP baseline (under torchrun): the dense path-sized model from the pretrained weights,
    DiPaCo's global batch split over the ranks, AdamW with the inner loop's settings, and rank 0 evaluating the
    validation slice every ``train.inner_steps`` steps (its clock stops meanwhile)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dipaco.data.packing import DocumentTokens
    from dipaco.eval.evaluate import validation_split
    from dipaco.model.pretrained import load_pretrained, path_llama_config
    from dipaco.model.scoring import Scoring, score_documents
    from dipaco.paths.lr_schedule import build_scheduler
    from dipaco.route.shards import build_shards, routed_data
    from dipaco.run import load_config
    from dipaco.runtime import seed_everything

    p = argparse.ArgumentParser(prog="python -m bench.sites --ddp-worker")
    p.add_argument("--config", required=True)
    p.add_argument("--paths", type=int, required=True, help="DiPaCo's paths: the global batch is paths x batch")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    cfg = load_config(a.config, [])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.run.seed + rank, torch.device("cpu"), True)
    prepared = routed_data(cfg.run.dir, cfg.data, cfg.tokenizer, False)
    seqs = build_shards(prepared.train, np.zeros(len(prepared.train), dtype=np.int64), 1, cfg.data.seq_len,
                        prepared.tokenizer.eos_token_id)[0]
    mine = np.arange(rank, len(seqs), world)  # disjoint sequences per rank
    llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
    model = load_pretrained(Path(cfg.run.dir) / "pretrain", llama)
    ddp = DistributedDataParallel(model)
    optim = cfg.train.optim
    steps = cfg.train.rounds * cfg.train.inner_steps
    local_batch = max(1, a.paths * optim.batch_size // world)
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                            weight_decay=optim.weight_decay)
    sched = build_scheduler(opt, optim.warmup_steps, steps, optim.min_lr_ratio)
    gen = torch.Generator().manual_seed(cfg.run.seed + rank)
    val = validation_split(cfg.eval, prepared)
    docs = DocumentTokens(val).documents(np.arange(len(val)), np.int32)
    scoring = Scoring(cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id)
    out = open(a.out, "w") if rank == 0 else None
    clock, step = 0.0, 0

    def log(**record: Any) -> None:
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    while step < steps:
        begin = time.perf_counter()
        x = seqs[mine[torch.randint(len(mine), (local_batch,), generator=gen).numpy()]]
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        clock += time.perf_counter() - begin
        if step % cfg.train.inner_steps == 0 or step == steps:
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    scores = score_documents(model, docs, scoring)
                model.train()
                log(event="eval", step=step, train_seconds=clock, ppl=math.exp(scores.nll.sum() / scores.tokens.sum()))
            done = torch.tensor([float(clock >= a.seconds)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            if done.item():
                break
    log(event="end", step=step, steps_planned=steps, train_seconds=clock, local_batch=local_batch, ranks=world)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the table


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first point at or below ``target`` (linear between points), None if never."""
    previous = (0.0, math.inf)
    for seconds, ppl in curve:
        if ppl <= target:
            t0, p0 = previous
            if not math.isfinite(p0) or p0 == ppl:
                return seconds
            return t0 + (seconds - t0) * (p0 - target) / (p0 - ppl)
        previous = (seconds, ppl)
    return None


def summarize(results: Results, profiles: list[str], rows: list[str], target_fraction: float = 1.0) -> list[dict[str, Any]]:
    """Each row and profile against the target (the validation perplexity of DDP on the best link after
    ``target_fraction`` of its steps), DDP and compute-only (unshaped links)."""
    by = {r["name"]: r for r in results.rows}
    ddp_best = by.get("ddp@lan") or by.get("ddp@unshaped")
    if ddp_best is None:
        return []
    at = max(1, round(target_fraction * len(ddp_best["curve"])))  # the eval point at that fraction of DDP's steps
    target = ddp_best["curve"][at - 1][1]
    steps_needed = ddp_best["curve_steps"][at - 1]
    table = []
    for row in rows:
        for prof in ["unshaped", *profiles]:
            r = by.get(f"{row}@{prof}")
            if r is None:
                continue
            reached = time_to(r["curve"], target)
            extrapolated = False
            if reached is None and row == "ddp":
                reached, extrapolated = steps_needed * r["seconds_per_step"], True
            table.append({"row": row, "profile": prof, "target_ppl": target, "seconds_to_target": reached,
                          "extrapolated": extrapolated, "final_ppl": r["curve"][-1][1], "wait_share": r.get("wait_share"),
                          "bytes_per_site": r["bytes_per_site"], "train_seconds": r["train_seconds"]})
    index = {(t["row"], t["profile"]): t for t in table}
    for t in table:
        alone = index.get((t["row"], "unshaped"))
        ddp = index.get(("ddp", t["profile"]))
        s = t["seconds_to_target"]
        t["vs_compute_only"] = s / alone["seconds_to_target"] if s and alone and alone["seconds_to_target"] else None
        t["ddp_over_this"] = ddp["seconds_to_target"] / s if s and ddp and ddp["seconds_to_target"] else None
        if t["row"] == "ddp" and "ddp@unshaped" in by:  # the step time the links add to the compute-only one
            t["wait_share"] = max(0.0, 1 - by["ddp@unshaped"]["seconds_per_step"]
                                  / by[f"ddp@{t['profile']}"]["seconds_per_step"])
    return table


def fairness(results: Results) -> list[dict[str, Any]]:
    """Issue 75's fairness check, per link: torchft's DiLoCo against dipaco's on the same work, round by round (the
    same steps): the largest relative difference in validation perplexity, against ``diloco_uniform`` (the same
    averaging) and ``diloco`` (dipaco's default, token-weighted)."""
    by = {r["name"]: r for r in results.rows}
    out = []
    for name, peer in sorted(by.items()):
        row, _, prof = name.partition("@")
        if row != "torchft_diloco":
            continue
        for mine in ("diloco_uniform", "diloco"):
            r = by.get(f"{mine}@{prof}")
            if r is None:
                continue
            pairs = list(zip((p for _, p in r["curve"]), (p for _, p in peer["curve"])))
            diffs = [abs(theirs / ours - 1) for ours, theirs in pairs]
            out.append({"profile": prof, "dipaco_row": mine, "rounds": len(pairs), "max_rel_diff": max(diffs),
                        "final_dipaco": pairs[-1][0], "final_torchft": pairs[-1][1],
                        "within_half_percent": max(diffs) <= 0.005})
    return out


def _secs(t: Mapping[str, Any]) -> str | None:
    s = t["seconds_to_target"]
    return None if s is None else f"{s:.1f}" + (" (extrapolated)" if t["extrapolated"] else "")


TABLE: list[Column] = [
    ("row", "row"), ("link", "profile"), ("s to target", _secs),
    ("vs compute-only", lambda t: None if t["vs_compute_only"] is None else f"{t['vs_compute_only']:.2f}x"),
    ("DDP / this", lambda t: None if t["ddp_over_this"] is None else f"{t['ddp_over_this']:.1f}x"),
    ("wait", lambda t: None if t["wait_share"] is None else f"{t['wait_share'] * 100:.1f}%"),
    ("MB per site", lambda t: f"{t['bytes_per_site'] / 1e6:.1f}"), ("final ppl", lambda t: f"{t['final_ppl']:.2f}"),
]


FAIRNESS: list[Column] = [
    ("link", "profile"), ("torchft_diloco against", "dipaco_row"), ("rounds", "rounds"),
    ("largest difference", lambda f: f"{100 * f['max_rel_diff']:.3f}%"),
    ("final ppl torchft / dipaco", lambda f: f"{f['final_torchft']:.3f} / {f['final_dipaco']:.3f}"),
    ("within 0.5%", "within_half_percent"),
]


def main(argv: list[str]) -> int | None:
    if argv[:1] == ["--ddp-worker"]:
        ddp_worker(argv[1:])
        return None
    args = parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"python -m bench sites: {reason}; run it as root on a machine that can make network namespaces",
              file=sys.stderr)
        return 2
    profiles = [p for p in args.profiles.split(",") if p]  # "": the unshaped links alone
    links = {name: profile(name) for name in profiles}
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; one of {', '.join(ROWS)}")
    work = Path(args.work)
    peers = {"torchft": torchft_version()} if any(r.startswith("torchft") for r in rows) else {}
    cfg_file = prepare(args, work)
    results = Results.load(args.out or work / "results.json", "sites", args.resume)
    netem = netem_available()
    results.meta = {"meta": {"command": command_line("sites", argv), "machine": environment("cpu"),
                             "netem": netem, "sites": args.sites, "peers": peers,
                             "links": {name: link.describe(netem) for name, link in links.items()}}}
    settings = {k: v for k, v in vars(args).items()
                if k not in ("out", "resume", "profiles", "rows", "target_fraction", "row_timeout")}
    # DDP first on each profile: the target comes from its run on the best link
    order = ["ddp", *[r for r in rows if r != "ddp"]] if "ddp" in rows else rows
    for prof in ["unshaped", *profiles]:
        todo = [r for r in order if not results.has(f"{r}@{prof}", settings)]
        if not todo:
            continue
        with Sites(args.sites, PROFILES["unshaped"] if prof == "unshaped" else links[prof]) as sites:
            for row in todo:
                print(f"[sites] {row} on {args.sites} sites, {prof} links ...", flush=True)
                record = run_row(sites, row, f"{row}_{prof}", cfg_file, args, work)
                results.put(f"{row}@{prof}", settings, record)
                results.write()
                print(f"[sites] {row} @ {prof}: {record['train_seconds']:.1f}s training, final ppl "
                      f"{record['curve'][-1][1]:.2f}, {record['bytes_per_site'] / 1e6:.1f} MB per site", flush=True)
    table = summarize(results, profiles, rows, args.target_fraction)
    results.meta["table"] = table
    results.meta["fairness"] = fair = fairness(results)
    results.write()
    print(markdown_table(table, TABLE))
    if fair:
        print(markdown_table(fair, FAIRNESS))
    return None


if __name__ == "__main__":  # torchrun -m bench.sites --ddp-worker ...: a rank of the DDP baseline
    try:
        sys.exit(main(sys.argv[1:]))
    except SitesUnavailable as exc:
        sys.exit(f"python -m bench sites: {exc}")
