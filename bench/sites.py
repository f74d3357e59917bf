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
  them by shard tokens): the fairness check compares these two at equal steps;
* ``torchft_ddp``: torchft's fault-tolerant DDP (``torchft.ddp`` and ``torchft.optim.OptimizerWrapper``, a quorum
  every step) on ``ddp``'s work (:mod:`bench.dense_work`), compared with it evaluation by evaluation;
* the faults, ``diloco_fault`` and ``torchft_diloco_fault``: ``diloco`` and ``torchft_diloco`` with the last site's
  processes killed half-way through ``--kill-round`` and started again ``--down-seconds`` later. dipaco runs its
  elastic torchrun (``--nnodes 1:N``: the survivors continue from the newest checkpoint, the site rejoins); torchft's
  quorum goes on without the replica (``min_replica_size`` 1) and heals it from a peer when it is back. The fault
  table sets each against the same launch uninterrupted (``diloco_elastic``, ``torchft_diloco``): wall time lost,
  inner steps lost, final perplexity.

Per row and profile: training wall-clock to the target validation perplexity (DiPaCo rows: the rounds' own seconds,
slowest rank, eval.every=1; DDP: rank 0's step time, its evaluation excluded), the share of the time spent waiting
on exchanges, the bytes each site sent (its interface's tx counter, everything included) and the same against the
unshaped links (the compute-only limit) and against DDP. The target is the validation perplexity DDP reaches at the
end of its run on the best link (``lan``). A DDP run that cannot reach it within ``--ddp-seconds`` is stopped and its
time extrapolated from its measured step time and the steps it needed on the best link.

    python -m bench sites --out docs/results/bench_sites.json                  # 4 sites, unshaped + lan, wan, poor
    python -m bench sites --sites 2 --profiles wan,poor --rows ddp,dipaco
    python -m bench sites --sites 2 --profiles lan --rows diloco,diloco_uniform,torchft_diloco   # torchft beside
    python -m bench sites --sites 2 --profiles "" --rounds 16 --down-seconds 2 \
        --rows diloco_elastic,diloco_fault,torchft_diloco,torchft_diloco_fault                # a site killed
    python -m bench sites --smoke                                                             # CI: the peer rows

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
from dataclasses import dataclass
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
    # two replicas a site, DiPaCo's compute per site: torchft's DiLoCo-2N's perplexities (the fairness check: bit
    # for bit those of diloco_uniform) with dipaco's timing
    "diloco_2n_uniform": ["topology.preset=diloco:{n2}", "outer.weighting=uniform"],
    "torchft_diloco": [],  # torchft's own DiLoCo, one replica group per site (bench/torchft_peer.py)
    "torchft_ddp": [],  # torchft's fault-tolerant DDP on the ddp row's work (bench/dense_work.py)
    # the fault (issue 75): the last site's processes killed mid-round, then started again (see inject_fault)
    "diloco_fault": ["topology.preset=diloco:{n}"],
    "torchft_diloco_fault": [],
    "diloco_elastic": ["topology.preset=diloco:{n}"],  # diloco_fault's elastic launch, no site killed
}
FAULTS = {"diloco_fault": "diloco_elastic", "torchft_diloco_fault": "torchft_diloco"}  # -> the same launch, no kill
# row -> bench.torchft_peer --algorithm
SMOKE_ROWS = ("ddp", "diloco_uniform", "torchft_diloco", "torchft_ddp")
PEERS = {"torchft_diloco": "diloco", "torchft_ddp": "ddp", "torchft_diloco_fault": "diloco"}
DATA_PARALLEL = ("ddp", "torchft_ddp")  # rows read by ddp_figures: a curve per evaluation, stopped at --ddp-seconds
LIGHTHOUSE_PORT = 29510  # torchft's Lighthouse on site 0 (its default port)
# the fault rows' elastic rendezvous: a node that stops beating is dropped within 3 s (tests/dipaco/comm/test_sites.py)
ELASTIC_RDZV = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
TORCHFT_API = ("torchft.Manager", "torchft.ProcessGroupGloo", "torchft.local_sgd.DiLoCo",
               "torchft.ddp.DistributedDataParallel", "torchft.optim.OptimizerWrapper")


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
    p.add_argument("--kill-round", type=int, default=3, help="fault rows: the last site is killed half-way through "
                   "this round (by site 0's clock), then started again")
    p.add_argument("--down-seconds", type=float, default=5.0, help="fault rows: how long the killed site stays down")
    p.add_argument("--row-timeout", type=float, default=900.0, help="a row whose nodes run longer is killed: an error")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="CI: 2 sites, unshaped links, torchft's rows beside dipaco's DiLoCo and torch's DDP, 4 rounds "
                        "x 5 steps; fails when the fairness check does")
    args = p.parse_args(argv)
    if args.smoke:
        args.sites, args.profiles, args.rows = 2, "", ",".join(SMOKE_ROWS)
        args.rounds, args.inner_steps, args.docs_per_source = 4, 5, 100
    return args


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


