"""How long a round blocks on its checkpoint: the background writer against the synchronous one (issue 48).

    python -m bench checkpoint --out docs/results/bench_checkpoint.json
    python -m bench checkpoint --smoke          # a small state, for CI

The state is what `dipaco train` checkpoints for one path of the 125M class (hidden 768, 12 layers,
vocab 32,000, 134M parameters): the path's parameters, its AdamW moments and step, the bank's copy of
its modules and their outer momentum, the trainer state; 3.25 GB, written with the trainer's own
``write_snapshot`` and ``CheckpointManager.save`` (temporary directory, sha256 manifest, fsync, rename).
In one process, alternating, ``--repeats`` times each:

* synchronous: the round waits for ``save`` (``train.checkpoint_background=false``);
* background: the round waits for the copy into the reused host buffers (``BackgroundWriter.submit``);
  the write then runs in its thread and is waited for outside the timing, as training would cover it.
  The first submit allocates the buffers and is reported apart.

Both checkpoints of every repeat are compared file by file (the manifests hold every file's sha256).
The target: the background writer blocks for at most 10% of the synchronous write's time.
``--out`` writes the repeats, the medians, the command and the machine (:func:`bench.harness.environment`) as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.harness import argument_parser, command_line, environment, write_json
from dipaco.checkpoint.store import MANIFEST, CheckpointManager, Snapshot, write_snapshot
from dipaco.checkpoint.writer import BackgroundWriter, Write
from dipaco.model.llama import build_model
from dipaco.paths.inner import build_adamw

TARGET = 0.10


def path_state(hidden: int, layers: int, vocab: int) -> tuple[Snapshot, int]:
    """A trainer-shaped snapshot of one path after one AdamW step, and its size in bytes."""
    from transformers import LlamaConfig

    from dipaco.config import OptimConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), max_position_embeddings=128, use_cache=False)
    model = build_model(config, seed=0)
    optimizer = build_adamw(model, OptimConfig())
    ids = torch.randint(0, vocab, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = dict(model.named_parameters())
    bank = {f"level/{k}": v.detach().clone() for k, v in params.items()}
    outer = {k: torch.zeros_like(v) for k, v in bank.items()}
    snapshot = Snapshot(parts={"bank": bank, "outer": outer},
                        state={"round": 1, "rng": {"torch": torch.get_rng_state()}, "scheduler": {}},
                        paths={0: (params, {"optimizer": optimizer.state_dict(), "step": 1})},
                        texts={"config.yaml": "bench: checkpoint\n"})
    tensors = [*bank.values(), *outer.values(), *params.values(),
               *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
    return snapshot, sum(t.numel() * t.element_size() for t in tensors)


def writes(index: int) -> Callable[[Snapshot], Write]:
    """What the background writer runs on its host copy: ``write_snapshot`` of checkpoint ``index``."""
    def write(copy: Snapshot) -> Write:
        return lambda directory: write_snapshot(directory, 0, copy, index)
    return write


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both writers, alternating, ``args.repeats`` times after a first repeat that allocates the buffers."""
    snapshot, nbytes = path_state(args.hidden, args.layers, args.vocab)
    print(f"[bench_checkpoint] state {nbytes / 1e9:.2f} GB; {args.repeats} repeats each", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        sync = CheckpointManager(Path(tmp) / "sync", keep=1)
        writer = BackgroundWriter(CheckpointManager(Path(tmp) / "background", keep=1))
        for repeat in range(args.repeats + 1):  # repeat 0: the buffers are allocated
            index = repeat + 1
            start = time.perf_counter()
            want = sync.save(index, lambda d: write_snapshot(d, 0, snapshot, index))
            sync_s = time.perf_counter() - start
            start = time.perf_counter()
            writer.submit(index, snapshot, writes(index))
            blocked_s = time.perf_counter() - start
            start = time.perf_counter()
            landed = writer.wait()
            write_s = blocked_s + time.perf_counter() - start
            assert landed is not None
            same = (want / MANIFEST).read_text() == (landed[1] / MANIFEST).read_text()
            rows.append({"repeat": repeat, "sync_s": sync_s, "blocked_s": blocked_s, "background_write_s": write_s,
                         "identical_files": same})
            print(f"  repeat {repeat}{' (allocates the buffers)' if repeat == 0 else ''}: synchronous {sync_s:.2f} s, "
                  f"background blocks {blocked_s:.3f} s (write {write_s:.2f} s), identical files: {same}", flush=True)
    steady = rows[1:]
    sync_med = statistics.median(r["sync_s"] for r in steady)
    blocked_med = statistics.median(r["blocked_s"] for r in steady)
    ratio = blocked_med / sync_med
    return {"state_bytes": nbytes, "rows": rows, "sync_median_s": sync_med, "blocked_median_s": blocked_med,
            "first_submit_s": rows[0]["blocked_s"], "ratio": ratio, "target": TARGET,
            "met": ratio <= TARGET and all(r["identical_files"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    """Runs both writers; prints each repeat and the ratio against the target."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argument_parser("checkpoint", __doc__)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default=None, help="where the checkpoints are written (default: the temp dir)")
    parser.add_argument("--smoke", action="store_true", help="a 4-layer d=64 path, one repeat")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.repeats = 64, 2, 512, 1
    result = {**run(args), "environment": environment("cpu"), "command": command_line("checkpoint", argv)}
    print(f"[bench_checkpoint] synchronous {result['sync_median_s']:.2f} s, background blocks "
          f"{result['blocked_median_s']:.3f} s: ratio {result['ratio']:.3f} (target <= {TARGET}); "
          f"{'met' if result['met'] else 'MISSED'}")
    if args.out:
        write_json(args.out, result)
    return 0
