"""Codec speed: encode + decode time of every outer-gradient codec, and the adaptive rule's cost.

The codecs (:mod:`dipaco.comm.codecs`) run on every sync, and the adaptive rule
(:mod:`dipaco.comm.adaptive`) encodes every candidate after every sync, on the exchange's critical
path. This times both on a vector of --numel fp32 values (one module-sized outer gradient), best of
--repeats, in CPU time of the calling thread (use --threads 1). With --baseline REF the codecs of
another git revision are loaded from ``git show REF:dipaco/comm/codecs.py`` and timed in the same
process, alternating with ours, and their outputs are checked to be bit-identical. ``--baseline
HEAD`` on an unchanged tree is the control: its ratios show the measurement's noise.

    python scripts/bench_codecs.py --numel 345000 --baseline 9a1b553 --threads 1
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dipaco import json_text  # noqa: E402
from dipaco.comm import codecs as ours  # noqa: E402
from dipaco.comm.adaptive import CANDIDATES, choose  # noqa: E402


def load_baseline(ref: str):
    """dipaco/comm/codecs.py at git revision ``ref``, as a separate module."""
    source = subprocess.run(["git", "show", f"{ref}:dipaco/comm/codecs.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "codecs_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("codecs_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_seconds(fn, repeats: int) -> float:
    """Best CPU time of this thread over ``repeats`` calls: with one torch thread (--threads 1) it is the
    work done, which a busy shared machine inflates far less than wall time."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times)


def round_trip(module, name: str, chunk: int, x: torch.Tensor):
    codec = module.build_codec(name, chunk)

    def run():
        encoded = codec.encode(x)
        return encoded, codec.decode(encoded.scale, encoded.payload, x.numel())
    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        row = {"codec": name}
        if base is not None:
            theirs = round_trip(base, name, args.chunk, x)
            (a, da), (b, db) = mine(), theirs()
            row["bit_identical"] = (torch.equal(a.payload, b.payload) and torch.equal(a.scale, b.scale)
                                    and torch.equal(da.view(torch.int32), db.view(torch.int32)))
            t_base, t_ours = [], []
            for i in range(args.repeats):  # alternate (and swap who goes first), so load changes hit both alike
                pair = [(t_base, theirs), (t_ours, mine)]
                for times, fn in (pair if i % 2 == 0 else pair[::-1]):
                    times.append(best_seconds(fn, 1))
            row.update(baseline_ms=1e3 * min(t_base), ours_ms=1e3 * min(t_ours), speedup=min(t_base) / min(t_ours))
        else:
            row["ours_ms"] = 1e3 * best_seconds(mine, args.repeats)
        rows.append(row)
    codecs = [ours.build_codec(n, args.chunk) for n in CANDIDATES]
    adaptive = {}
    for sample in (0, 64):
        adaptive[f"sample_{sample}_ms"] = 1e3 * best_seconds(
            lambda: choose(codecs, x, 0.12, args.chunk, sample), args.repeats)
    adaptive["same_choice"] = choose(codecs, x, 0.12, args.chunk, 0)[0] == choose(codecs, x, 0.12, args.chunk, 64)[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}, "
          f"{args.numel} values, chunk {args.chunk}, best of {args.repeats}")
    print(f"{'codec':<6} {'baseline ms':>12} {'ours ms':>9} {'speedup':>8} {'bit-identical':>14}")
    for r in rows:
        print(f"{r['codec']:<6} {r.get('baseline_ms', float('nan')):>12.2f} {r['ours_ms']:>9.2f} "
              f"{r.get('speedup', float('nan')):>8.2f} {str(r.get('bit_identical', '-')):>14}")
    print(f"adaptive rule (every candidate encoded): whole module {adaptive['sample_0_ms']:.1f} ms, "
          f"64 chunks {adaptive['sample_64_ms']:.1f} ms, same choice: {adaptive['same_choice']}")
    result = {"numel": args.numel, "chunk": args.chunk, "threads": torch.get_num_threads(), "rows": rows,
              "adaptive": adaptive, "loadavg": os.getloadavg()}
    if args.out:
        args.out.write_text(json_text.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
