"""Compare two checkpoints tensor by tensor: are two runs bit-identical?

    python scripts/compare_checkpoints.py RUN_A/train/NAME/checkpoints/round_000003 RUN_B/...
    python scripts/compare_checkpoints.py --experiments RUN_A RUN_B one tr2_int8 ...

Every ``.safetensors`` file of the checkpoint (the bank, the outer state, each path's parameters, per
rank) and every tensor in its ``.pt`` state files (AdamW moments, RNG) is compared by relative path and
name with ``torch.equal``. ``--experiments`` compares the newest checkpoint of each named experiment of
two run directories. Prints one line per checkpoint and exits 1 when any tensor differs or is missing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


def checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    """relative file path + tensor name -> tensor, for every tensor file of a checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(root.rglob("*.safetensors")):
        for name, value in load_file(str(path)).items():
            out[f"{path.relative_to(root)}:{name}"] = value
    for path in sorted(root.rglob("*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        for name, value in _tensors(state):
            out[f"{path.relative_to(root)}:{name}"] = value
    return out


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two checkpoints, as lines (empty: bit-identical)."""
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    problems = [f"only in {a}: {k}" for k in sorted(set(ta) - set(tb))]
    problems += [f"only in {b}: {k}" for k in sorted(set(tb) - set(ta))]
    for key in sorted(set(ta) & set(tb)):
        x, y = ta[key], tb[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
            problems.append(f"{key}: differs (max abs difference {diff:.3g})")
    return problems


def newest_checkpoint(run: Path, name: str) -> Path:
    found = sorted((run / "train" / name / "checkpoints").glob("round_*"))
    if not found:
        raise SystemExit(f"no checkpoint under {run / 'train' / name}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("names", nargs="*", help="with --experiments: experiment names")
    parser.add_argument("--experiments", action="store_true", help="A and B are run directories")
    parser.add_argument("--ignore", action="append", default=[], metavar="SUBSTRING",
                        help="leave out tensors whose key contains this (e.g. trainer_state.pt)")
    args = parser.parse_args(argv)
    pairs = ([(newest_checkpoint(args.a, n), newest_checkpoint(args.b, n)) for n in args.names]
             if args.experiments else [(args.a, args.b)])
    failed = False
    for a, b in pairs:
        problems = [p for p in compare(a, b) if not any(s in p for s in args.ignore)]
        count = len(checkpoint_tensors(a))
        label = f"{a.parent.parent.name}/{a.name}" if args.experiments else str(a)
        print(f"{label}: " + ("identical" if not problems else f"{len(problems)} differences")
              + f" ({count} tensors)")
        for line in problems[:20]:
            print(f"  {line}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
