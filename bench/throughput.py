"""Tokens/s, MFU and peak memory of one DiPaCo path's inner loop against the best hand-written loop.

Both sides run in this process on the same architecture, batch and sequence length, alternating in
timed blocks (A B, B A, A B ...) so that load from other processes hits both alike; the figure is
the median over blocks. A block is ``--steps`` steps, or with ``--min-block-seconds S`` as many steps
(the same for both sides) as the faster side takes S seconds for, measured after the warm-up; a block
that still lasts less than S on either side is run again, longer. After the timed blocks
``--profile-steps`` steps of each side run under ``torch.profiler``: the top 10 ops by self CPU time, on
CUDA also the top 10 kernels by self device time, the device's busy share, kernel launches and the
host-device syncs (``cuda*Synchronize`` calls, ``.item()``-style scalar reads, memcpys).

* **ours**: ``dipaco.paths.inner.InnerLoop`` on a path composed from a ``ModuleBank`` (2x2 grid), fed
  by a ``ShardSampler`` and stepping its LR schedule, exactly as ``dipaco train`` runs it, with
  ``train.precision`` / ``train.compile`` as given.
* **best hand-written**: what a GPU user writes in 30 lines: a ``LlamaForCausalLM`` with SDPA
  attention, autocast at the same precision (bf16 on CUDA), torch's fused AdamW on CUDA (``foreach``
  on CPU), clipping, ``zero_grad(set_to_none=True)``, and ``torch.compile`` whenever ours compiles.
  On CPU at fp32 this is the plain fp32 loop.

MFU counts 6 N + 12 L d T FLOPs per token (N: parameters outside the input embedding, whose
lookup does no matmul; the attention term is PaLM's, counting the full T x T score matrix)
against the GPU's dense bf16 peak; it is not reported on CPU. ``--round`` also times whole rounds
of a 2x2 grid (4 paths: inner steps + outer step + checkpoint) and reports the share that is not
inner steps.

    python -m bench throughput --out docs/results/bench_throughput.json                 # CPU, demo size
    python -m bench throughput --device cuda --sizes demo,125m --compile --round --out ...
    python -m bench throughput --device cuda --sizes 125m --compile --min-block-seconds 2 --blocks 4

``--out`` writes the figures as JSON: ``device``, ``threads`` and ``torch`` at the top (as docs/bench_throughput*.json
hold them), the whole machine record under ``environment`` (:func:`bench.harness.environment`), the ``command``,
every size's figures under ``sizes`` and, with --round, the rounds under ``round``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from unittest import mock

import datasets
import numpy as np
import torch
from transformers import LlamaForCausalLM

from bench.harness import argument_parser, command_line, environment, write_json
from dipaco.checkpoint.spec import ExperimentSpec, ShardingRef, TokenizerRef
from dipaco.checkpoint.state import TrainingState
from dipaco.checkpoint.store import CONFIG, CheckpointManager, write_snapshot
from dipaco.checkpoint.writer import BackgroundWriter
from dipaco.comm.world import World
from dipaco.config import Config, ModelConfig, OptimConfig, to_yaml
from dipaco.data.packing import DocumentTokens, PackedShard
from dipaco.model.bank import ModuleBank
from dipaco.model.llama import build_model, llama_config
from dipaco.model.topology import Topology, topology_from_config
from dipaco.paths.factory import LoopSettings, PathLoops
from dipaco.paths.inner import InnerLoop, InnerOptions, build_adamw
from dipaco.paths.sampler import Sequences, ShardSampler
from dipaco.precision import Precision, resolve_precision
from dipaco.run import apply_overrides
from dipaco.runtime import configure_backends
from dipaco.sync import SyncContext, build_sync
from dipaco.train.experiment import BuiltExperiment
from dipaco.train.rounds import RoundOptions, RoundScheduler


@dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    seq_len: int
    batch: int


SIZES = {
    # the README demo's path until issue 34 shrank it (kept: the figures of docs/notes/2026-11-23-inner-loop-throughput.md use it)
    "demo": Size(layers=4, hidden=128, intermediate=384, heads=4, vocab=4096, seq_len=128, batch=16),
    # a GPT-2-small-class path: 134M parameters with a 32k vocabulary
    "125m": Size(layers=12, hidden=768, intermediate=2048, heads=12, vocab=32000, seq_len=1024, batch=16),
}
# Dense bf16 tensor-core peaks (FLOP/s), by device name.
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}
# ours/best, by compile (issue 48: at least 0.97 compiled).
RATIO_TARGET = {False: 0.95, True: 0.97}
BLOCK_MARGIN = 1.15  # steps per block: this much over min_block_seconds at the faster side's measured step time
BLOCK_RERUNS = 3  # at most this many blocks run again, longer, because one side's lasted less than the minimum
# Profiler rows of host-device syncs on CUDA: the runtime's waits. The scalar reads behind .item() / float() /
# bool() of a tensor are counted apart: a sync when the tensor is on CUDA, none for a CPU tensor (on CPU they are
# mostly the foreach AdamW's step counters).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SCALAR_READ = "aten::_local_scalar_dense"
NAME_CHARS = 160  # kernel names (templates) are cut to this many characters


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags of ``python -m bench throughput``."""
    p = argument_parser("throughput", __doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes", default="demo", help=f"comma-separated: {', '.join(SIZES)}")
    p.add_argument("--precision", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16")
    p.add_argument("--compile", action="store_true", help="torch.compile both sides")
    p.add_argument("--batch", type=int, help="override the size's batch")
    p.add_argument("--steps", type=int, default=8,
                   help="steps per timed block (with --min-block-seconds: the least, and the first calibration run)")
    p.add_argument("--min-block-seconds", type=float, default=0.0,
                   help="make each timed block last at least this long: steps per block calibrated after the "
                        "warm-up, the same for both sides (0: --steps steps per block)")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per side, interleaved")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side first (compilation happens here)")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="after the timed blocks, profile this many steps of each side with torch.profiler (0: none)")
    p.add_argument("--round", action="store_true", help="also time whole rounds of a 2x2 grid (4 paths)")
    p.add_argument("--round-inner-steps", type=int, default=100)
    p.add_argument("--sync-checkpoint", action="store_true",
                   help="--round: write each checkpoint synchronously (train.checkpoint_background=false)")
    p.add_argument("--round-size", default=None, help="size for --round (default: the last of --sizes)")
    p.add_argument("--data", choices=("disk", "memory"), default="disk",
                   help="ours reads its rows from memory-mapped prepared data as `dipaco train` does (disk), or "
                        "from an in-memory tensor (memory, the only way before issue 33)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args(argv)


def disk_rows(tokens: torch.Tensor, eos_id: int, tmp: Path) -> PackedShard:
    """``tokens``' rows as a PackedShard over a memory-mapped Arrow dataset, one document per row of
    seq_len - 1 tokens (its EOS completes the row), the layout `dipaco prepare` writes."""
    n, seq_len = tokens.shape
    docs = tokens[:, : seq_len - 1].numpy().astype(np.uint16 if int(tokens.max()) < 1 << 16 else np.uint32)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(str(docs.dtype)))})
    ds = datasets.Dataset.from_dict({"input_ids": list(docs)}, features=features)
    ds.save_to_disk(str(tmp / "data"))
    return PackedShard(DocumentTokens(datasets.load_from_disk(str(tmp / "data"))), np.arange(n), seq_len, eos_id)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def compile_backend(name: str) -> Iterator[None]:
    """``torch.compile`` calls made inside (by InnerLoop and the hand-written loop) use backend ``name``.

    The GPU check's CPU dry run and the device tests on CPU use ``eager``: dynamo traces, guards and counts
    recompiles exactly as with inductor, without inductor's C++ code generation (30-45 s a model on 2 cores)."""
    if name == "inductor":
        yield
        return
    with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=name)):
        yield