PREPARED = ("data", "tokenizer", "model", "pretrain")  # the config sections the prepared run was made with


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """Prepares and pretrains the run once (``work/cfg.yaml``); every row and profile trains from it, with this
    invocation's training settings (``work/rows.yaml``). A work directory prepared with another model or data is
    refused: its rows would not be the ones asked for."""
    from dipaco.config import save_config
    from dipaco.run import load_config

    prepared = lm.prepared_once(work, lambda corpus: base_overrides(args, work, corpus), args.corpus,
                                Path(args.data), args.docs_per_source)
    have = load_config(prepared)
    want = load_config(None, base_overrides(args, work, Path(args.corpus) if args.corpus else work / "corpus.jsonl"))
    differ = [section for section in PREPARED if getattr(have, section) != getattr(want, section)]
    if differ:
        raise SystemExit(f"{work} was prepared with other {', '.join(differ)} settings than these; "
                         f"pass another --work, or remove it")
    rows = work / "rows.yaml"
    save_config(want, rows)
    return rows


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


def lighthouse(sites: Sites, min_replicas: int) -> list[str]:
    """torchft's Lighthouse (the wheel's ``torchft_lighthouse``) on site 0, for quorums of ``min_replicas`` or more."""
    exe = Path(sys.executable).with_name("torchft_lighthouse")
    return sites[0].command([str(exe), "--min_replicas", str(min_replicas), "--bind",
                             f"{sites[0].address}:{LIGHTHOUSE_PORT}", "--join_timeout_ms", "600000"])


def peer_commands(sites: Sites, algorithm: str, cfg_file: Path, outs: list[Path], extra: list[str]) -> list[list[str]]:
    """A torchft replica per site, writing to ``outs[i]``: a process of its own (a replica group of one needs no
    launcher), joined by the Lighthouse on site 0."""
    url = f"http://{sites[0].address}:{LIGHTHOUSE_PORT}"
    return [sites[i].command([sys.executable, "-m", "bench.torchft_peer", "--algorithm", algorithm, "--config",
                              str(cfg_file), "--replicas", str(len(sites)), "--replica", str(i), "--address",
                              sites[i].address, "--lighthouse", url, "--out", str(out), *extra])
            for i, out in enumerate(outs)]


@dataclass
class Launch:
    """What a row runs: the helpers each site's command needs started first (by log name), each site's command,
    and the reader of the row's figures once they have run. A fault row adds each site's command for when it is
    started again, and the rounds site 0 has logged so far: when (``time.time()``) and their seconds."""

    helpers: dict[str, list[str]]
    commands: list[list[str]]
    figures: Callable[[], dict[str, Any]]
    again: list[list[str]] | None = None
    rounds_done: Callable[[], list[tuple[float, float]]] | None = None
    log_lag: int = 0  # rounds finished beyond those logged: dipaco logs a round once its checkpoint lands


