"""Codec speed: encode + decode time of every outer-gradient codec, and the adaptive rule's cost.

The codecs (:mod:`dipaco.comm.codecs`) run on every sync, and the adaptive rule
(:mod:`dipaco.comm.adaptive`) encodes every candidate after every sync, on the exchange's critical
path. This times both on a vector of --numel fp32 values (one module-sized outer gradient), best of
--repeats, in CPU time of the calling thread (use --threads 1). With --baseline REF the codecs of
another git revision are loaded from ``git show REF:dipaco/comm/codecs.py`` and timed in the same
process, alternating with ours, and their outputs are checked to be bit-identical. ``--baseline
HEAD`` on an unchanged tree is the control: its ratios show the measurement's noise.

    python -m bench codecs --numel 345000 --baseline 9a1b553 --threads 1

Prints a markdown table (a row per codec) and the adaptive rule's times; ``--out`` also writes them as JSON,
with the machine (:func:`bench.harness.environment`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.harness import REPO, Column, argument_parser, command_line, environment, markdown_table, write_json
from dipaco.comm import codecs as ours
from dipaco.comm.adaptive import CANDIDATES, choose

RoundTrip = Callable[[], tuple[Any, torch.Tensor]]


def load_baseline(ref: str) -> ModuleType:
    """dipaco/comm/codecs.py at git revision ``ref``, as a separate module."""
    source = subprocess.run(["git", "show", f"{ref}:dipaco/comm/codecs.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "codecs_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("codecs_baseline", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} (dipaco/comm/codecs.py at {ref})")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Best CPU time of this thread over ``repeats`` calls: with one torch thread (--threads 1) it is the
    work done, which a busy shared machine inflates far less than wall time."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times)


def round_trip(module: ModuleType, name: str, chunk: int, x: torch.Tensor) -> RoundTrip:
    """Encode then decode ``x`` with ``module``'s codec ``name``: the work one sync does per module."""
    codec = module.build_codec(name, chunk)

    def run() -> tuple[Any, torch.Tensor]:
        encoded = codec.encode(x)
        return encoded, codec.decode(encoded.scale, encoded.payload, x.numel())
    return run


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


TABLE: list[Column] = [
    ("codec", "codec"), ("baseline ms", lambda r: _ms(r.get("baseline_ms"))), ("ours ms", lambda r: _ms(r["ours_ms"])),
    ("speedup", lambda r: None if "speedup" not in r else f"{r['speedup']:.2f}"), ("bit-identical", "bit_identical"),
]


def main(argv: list[str] | None = None) -> int:
    """Times every codec (and the baseline's, with --baseline) and the adaptive rule; prints the table."""
    argv = sys.argv[1:] if argv is None else argv
    p = argument_parser("codecs", __doc__)
    p.add_argument("--numel", type=int, default=345_000, help="values per vector (one module's outer gradient)")
    p.add_argument("--chunk", type=int, default=1024, help="dist.chunk_size")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", help="git revision whose codecs to time alongside (same process)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    base = load_baseline(args.baseline) if args.baseline else None
    rows = []
    for name in ("bf16", "int8", "int4", "fp4"):
        mine = round_trip(ours, name, args.chunk, x)
        row: dict[str, Any] = {"codec": name}
        if base is not None:
            theirs = round_trip(base, name, args.chunk, x)
            (a, da), (b, db) = mine(), theirs()
            row["bit_identical"] = (torch.equal(a.payload, b.payload) and torch.equal(a.scale, b.scale)
                                    and torch.equal(da.view(torch.int32), db.view(torch.int32)))
            t_base: list[float] = []
            t_ours: list[float] = []
            for i in range(args.repeats):  # alternate (and swap who goes first), so load changes hit both alike
                pair = [(t_base, theirs), (t_ours, mine)]
                for times, fn in (pair if i % 2 == 0 else pair[::-1]):
                    times.append(best_seconds(fn, 1))
            row.update(baseline_ms=1e3 * min(t_base), ours_ms=1e3 * min(t_ours), speedup=min(t_base) / min(t_ours))
        else:
            row["ours_ms"] = 1e3 * best_seconds(mine, args.repeats)
        rows.append(row)
    codecs = [ours.build_codec(n, args.chunk) for n in CANDIDATES]
    adaptive: dict[str, Any] = {}
    for sample in (0, 64):
        adaptive[f"sample_{sample}_ms"] = 1e3 * best_seconds(
            lambda: choose(codecs, x, 0.12, args.chunk, sample), args.repeats)
    adaptive["same_choice"] = choose(codecs, x, 0.12, args.chunk, 0)[0] == choose(codecs, x, 0.12, args.chunk, 64)[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}, "
          f"{args.numel} values, chunk {args.chunk}, best of {args.repeats}")
    print(markdown_table(rows, TABLE))
    print(f"adaptive rule (every candidate encoded): whole module {adaptive['sample_0_ms']:.1f} ms, "
          f"64 chunks {adaptive['sample_64_ms']:.1f} ms, same choice: {adaptive['same_choice']}")
    result = {"numel": args.numel, "chunk": args.chunk, "threads": torch.get_num_threads(), "rows": rows,
              "adaptive": adaptive, "loadavg": os.getloadavg(), "environment": environment("cpu"),
              "command": command_line("codecs", argv)}
    if args.out:
        write_json(args.out, result)
    return 0
