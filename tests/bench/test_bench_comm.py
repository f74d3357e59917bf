"""bench/comm.py: row names, with the overrides a ROW@key=value name adds."""

from __future__ import annotations

import pytest

from bench import comm as bench
from bench.harness import RowSyntaxError


def test_a_row_name_adds_its_overrides_after_the_row_s_own():
    assert bench.row_overrides("delayed_eager_int8") == bench.ROWS["delayed_eager_int8"]
    assert bench.row_overrides("delayed_eager_int8@outer.delayed.momentum=0.5@outer.delayed.lr=1.0") == [
        *bench.ROWS["delayed_eager_int8"], "outer.delayed.momentum=0.5", "outer.delayed.lr=1.0"]
    with pytest.raises(KeyError):
        bench.row_overrides("no_such_row@outer.lr=1")
    with pytest.raises(RowSyntaxError, match="'outer.lr' is not key=value"):
        bench.row_overrides("delayed_eager_int8@outer.lr")


def test_every_row_loads_as_a_valid_config():
    from dipaco.run import load_config

    for name in bench.ROWS:
        load_config(None, ["train.inner_steps=96", *bench.row_overrides(name)])  # run 3's H


def test_a_bad_row_ends_the_run_before_anything_is_prepared(tmp_path):
    with pytest.raises(SystemExit, match=r"--rows: unknown or malformed \['diloco_fp32@outer.lr', 'no_such_row'\]"):
        bench.main(["--work", str(tmp_path / "work"), "--rows", "diloco_fp32@outer.lr,delayed_int8,no_such_row"])
    assert not (tmp_path / "work").exists()