def row_launch(sites: Sites, row: str, name: str, cfg_file: Path, args: argparse.Namespace, work: Path) -> Launch:
    """What ``row`` runs: torchrun nodes, one per site, or a torchft replica per site with its Lighthouse."""
    n = len(sites)
    fault = row in FAULTS
    elastic = row in FAULTS or row in FAULTS.values()
    if row in PEERS:
        outs = [work / f"{name}.replica{i}.jsonl" for i in range(n)]
        agains = [work / f"{name}.replica{i}.again.jsonl" for i in range(n)]
        for out in [*outs, *agains]:
            out.unlink(missing_ok=True)  # an earlier run's: a fault row reads replica 0's syncs as they come
        extra = ["--seconds", str(args.ddp_seconds)] if row == "torchft_ddp" else []
        # a fault row lets a quorum go on without the lost replica, as dipaco's elastic rows go on without its site
        extra += ["--min-replicas", "1"] if fault else []
        helpers = {"lighthouse": lighthouse(sites, 1 if fault else n)}
        commands = peer_commands(sites, PEERS[row], cfg_file, outs, extra)
        if row == "torchft_ddp":
            return Launch(helpers, commands, partial(ddp_figures, outs[0]))
        if not fault:
            return Launch(helpers, commands, partial(torchft_figures, outs))
        return Launch(helpers, commands, partial(torchft_fault_figures, outs, agains, args.inner_steps),
                      again=peer_commands(sites, PEERS[row], cfg_file, agains, extra),
                      rounds_done=partial(torchft_rounds_done, outs[0]))
    if row == "ddp":
        out = work / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        program = ["-m", "bench.sites", "--ddp-worker", "--config", str(cfg_file), "--paths", str(n * n),
                   "--seconds", str(args.ddp_seconds), "--out", str(out)]
        return Launch({}, [sites.torchrun(i, program, nnodes=str(n), job=name, max_restarts=0) for i in range(n)],
                      partial(ddp_figures, out))
    overrides = [o.format(n=n, n2=2 * n) for o in ROWS[row]]
    # a fault row's survivors notice the lost site within 10 s of its last beat, not the default 60
    overrides += ["dist.round_timeout_min_s=10"] if elastic else []
    program = ["-m", "dipaco", "train", "--config", str(cfg_file), f"train.name={name}", *overrides]
    exp = work / "run" / "train" / name
    if exp.exists():
        shutil.rmtree(exp)
    if not elastic:
        return Launch({}, [sites.torchrun(i, program, nnodes=str(n), job=name, max_restarts=0) for i in range(n)],
                      partial(dipaco_figures, exp))
    nodes = [sites.torchrun(i, program, nnodes=f"1:{n}", job=name, max_restarts=3, rdzv_conf=ELASTIC_RDZV)
             for i in range(n)]
    if not fault:
        return Launch({}, nodes, partial(dipaco_figures, exp))
    from dipaco.run import load_config

    # the background writer (the default) logs round r once its checkpoint lands, after round r + 1
    lag = 1 if load_config(cfg_file).train.checkpoint_background else 0
    return Launch({}, nodes, partial(dipaco_fault_figures, exp, work / f"{name}.site0.log"), again=nodes,
                  rounds_done=partial(dipaco_rounds_done, exp), log_lag=lag)


