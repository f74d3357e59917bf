"""scripts/bench_comm.py: row names, with the overrides a ROW@key=value name adds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_comm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_comm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_row_name_adds_its_overrides_after_the_row_s_own(bench):
    assert bench.row_overrides("delayed_eager_int8") == bench.ROWS["delayed_eager_int8"]
    assert bench.row_overrides("delayed_eager_int8@outer.delayed.momentum=0.5@outer.delayed.lr=1.0") == [
        *bench.ROWS["delayed_eager_int8"], "outer.delayed.momentum=0.5", "outer.delayed.lr=1.0"]
    with pytest.raises(KeyError):
        bench.row_overrides("no_such_row@outer.lr=1")


def test_every_row_loads_as_a_valid_config(bench):
    from dipaco.config import load_config

    for name in bench.ROWS:
        load_config(None, ["train.inner_steps=96", *bench.row_overrides(name)])  # run 3's H
