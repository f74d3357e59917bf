"""scripts/bench_comm.py: row names, with the overrides a ROW@key=value name adds."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_comm")


def test_a_row_name_adds_its_overrides_after_the_row_s_own(bench):
    assert bench.row_overrides("delayed_eager_int8") == bench.ROWS["delayed_eager_int8"]
    assert bench.row_overrides("delayed_eager_int8@outer.delayed.momentum=0.5@outer.delayed.lr=1.0") == [
        *bench.ROWS["delayed_eager_int8"], "outer.delayed.momentum=0.5", "outer.delayed.lr=1.0"]
    with pytest.raises(KeyError):
        bench.row_overrides("no_such_row@outer.lr=1")


def test_every_row_loads_as_a_valid_config(bench):
    from dipaco.run import load_config

    for name in bench.ROWS:
        load_config(None, ["train.inner_steps=96", *bench.row_overrides(name)])  # run 3's H