def run_row(sites: Sites, row: str, name: str, cfg_file: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One row on the sites (:func:`row_launch`); its figures (see :func:`dipaco_figures`, :func:`ddp_figures`,
    :func:`torchft_figures`), and for a fault row what :func:`inject_fault` did."""
    launch = row_launch(sites, row, name, cfg_file, args, work)
    before = tx_bytes(sites)

    def start_process(cmd: list[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        with log.open("w") as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)

    def start_site(i: int, cmd: list[str], log: Path) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **sites.environment(i)}
        return start_process(cmd, log, env)

    started = [start_process(cmd, work / f"{name}.{helper}.log") for helper, cmd in launch.helpers.items()]
    logs = [work / f"{name}.site{i}.log" for i in range(len(sites))]
    start = time.perf_counter()
    procs = [start_site(i, cmd, logs[i]) for i, cmd in enumerate(launch.commands)]
    every = list(procs)
    fault: dict[str, Any] = {}
    try:
        if launch.again is not None:
            fault = inject_fault(sites, launch, procs, args, start, logs[0])
            logs[-1] = work / f"{name}.site{len(sites) - 1}.again.log"
            procs[-1] = start_site(len(sites) - 1, launch.again[-1], logs[-1])
            every.append(procs[-1])
        for proc in procs:
            proc.wait(timeout=max(1.0, args.row_timeout - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{row} on {name}: still running after --row-timeout={args.row_timeout:g}s; logs in {work}") from None
    finally:
        for proc in [*every, *started]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - start
    failed = [i for i, p in enumerate(procs) if p.returncode]
    if failed:
        raise SystemExit(f"{row} on {name}: site {failed[0]} failed:\n{logs[failed[0]].read_text()[-3000:]}")
    sent = [after - b for after, b in zip(tx_bytes(sites), before)]
    return {**launch.figures(), "wall_seconds": wall, "bytes_per_site": statistics.mean(sent), "bytes_sent": sent,
            **({"fault": fault} if fault else {})}


def inject_fault(sites: Sites, launch: Launch, procs: list[subprocess.Popen], args: argparse.Namespace,
                 start: float, log0: Path) -> dict[str, Any]:
    """Kills every process of the last site half-way through round ``--kill-round`` (once site 0 has finished the
    round before, half its last round's time later), keeps it down ``--down-seconds``; the caller starts it again.
    Records the round in flight when the kill came and how far into it (by site 0's clock)."""
    assert launch.rounds_done is not None
    deadline = time.perf_counter() + args.row_timeout
    while len(done := launch.rounds_done()) + launch.log_lag < args.kill_round - 1 or not done:
        if procs[0].poll() is not None or time.perf_counter() > deadline:
            raise SystemExit(f"site 0 ended or stalled before round {args.kill_round - 1}:\n"
                             f"{log0.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
    (logged, last_round), in_flight = done[-1], len(done) + launch.log_lag + 1
    time.sleep(max(0.0, logged + last_round / 2 - time.time()))  # logged: about when the round in flight began
    killed_at, killed_wall = time.perf_counter() - start, time.time()
    sites.kill(len(sites) - 1)
    procs[-1].wait()
    time.sleep(args.down_seconds)
    return {"site": len(sites) - 1, "round": in_flight, "killed_at_s": killed_at,
            "into_round": (killed_wall - logged) / last_round, "down_seconds": args.down_seconds}


def dipaco_rounds_done(exp: Path) -> list[tuple[float, float]]:
    """The rounds site 0's trainer logged so far: when (its ``outer`` records' times) and how long each took (the
    slowest rank's ``comm`` record)."""
    from dipaco.metrics import read_metrics

    if not (exp / "metrics.jsonl").exists():
        return []
    records = read_metrics(exp / "metrics.jsonl")
    seconds: dict[int, float] = {}
    for r in records:
        if r["event"] == "comm":
            seconds[r["round"]] = max(seconds.get(r["round"], 0.0), r["round_seconds"])
    return [(r["time"], seconds[r["round"]]) for r in records if r["event"] == "outer" and r["round"] in seconds]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A worker's records, read as dipaco reads its own metrics (a killed worker's torn last line is left out);
    none before the worker wrote its first."""
    from dipaco.metrics import read_metrics

    return read_metrics(path) if path.exists() else []


def torchft_rounds_done(out: Path) -> list[tuple[float, float]]:
    """The syncs replica 0 logged so far: when, and how long each round took."""
    return [(r["wall"], r["round_seconds"]) for r in read_jsonl(out) if r["event"] == "sync"]


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


def dipaco_fault_figures(exp: Path, log0: Path) -> dict[str, Any]:
    """A dipaco fault row: :func:`dipaco_figures`, and the checkpoint each restart of site 0's worker group continued
    from (its ``[train] restart N of the worker group: continuing from NAME`` lines)."""
    marker = "of the worker group: continuing from "
    restarts = [line.split(marker, 1)[1].strip() for line in log0.read_text(errors="replace").splitlines()
                if marker in line]
    return {**dipaco_figures(exp), "restarts": restarts}


def torchft_figures(outs: list[Path]) -> dict[str, Any]:
    """A torchft row's curve, as :func:`dipaco_figures` reads a DiPaCo row's: each sync's slowest replica's round
    seconds (its scoring included, as dipaco's rounds include theirs), and the perplexity of the replicas' validation
    documents summed; the wait share is the sync step's time (quorum, allreduce, outer step) over the round's."""
    replicas = [read_jsonl(out) for out in outs]
    syncs = [[r for r in records if r["event"] == "sync"] for records in replicas]
    if len({len(s) for s in syncs}) != 1 or not syncs[0]:
        raise SystemExit(f"torchft replicas logged {[len(s) for s in syncs]} syncs: {outs}")
    uncommitted = [(i, r["round"]) for i, s in enumerate(syncs) for r in s if not r["advanced"]]
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


def torchft_fault_figures(outs: list[Path], agains: list[Path], sync_every: int) -> dict[str, Any]:
    """A torchft fault row: the final perplexity (every replica's last sync, the restarted one's log for the site
    killed), the rounds each sync had, and the inner steps thrown away: steps each process ran whose work went into
    no committed average (a killed replica's round in flight, a restarted one's round before a peer healed it, a
    sync that did not commit). ``steps_missing``: the shards' steps that never ran (rounds a replica was down)."""
    runs = [read_jsonl(out) for out in [*outs, *agains]]
    steps_run = sum(1 for records in runs for r in records if r["event"] == "step")
    syncs = [r for records in runs for r in records if r["event"] == "sync"]
    kept = sync_every * sum(1 for r in syncs if r["advanced"] and not r["healed"])
    healed = sum(1 for r in syncs if r["healed"])
    if not healed:  # it trained alone from the start: a run of its own, not a recovery
        raise SystemExit(f"the restarted torchft replica never joined a quorum with its peer (raise --rounds or "
                         f"lower --down-seconds): {agains}")
    finals = [next(r for r in reversed(read_jsonl(again) or read_jsonl(out)) if r["event"] == "sync")
              for out, again in zip(outs, agains)]
    rounds = finals[0]["round"]
    if any(r["round"] != rounds for r in finals):
        raise SystemExit(f"torchft replicas ended at rounds {[r['round'] for r in finals]}: {outs + agains}")
    ppl = math.exp(sum(r["nll"] for r in finals) / sum(r["tokens"] for r in finals))
    participants = [r["participants"] for r in read_jsonl(outs[0]) if r["event"] == "sync"]
    return {"curve": [[None, ppl]], "final_ppl": ppl, "steps_lost": steps_run - kept,
            "steps_missing": len(outs) * rounds * sync_every - kept, "participants_by_round": participants,
            "healed": healed}


def ddp_figures(out: Path) -> dict[str, Any]:
    records = read_jsonl(out)
    evals = [r for r in records if r["event"] == "eval"]
    end = records[-1]
    return {"curve": [[r["train_seconds"], r["ppl"]] for r in evals], "steps": end["step"],
            "steps_planned": end["steps_planned"], "seconds_per_step": end["train_seconds"] / max(end["step"], 1),
            "train_seconds": end["train_seconds"], "stopped_early": end["step"] < end["steps_planned"],
            "curve_steps": [r["step"] for r in evals]}


# ----------------------------------------------------------------------------- the DDP worker


def ddp_worker(argv: list[str]) -> None:
    """One rank of the DDP baseline (under torchrun): :mod:`bench.dense_work`'s share of the work, with rank 0
    evaluating the validation split every ``train.inner_steps`` steps (its clock stops meanwhile)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from bench.dense_work import dense_work
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
    work = dense_work(cfg, a.paths, rank, world)
    ddp = DistributedDataParallel(work.model)
    out = open(a.out, "w") if rank == 0 else None
    clock, step = 0.0, 0

    def log(**record: Any) -> None:
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    while step < work.steps:
        begin = time.perf_counter()
        x = work.next_batch()
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        if work.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(work.model.parameters(), work.grad_clip)
        work.optimizer.step()
        work.schedule.step()
        work.optimizer.zero_grad(set_to_none=True)
        step += 1
        clock += time.perf_counter() - begin
        if step % work.eval_every == 0 or step == work.steps:
            if rank == 0:
                log(event="eval", step=step, train_seconds=clock, ppl=work.validation_ppl())
            done = torch.tensor([float(clock >= a.seconds)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            if done.item():
                break
    log(event="end", step=step, steps_planned=work.steps, train_seconds=clock, local_batch=work.local_batch,
        ranks=world)
    if out is not None:
        out.close()
    dist.destroy_process_group()
    # Freeing the DDP reducer joins gloo's worker thread with the GIL held, while that thread may still be dropping
    # the last collective's Python tensor, which needs the GIL: a deadlock at exit (seen once in 2026-12-06's runs).
    # Everything is written; the process ends without tearing its objects down.
    sys.stdout.flush()
    os._exit(0)


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
            if r is None or row in FAULTS:
                continue
            reached = time_to(r["curve"], target)
            extrapolated = False
            if reached is None and row in DATA_PARALLEL:
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
        alone_row = by.get(f"{t['row']}@unshaped")
        if t["row"] in DATA_PARALLEL and alone_row:  # the step time the links add to the compute-only one
            t["wait_share"] = max(0.0, 1 - alone_row["seconds_per_step"]
                                  / by[f"{t['row']}@{t['profile']}"]["seconds_per_step"])
    return table


# each torchft row against dipaco's rows (or torch's DDP) on the same work: the same algorithm in two implementations
FAIR_PAIRS = {"torchft_diloco": ("diloco_uniform", "diloco"), "torchft_ddp": ("ddp",)}


def fairness(results: Results) -> list[dict[str, Any]]:
    """Issue 75's fairness check, per link: torchft's DiLoCo against dipaco's on the same work, round by round (the
    same steps), against ``diloco_uniform`` (the same averaging) and ``diloco`` (dipaco's default, token-weighted);
    torchft's DDP against torch's, evaluation by evaluation. The largest relative difference in validation
    perplexity."""
    by = {r["name"]: r for r in results.rows}
    out = []
    for name, peer in sorted(by.items()):
        row, _, prof = name.partition("@")
        for mine in FAIR_PAIRS.get(row, ()):
            r = by.get(f"{mine}@{prof}")
            if r is None:
                continue
            pairs = list(zip((p for _, p in r["curve"]), (p for _, p in peer["curve"])))
            diffs = [abs(theirs / ours - 1) for ours, theirs in pairs]
            out.append({"profile": prof, "torchft_row": row, "dipaco_row": mine, "rounds": len(pairs),
                        "max_rel_diff": max(diffs), "final_dipaco": pairs[-1][0], "final_torchft": pairs[-1][1],
                        "within_half_percent": max(diffs) <= 0.005})
    return out


def dipaco_steps_lost(record: Mapping[str, Any], sites: int, inner_steps: int) -> float:
    """Inner steps a dipaco fault row threw away, from where the kill fell: the survivors finish the round in flight
    before its collective fails, the killed site had done ``into_round`` of it, and every round after the checkpoint
    the restart continued from is run again. The late joiner's restart continues from the step checkpoint its
    SIGTERM wrote (docs/guide.md, "Across machines"), which loses nothing."""
    fault, restarts = record["fault"], record["restarts"]
    first = restarts[0] if restarts else ""
    kept = int(first.removeprefix("round_")) if first.startswith("round_") else 0
    again = fault["round"] - kept  # rounds run again from the checkpoint, the one in flight included
    return inner_steps * ((sites - 1) * again + (again - 1) + min(1.0, fault["into_round"]))


def fault_table(results: Results, profiles: list[str], sites: int, inner_steps: int) -> list[dict[str, Any]]:
    """Each fault row against its uninterrupted row on the same link: the wall time lost (the site's time down
    included), the steps lost, and the final perplexity of both."""
    by = {r["name"]: r for r in results.rows}
    table = []
    for row, clean_row in FAULTS.items():
        for prof in ["unshaped", *profiles]:
            r, clean = by.get(f"{row}@{prof}"), by.get(f"{clean_row}@{prof}")
            if r is None or clean is None:
                continue
            torchft = row.startswith("torchft")
            lost = r["steps_lost"] if torchft else dipaco_steps_lost(r, sites, inner_steps)
            final, clean_final = r["curve"][-1][1], clean["curve"][-1][1]
            table.append({"row": row, "profile": prof, "wall_clean": clean["wall_seconds"],
                          "wall_fault": r["wall_seconds"], "wall_lost": r["wall_seconds"] - clean["wall_seconds"],
                          "down_seconds": r["fault"]["down_seconds"], "kill_round": r["fault"]["round"],
                          "into_round": r["fault"]["into_round"], "steps_lost": lost,
                          "steps_lost_measured": torchft, "steps_missing": r.get("steps_missing", 0),
                          "final_ppl": final, "clean_final_ppl": clean_final, "final_rel_diff": final / clean_final - 1})
    return table


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
    ("link", "profile"), ("torchft", "torchft_row"), ("against", "dipaco_row"), ("evaluations", "rounds"),
    ("largest difference", lambda f: f"{100 * f['max_rel_diff']:.3f}%"),
    ("final ppl torchft / other", lambda f: f"{f['final_torchft']:.3f} / {f['final_dipaco']:.3f}"),
    ("within 0.5%", "within_half_percent"),
]


FAULT_TABLE: list[Column] = [
    ("row", "row"), ("link", "profile"),
    ("wall s, uninterrupted / killed", lambda f: f"{f['wall_clean']:.1f} / {f['wall_fault']:.1f}"),
    ("wall s lost (down s included)", lambda f: f"{f['wall_lost']:.1f} ({f['down_seconds']:g})"),
    ("inner steps lost", lambda f: f"{f['steps_lost']:.0f}" + ("" if f["steps_lost_measured"] else " (from the kill time)")),
    ("steps never run", lambda f: f"{f['steps_missing']:.0f}"),
    ("final ppl, uninterrupted / killed", lambda f: f"{f['clean_final_ppl']:.2f} / {f['final_ppl']:.2f} "
                                                      f"({100 * f['final_rel_diff']:+.3f}%)"),
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
    if any(r in FAULTS for r in rows) and not 1 < args.kill_round < args.rounds:
        raise SystemExit(f"--kill-round {args.kill_round}: a fault needs a round before it and one after it "
                         f"(2 to {args.rounds - 1} with --rounds {args.rounds})")
    work = Path(args.work)
    peers = {"torchft": torchft_version()} if any(r.startswith("torchft") for r in rows) else {}
    cfg_file = prepare(args, work)
    results = Results.load(args.out or work / "results.json", "sites", args.resume)
    netem = netem_available()
    results.meta = {"meta": {"command": command_line("sites", argv), "machine": environment("cpu"),
                             "netem": netem, "sites": args.sites, "peers": peers,
                             "links": {name: link.describe(netem) for name, link in links.items()}}}
    settings = {k: v for k, v in vars(args).items()
                if k not in ("out", "resume", "profiles", "rows", "target_fraction", "row_timeout", "kill_round",
                             "down_seconds")}
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
                print(f"[sites] {row} @ {prof}: {record['wall_seconds']:.1f}s wall, final ppl "
                      f"{record['curve'][-1][1]:.2f}, {record['bytes_per_site'] / 1e6:.1f} MB per site", flush=True)
    table = summarize(results, profiles, rows, args.target_fraction)
    results.meta["table"] = table
    results.meta["fairness"] = fair = fairness(results)
    results.meta["faults"] = faults = fault_table(results, profiles, args.sites, args.inner_steps)
    results.write()
    print(markdown_table(table, TABLE))
    if fair:
        print(markdown_table(fair, FAIRNESS))
    if args.smoke and (len(fair) < 2 or not all(f["within_half_percent"] for f in fair)):
        print("bench sites --smoke: torchft and dipaco (or torch's DDP) differ by more than 0.5%, or a pair is "
              "missing", file=sys.stderr)
        return 1
    if faults:
        print(markdown_table(faults, FAULT_TABLE))
    return None


if __name__ == "__main__":  # torchrun -m bench.sites --ddp-worker ...: a rank of the DDP baseline
    try:
        sys.exit(main(sys.argv[1:]))
    except SitesUnavailable as exc:
        sys.exit(f"python -m bench sites: {exc}")