class BestLoop:
    """The strongest loop a user would write by hand: one model, fused AdamW, autocast, compile."""

    def __init__(self, model: LlamaForCausalLM, data: torch.Tensor, cfg: OptimConfig, precision: Precision,
                 compile: bool) -> None:
        self.model, self.data, self.cfg, self.precision = model, data, cfg, precision
        self.forward = torch.compile(model) if compile else model
        self.optimizer = build_adamw(model, cfg)  # fused on CUDA, foreach on CPU: torch's fastest
        self.scaler = precision.grad_scaler()
        self.i = 0

    def run(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            batch = self.data[self.i % self.data.shape[0]]
            self.i += 1
            with self.precision.autocast():
                loss = self.forward(input_ids=batch, labels=batch).loss
            if self.scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                self.optimizer.step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # wait for the device


def flops_per_token(model: LlamaForCausalLM, size: Size) -> float:
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * n + 12 * size.layers * size.hidden * size.seq_len


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def model_config(size: Size) -> ModelConfig:
    return ModelConfig(num_layers=size.layers, hidden_size=size.hidden, intermediate_size=size.intermediate,
                       num_heads=size.heads)


def calibrate(sides: dict, device: torch.device, first_steps: int, min_block_s: float) -> dict[str, float]:
    """Seconds per step of each side, after the warm-up: ``first_steps`` steps, doubled until the side has run
    for a quarter of ``min_block_s`` (at most 0.5 s)."""
    least = min(min_block_s / 4, 0.5)
    per_step = {}
    for side, run in sides.items():
        n, seconds, steps = max(first_steps, 1), 0.0, 0
        while True:
            seconds += timed(device, lambda: run(n))
            steps += n
            if seconds >= least:
                break
            n = steps  # doubles what ran so far
        per_step[side] = seconds / steps
    return per_step


def _row(name: str, calls: int, us: float, total_us: float) -> dict:
    return {"name": name[:NAME_CHARS], "calls": int(calls), "self_us": round(float(us), 1),
            "share": round(float(us) / total_us, 4) if total_us > 0 else None}


def profile_side(device: torch.device, run, steps: int, top: int = 10) -> dict:
    """``steps`` steps of one side under torch.profiler (CPU activity; CUDA's too on CUDA): the top ops by self
    CPU time, on CUDA the top kernels (and memcpys, memsets) by self device time, the device's busy share of
    the profiled wall time, kernel launches and host-device syncs. Each side's ``run`` ends with a sync of
    its own (``.item()`` of the loss; ours also ``.tolist()`` of its loss windows): one per call, not per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run(steps)  # ends with a scalar read, so the device is done (no sync of ours in the counts)
        wall = time.perf_counter() - start
    rows = prof.key_averages()
    host = [e for e in rows if e.device_type == DeviceType.CPU]
    kernels = [e for e in rows if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    host_us = sum(e.self_cpu_time_total for e in host)
    device_us = sum(e.self_device_time_total for e in kernels)
    top_host = [_row(e.key, e.count, e.self_cpu_time_total, host_us)
                for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]]
    top_device = [_row(e.key, e.count, e.self_device_time_total, device_us)
                  for e in sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:top]]
    calls = {e.key: int(e.count) for e in host}
    return {
        "steps": steps, "wall_s": wall,
        "top10_by": "self device time" if on_cuda else "self CPU time",
        "top10": top_device if on_cuda else top_host,
        "top10_host": top_host if on_cuda else None,  # on CPU the same list as top10
        "host_op_s": host_us / 1e6,
        "device_s": device_us / 1e6 if on_cuda else None,
        "device_busy": device_us / 1e6 / wall if on_cuda and wall > 0 else None,
        "kernel_launches": sum(n for k, n in calls.items() if k.startswith(("cudaLaunch", "cuLaunch")))
        if on_cuda else None,
        "host_syncs": sum(calls.get(k, 0) for k in SYNC_CALLS) if on_cuda else None,
        "sync_calls": {k: calls.get(k, 0) for k in SYNC_CALLS} if on_cuda else None,
        "scalar_reads": calls.get(SCALAR_READ, 0),
        "memcpys": {e.key: int(e.count) for e in kernels if e.key.startswith("Memcpy")} if on_cuda else None,
    }


def profile_sides(sides: dict, device: torch.device, steps: int) -> dict:
    """:func:`profile_side` for each side; an error (a profiler the build lacks) is recorded, not raised."""
    out: dict = {"steps": steps, "activities": ["cpu", *(["cuda"] if device.type == "cuda" else [])], "sides": {}}
    for side, run in sides.items():
        try:
            out["sides"][side] = profile_side(device, run, steps)
        except Exception as exc:  # the timed figures stand without it
            out["sides"][side] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def run_blocks(sides: dict, device: torch.device, blocks: int, steps: int, min_block_s: float) -> dict:
    """``blocks`` timed blocks per side, interleaved (A B, B A, ...), ``steps`` steps each, the same on both
    sides. A block in which either side ran for less than ``min_block_s`` runs again with proportionally
    more steps (those steps for every later block too), at most BLOCK_RERUNS times."""
    order = list(sides)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    steps_per_block: list[int] = []
    reruns = 0
    while len(steps_per_block) < blocks:
        first = order if len(steps_per_block) % 2 == 0 else order[::-1]  # alternate who goes first
        took = {side: timed(device, lambda: sides[side](steps)) for side in first}
        shortest = min(took.values())
        if shortest < min_block_s and reruns < BLOCK_RERUNS:
            reruns += 1
            steps = max(steps + 1, math.ceil(steps * BLOCK_MARGIN * min_block_s / shortest))
            continue
        for side in order:
            seconds[side].append(took[side])
        steps_per_block.append(steps)
    return {"seconds": seconds, "steps_per_block": steps_per_block, "reruns": reruns}


def bench_size(name: str, size: Size, args, device: torch.device, precision: Precision) -> dict:
    """Ours against the best hand-written loop at one size. ``args``: warmup, steps, blocks, compile, data, and
    optionally min_block_seconds (0: ``steps`` steps per block) and profile_steps (0: no profile)."""
    min_block_s = float(getattr(args, "min_block_seconds", 0.0) or 0.0)
    profile_steps = int(getattr(args, "profile_steps", 0) or 0)
    llama = llama_config(model_config(size), size.vocab, size.seq_len, eos_id=0, pad_id=1)
    optim = OptimConfig(lr=1e-4, warmup_steps=10, batch_size=size.batch)
    # The rows both sides cycle through; a calibrated block may run more steps than there are batches.
    total_steps = args.warmup + args.steps * args.blocks
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, size.vocab, (total_steps * size.batch, size.seq_len), generator=gen)

    topology = topology_from_config(replace(Config().topology, preset="grid:2x2"), size.layers)
    bank = ModuleBank(topology, build_model(llama, seed=0, device=device))
    options = InnerOptions(precision, compile=args.compile)
    data = args.data
    tmp = tempfile.TemporaryDirectory(prefix="bench-throughput-")
    rows: Sequences = disk_rows(tokens, 0, Path(tmp.name)) if data == "disk" else tokens
    ours = InnerLoop(bank.compose(3, build_model(llama, device=device)), ShardSampler(rows, size.batch, seed=0),
                     optim, total_steps, device, options)
    best = BestLoop(build_model(llama, seed=0, device=device), tokens.to(device).view(-1, size.batch, size.seq_len),
                    optim, precision, args.compile)
    del bank

    sides = {"dipaco_path": lambda n: ours.run(n), "best_handwritten": lambda n: best.run(n)}
    memory, warmup_s = {}, {}
    for side, run in sides.items():  # warm-up: allocator, kernels, compilation (timed: the compile cost)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        warmup_s[side] = timed(device, lambda: run(args.warmup))
        if device.type == "cuda":
            memory[side] = torch.cuda.max_memory_allocated(device) / 2**30
    calibration = None
    steps = args.steps
    if min_block_s > 0:
        step_s = calibrate(sides, device, args.steps, min_block_s)
        steps = max(args.steps, math.ceil(BLOCK_MARGIN * min_block_s / min(step_s.values())))
        calibration = {"step_s": step_s, "steps_per_block": steps, "margin": BLOCK_MARGIN}
    timing = run_blocks(sides, device, args.blocks, steps, min_block_s)
    tokens_per_step = size.batch * size.seq_len
    rates = {side: [n * tokens_per_step / s for n, s in zip(timing["steps_per_block"], secs)]
             for side, secs in timing["seconds"].items()}
    profiled = profile_sides(sides, device, profile_steps) if profile_steps > 0 else None

    median = {k: statistics.median(v) for k, v in rates.items()}
    step_s = {k: tokens_per_step / v for k, v in median.items()}
    fpt = flops_per_token(ours.model, size)
    peak = peak_flops(device)
    result = {
        "size": name, "params": sum(p.numel() for p in ours.model.parameters()), **size.__dict__,
        "precision": precision.name, "compile": args.compile, "data": data,
        "tokens_per_s_median": median, "tokens_per_s_blocks": rates,
        "ratio": median["dipaco_path"] / median["best_handwritten"],
        # how the blocks were timed: steps per block (both sides alike), each side's seconds per block
        "min_block_seconds": min_block_s, "steps_per_block": timing["steps_per_block"],
        "block_seconds": timing["seconds"], "block_reruns": timing["reruns"], "calibration": calibration,
        "flops_per_token": fpt,
        "mfu": {k: v * fpt / peak for k, v in median.items()} if peak else None,
        "peak_memory_gib": memory or None,
        # the warm-up minus as many steady steps: compilation and first-call costs
        "first_steps_overhead_s": {k: warmup_s[k] - args.warmup * step_s[k] for k in sides},
        "profile": profiled,
    }
    shortest = min(min(v) for v in timing["seconds"].values())
    blocks = sorted(set(timing["steps_per_block"]))
    print(f"[{name}] {result['params']:,} params, batch {size.batch} x seq {size.seq_len}, {precision.name}"
          f"{', compiled' if args.compile else ''}, {args.blocks} blocks of {'/'.join(map(str, blocks))} steps "
          f"(shortest {shortest:.2f} s{f', at least {min_block_s:g} s asked' if min_block_s else ''}), ours reads "
          f"its rows from {'memory-mapped data' if data == 'disk' else 'memory'}")
    for side in sides:
        mfu = f", MFU {result['mfu'][side]:.1%}" if peak else ""
        mem = f", peak {memory[side]:.2f} GiB" if memory else ""
        print(f"  {side:<17} {median[side]:>12,.0f} tokens/s{mfu}{mem}; first {args.warmup} steps "
              f"+{result['first_steps_overhead_s'][side]:.1f}s")
        if profiled is not None:
            print(f"    profile: {profile_line(profiled['sides'][side])}")
    print(f"  ratio ours/best = {result['ratio']:.3f} (target >= {RATIO_TARGET[bool(args.compile)]})")
    return result


def profile_line(p: dict) -> str:
    """One side's profile in a line: its top 3 rows, and on CUDA the device's busy share, launches and syncs."""
    if "error" in p:
        return f"failed: {p['error']}"
    top = ", ".join(f"{r['name'][:40]} {r['self_us'] / 1e3:.1f} ms" for r in p["top10"][:3])
    cuda = (f"; device busy {p['device_busy']:.0%}, {p['kernel_launches'] / p['steps']:.0f} launches/step, "
            f"{p['host_syncs']} syncs" if p["device_busy"] is not None else "")
    return f"{p['steps']} steps, by {p['top10_by']}: {top}{cuda}; {p['scalar_reads']} scalar reads"


@dataclass
class Grid:
    """A 2x2 grid's training components in one process, built as ``dipaco train`` builds them (one rank)."""

    cfg: Config
    topology: Topology
    world: World
    bank: ModuleBank
    loops: dict[int, InnerLoop]
    scheduler: RoundScheduler
    state: TrainingState

    def save_checkpoint(self, checkpoints: CheckpointManager, index: int, reports: list[dict],
                        writer: BackgroundWriter | None = None) -> None:
        """Checkpoint ``index`` in the trainer's format (bank, outer state, every path's inner loop); with a
        ``writer``, as the trainer does by default: wait for the write in flight, copy, write in the background."""
        snapshot = self.state.snapshot(index, reports, {}, {CONFIG: to_yaml(self.cfg)})
        if writer is None:
            checkpoints.save(index, lambda d: write_snapshot(d, 0, snapshot, index), self.world)
            return
        writer.wait()
        writer.submit(index, snapshot, lambda copy: lambda d: write_snapshot(d, 0, copy, index))


def build_grid(size: Size, device: torch.device, precision: Precision, compile: bool, inner_steps: int,
               rounds: int = 3, extra: Sequence[str] = ()) -> Grid:
    """The round benchmark's 2x2 grid: 4 paths on random tokens, DiLoCo per module; ``extra``: more
    ``key=value`` overrides (e.g. ``train.offload_inactive=true``). Seeded: two calls build the same grid."""
    overrides = [
        "topology.preset=grid:2x2", f"model.num_layers={size.layers}", f"model.hidden_size={size.hidden}",
        f"model.intermediate_size={size.intermediate}", f"model.num_heads={size.heads}",
        f"data.seq_len={size.seq_len}", f"train.optim.batch_size={size.batch}", f"train.rounds={rounds}",
        f"train.inner_steps={inner_steps}", f"train.precision={precision.name}",
        f"train.compile={str(compile).lower()}", "run.progress=false", "train.init=random", *extra,
    ]
    cfg = apply_overrides(Config(), overrides)
    llama = llama_config(cfg.model, size.vocab, size.seq_len, eos_id=0, pad_id=1)
    topology = topology_from_config(cfg.topology, size.layers)
    world = World(device=device)
    bank = ModuleBank(topology, build_model(llama, seed=0, device=device))
    steps = cfg.train.rounds * cfg.train.inner_steps
    gen = torch.Generator().manual_seed(1)
    shards = {p: torch.randint(0, size.vocab, (256, size.seq_len), generator=gen) for p in range(topology.num_paths)}
    path_loops = PathLoops(shards, LoopSettings.from_config(cfg.train, cfg.model, steps, "train"), seed=0)
    loops = {p: path_loops.build(p, bank.compose(p, build_model(llama, device=device)), device) for p in shards}
    weights = {p: 1.0 / topology.num_paths for p in loops}
    by_rank = [tuple(loops)]
    spec = ExperimentSpec(name="bench_round", model=asdict(cfg.model), topology=topology.to_dict(),
                          tokenizer=TokenizerRef("tokenizer", size.vocab, eos_token_id=0, pad_token_id=1),
                          seq_len=size.seq_len, prefix_tokens=0, sharding=ShardingRef("iid", "", 0, None),
                          precision={"train": precision.name})
    experiment = BuiltExperiment(spec, to_yaml(cfg), Path("."), Path("."), cfg.train.rounds, cfg.train.inner_steps,
                                 topology, world, by_rank, weights, bank, path_loops, lambda: path_loops, loops)
    sync_ = build_sync(SyncContext(cfg.outer, cfg.dist, cfg.train.inner_steps, cfg.train.rounds, cfg.run.seed,
                                   topology, bank, weights, by_rank, world))
    scheduler = RoundScheduler(experiment, sync_, RoundOptions(progress=False))
    state = TrainingState(bank, frozenset(bank.module_name(m) for m in bank.held), loops, sync_, scheduler, 0, by_rank)
    return Grid(cfg, topology, world, bank, loops, scheduler, state)


def bench_round(size: Size, args, device: torch.device, precision: Precision) -> dict:
    """Whole rounds of a 2x2 grid in one process: 4 paths' inner steps, the outer step, a checkpoint."""
    grid = build_grid(size, device, precision, args.compile, args.round_inner_steps)
    cfg = grid.cfg
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = CheckpointManager(Path(tmp) / "checkpoints", keep=1)
        writer = None if args.sync_checkpoint else BackgroundWriter(checkpoints)
        rounds = []
        for r in range(cfg.train.rounds):
            start = time.perf_counter()
            report = grid.scheduler.run_round(r)
            sync(device)
            ckpt_s = timed(device, lambda: grid.save_checkpoint(checkpoints, r + 1, [report], writer))
            total = time.perf_counter() - start
            inner = sum(rec["tokens"] / rec["tokens_per_s"] for rec in report["paths"])
            outer = report["comm"]["outer_seconds"]
            rounds.append({"round": r + 1, "seconds": total, "inner_s": inner, "outer_s": outer, "checkpoint_s": ckpt_s,
                           "not_inner_share": 1 - inner / total})
        if writer is not None:
            writer.wait()  # the last write: after the last round, outside its timing
    steady = rounds[1:]  # round 1 includes compilation and allocator warm-up
    share = statistics.median(r["not_inner_share"] for r in steady)
    print(f"[round] 2x2 grid, 4 paths x {cfg.train.inner_steps} inner steps: "
          + "; ".join(f"r{r['round']} {r['seconds']:.2f}s (inner {r['inner_s']:.2f}, outer {r['outer_s']:.3f}, "
                      f"ckpt {r['checkpoint_s']:.2f})" for r in rounds))
    print(f"  not inner steps: {share:.2%} of a round (median of rounds 2..; target <= 5%)")
    return {"inner_steps": cfg.train.inner_steps, "paths": grid.topology.num_paths, "rounds": rounds,
            "not_inner_share_median": share, "checkpoint": "synchronous" if writer is None else "background"}


def main(argv: list[str] | None = None) -> int:
    """Ours against the best hand-written loop at every size of --sizes, and with --round the rounds."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device)
    configure_backends(device, None)  # what `dipaco train` does: TF32 on CUDA, determinism on CPU only
    precision = resolve_precision(args.precision, device, "--precision")
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; known: {', '.join(SIZES)}")
    sizes = {n: replace(SIZES[n], batch=args.batch or SIZES[n].batch) for n in names}
    env = environment(args.device)
    result = {
        "device": env["device"], "threads": env["threads"], "torch": env["torch"],
        "command": command_line("throughput", argv), "environment": env,
        "sizes": [bench_size(n, s, args, device, precision) for n, s in sizes.items()],
    }
    if args.round:
        result["round"] = bench_round(sizes[args.round_size or names[-1]], args, device, precision)
    if args.out:
        write_json(args.out, result, indent=2)
    return 0
