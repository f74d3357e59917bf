"""How often building one rank's experiment climbs back up the package layers (issue 50's "walk").

    python scripts/layer_walk.py                 # a tiny 2x2 run in a temporary directory
    python scripts/layer_walk.py --driver ray    # the same, built for the Ray task scheduler

Every call made inside :func:`dipaco.build.build_trainer` (the composition root) is traced with
``sys.setprofile``. Each function of ``dipaco`` belongs to a layer of the import-linter contract in
pyproject.toml (``dipaco.cli`` on top, ``dipaco.errors`` at the bottom). Two counts:

* *climbs*: calls from a function of a lower layer into a function of a higher one (a component
  reaching back up to the code that built it: a callback, a lambda of the root, a record defined
  above it);
* *the walk*: the layers of the components the root itself calls (from ``dipaco.build``'s own frames,
  into any other module), in order, up to the last path's inner loop; each step from a lower layer
  back up to a higher one is a zig-zag of the build (the model, then the data, then the model again).

The script prints both, and each distinct climbing edge and step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "dipaco"))


def layers() -> list[list[str]]:
    """The layers of the contract, top first; each a list of module prefixes."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]


def layer_of(module: str, table: list[list[str]]) -> int | None:
    for index, prefixes in enumerate(table):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def walk(driver: str) -> dict[str, Any]:
    from tiny import tiny_config, write_corpus_slice

    from dipaco.build import build_trainer
    from dipaco.comm.world import World
    from dipaco.run import Run

    table = layers()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus_slice(Path(tmp) / "corpus.jsonl")
        sync = ["outer.sync=async_nesterov"] if driver == "ray" else []  # the Ray driver runs the asynchronous sync
        cfg = tiny_config(Path(tmp) / "run", corpus, f"train.driver={driver}", *sync, "run.progress=false")
        Run(cfg).prepare()
        Run(cfg).pretrain()
        stack: list[Any] = []
        calls, climbs, steps = 0, Counter(), Counter()
        walk: list[tuple[int, str]] = []  # (layer, callee) of each call the root makes, up to the last inner loop
        loops_left = [4]  # this rank's paths: the walk ends once their inner loops are built

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            if event == "call":
                module = frame.f_globals.get("__name__", "")
                layer = layer_of(module, table) if module.startswith("dipaco") else None
                caller = next((x for x in reversed(stack) if x is not None), None)
                if layer is not None:
                    calls += 1
                    if caller is not None and layer < caller[0]:  # a smaller index is a higher layer
                        climbs[f"{caller[1]} -> {module}.{frame.f_code.co_name}"] += 1
                    if (caller is not None and caller[1].startswith("dipaco.build.") and module != "dipaco.build"
                            and loops_left[0] > 0):
                        walk.append((layer, f"{module}.{frame.f_code.co_name}"))
                    if frame.f_code.co_name == "__init__" and module == "dipaco.paths.inner":
                        loops_left[0] -= 1
                stack.append(None if layer is None else (layer, f"{module}.{frame.f_code.co_name}"))
            elif event == "return" and stack:
                stack.pop()

        world = World(device=__import__("torch").device("cpu"))
        sys.setprofile(profile)
        try:
            build_trainer(cfg, world)
        finally:
            sys.setprofile(None)
    for (before, a), (after, b) in zip(walk, walk[1:]):
        if after < before:
            steps[f"{a} -> {b}"] += 1
    return {"driver": driver, "calls": calls, "climbs": sum(climbs.values()), "edges": dict(climbs.most_common()),
            "walk": walk, "walk_calls": len(walk), "walk_climbs": sum(steps.values()), "steps": dict(steps.most_common())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", choices=("torchrun", "ray"), default="torchrun")
    parser.add_argument("--show", action="store_true", help="print the walk, call by call")
    args = parser.parse_args()
    result = walk(args.driver)
    if args.show:
        for layer, callee in result["walk"]:
            print(f"  layer {layer:2d}  {callee}")
    print(f"build_trainer ({result['driver']}): {result['calls']} calls into dipaco, {result['climbs']} climb back up")
    for edge, n in result["edges"].items():
        print(f"  {n:4d}  {edge}")
    print(f"the walk to the inner loops: {result['walk_calls']} calls by the root, {result['walk_climbs']} back up a layer")
    for step, n in result["steps"].items():
        print(f"  {n:4d}  {step}")


if __name__ == "__main__":
    main()
