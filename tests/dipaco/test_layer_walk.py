"""Building one rank's experiment never climbs back up the package layers (issue 50's "walk").

Every call made inside :func:`dipaco.build.build_trainer` (the composition root) is traced with
``sys.setprofile``. Each function of ``dipaco`` belongs to a layer of the import-linter contract in
pyproject.toml (``dipaco.cli`` on top, ``dipaco.errors`` at the bottom). Two counts:

* *climbs*: calls from a function of a lower layer into a function of a higher one (a component reaching
  back up to the code that built it: a callback, a lambda of the root, a record defined above it): none;
* *the walk*: the layers of the components the root itself calls (from ``dipaco.build``'s own frames, into
  any other module), in order, up to the last path's inner loop; each step from a lower layer back up to a
  higher one is a zig-zag of the build (the model, then the data, then the model again): at most 10.

``pytest tests/dipaco/test_layer_walk.py -s`` prints each climbing edge and zig-zag.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

from dipaco.build import build_trainer
from dipaco.comm.world import World
from dipaco.run import apply_overrides

REPO = Path(__file__).resolve().parents[2]


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


class Tracer:
    """A ``sys.setprofile`` hook: the climbs, and the root's walk until ``paths`` inner loops are built."""

    def __init__(self, paths: int) -> None:
        self.table, self.loops_left = layers(), paths
        self.stack: list[tuple[int, str] | None] = []
        self.calls, self.climbs = 0, Counter[str]()
        self.walk: list[tuple[int, str]] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "return" and self.stack:
            self.stack.pop()
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        layer = layer_of(module, self.table) if module.startswith("dipaco") else None
        callee = f"{module}.{frame.f_code.co_name}"
        caller = next((x for x in reversed(self.stack) if x is not None), None)
        if layer is not None:
            self.calls += 1
            if caller is not None and layer < caller[0]:  # a smaller index is a higher layer
                self.climbs[f"{caller[1]} -> {callee}"] += 1
            if caller is not None and caller[1].startswith("dipaco.build.") and module != "dipaco.build" \
                    and self.loops_left > 0:
                self.walk.append((layer, callee))
            if frame.f_code.co_name == "__init__" and module == "dipaco.paths.inner":
                self.loops_left -= 1
        self.stack.append(None if layer is None else (layer, callee))

    def zigzags(self) -> Counter[str]:
        return Counter(f"{a} -> {b}" for (before, a), (after, b) in zip(self.walk, self.walk[1:]) if after < before)


@pytest.mark.slow  # it builds a trainer on the tiny prepared run
@pytest.mark.parametrize("driver", ["torchrun", "ray"])
def test_the_walk_from_build_trainer_to_the_inner_loops(run_cfg, driver):
    # the Ray driver failed with a ConfigError (its tiny config kept outer.sync=diloco) until this test
    sync = ["outer.sync=async_nesterov"] if driver == "ray" else []  # the Ray driver runs the asynchronous sync
    cfg = apply_overrides(run_cfg, [f"train.driver={driver}", *sync])
    tracer = Tracer(paths=4)
    sys.setprofile(tracer)
    try:
        build_trainer(cfg, World(device=torch.device("cpu")))
    finally:
        sys.setprofile(None)
    zigzags = tracer.zigzags()
    print(f"build_trainer ({driver}): {tracer.calls} calls into dipaco, {sum(tracer.climbs.values())} climb back up; "
          f"the walk to the inner loops: {len(tracer.walk)} calls by the root, {sum(zigzags.values())} back up a layer")
    for edge, n in [*tracer.climbs.most_common(), *zigzags.most_common()]:
        print(f"  {n:4d}  {edge}")
    assert tracer.calls > 100 and not tracer.climbs
    assert len(tracer.walk) > 10 and sum(zigzags.values()) <= 10
