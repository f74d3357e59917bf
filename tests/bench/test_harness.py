"""bench/harness.py and `python -m bench`: resume, strict atomic JSON, the row syntax, the table, the listing."""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

import bench
from bench import __main__ as cli
from bench.harness import (
    Results,
    ResultsFileError,
    RowSyntaxError,
    environment,
    free_port,
    git_commit,
    markdown_table,
    parse_row,
    safe_name,
    settings_key,
    unknown_rows,
    write_json,
)
from dipaco.errors import DipacoError

REPO = Path(__file__).resolve().parents[2]


def strict(text: str):
    """json.loads that refuses NaN and Infinity, as jq and JavaScript do."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


# ----------------------------------------------------------------------------- resume


def run_rows(path: Path, plan: dict[str, dict], resume: bool) -> list[str]:
    """A benchmark's loop on the harness: each row runs unless resumed with the same settings; the rows that ran."""
    results = Results.load(path, "toy", resume)
    ran = []
    for row, settings in plan.items():
        if results.has(row, settings):
            continue
        ran.append(row)
        results.put(row, settings, {"value": settings["steps"] * 10})
        results.write()
    return ran


def test_resume_keeps_a_finished_row_and_reruns_one_whose_settings_changed(tmp_path):
    path = tmp_path / "results.json"
    assert run_rows(path, {"a": {"steps": 1}, "b": {"steps": 2}}, resume=False) == ["a", "b"]
    first = json.loads(path.read_text())
    assert run_rows(path, {"a": {"steps": 1}, "b": {"steps": 3}, "c": {"steps": 4}}, resume=True) == ["b", "c"]
    after = json.loads(path.read_text())
    assert after["benchmark"] == "toy" and [r["name"] for r in after["rows"]] == ["a", "b", "c"]  # b kept its place
    assert after["rows"][0] == first["rows"][0]  # the kept row, untouched
    assert after["rows"][1]["settings"] == {"steps": 3} and after["rows"][1]["value"] == 30
    assert run_rows(path, {"a": {"steps": 1}, "b": {"steps": 3}}, resume=True) == []  # nothing changed: nothing runs
    assert run_rows(path, {"a": {"steps": 1}}, resume=False) == ["a"]  # without --resume the file starts over
    assert [r["name"] for r in json.loads(path.read_text())["rows"]] == ["a"]


def test_resume_keeps_the_file_s_top_level_fields_and_sorts_rows(tmp_path):
    results = Results(tmp_path / "r.json", "toy", meta={"base": {"lr": 0.1}})
    for row in ("z", "a"):
        results.put(row, {}, {"v": 1})
    results.sort(key=lambda r: r["name"])
    results.write()
    again = Results.load(tmp_path / "r.json", "toy", resume=True)
    assert again.meta == {"base": {"lr": 0.1}} and [r["name"] for r in again.rows] == ["a", "z"]
    assert again.get("a") == {"name": "a", "settings": {}, "settings_key": settings_key({}), "v": 1}
    with pytest.raises(ValueError, match="may not hold \\['name'\\]"):
        again.put("b", {}, {"name": "other"})


def test_a_file_that_is_not_this_benchmark_s_results_is_named_not_overwritten(tmp_path):
    path = tmp_path / "results.json"
    path.write_text('{"rows": [')
    with pytest.raises(ResultsFileError, match=f"cannot resume from {path}: not JSON"):
        Results.load(path, "toy", resume=True)
    write_json(path, {"benchmark": "other", "rows": []})
    with pytest.raises(ResultsFileError, match="holds the results of 'other', not of 'toy'"):
        Results.load(path, "toy", resume=True)
    write_json(path, {"records": []})
    with pytest.raises(ResultsFileError, match="no list of named rows"):
        Results.load(path, "toy", resume=True)


def test_settings_key_is_stable_and_reads_bench_scale_s_recorded_hashes():
    a = {"command": ["prepare", "--x", "1"], "omp": "1", "corpus": {"docs": 10}}
    assert settings_key(a) == settings_key(dict(reversed(list(a.items()))))
    assert settings_key(a) != settings_key({**a, "omp": "2"})
    # scripts/bench_scale.py's settings_hash: the same key, so its results files resume across the move
    assert settings_key(a) == hashlib.sha256(json.dumps(a, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- strict, atomic JSON


def test_nan_becomes_null_with_its_reason(tmp_path):
    results = Results(tmp_path / "r.json", "toy")
    results.put("diverged", {"lr": 10.0}, {"ppl": math.nan, "curve": [1.0, math.inf]})
    row = strict(results.write().read_text())["rows"][0]
    assert row["ppl"] is None and row["ppl_null_reason"] == "not a finite number (nan)"
    assert row["curve"] == [1.0, None]


def test_a_write_that_fails_midway_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = write_json(tmp_path / "results.json", {"rows": [{"name": "a"}]})
    before = path.read_text()
    real = pathlib.Path.write_text

    def half_then_disk_full(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_disk_full)
    with pytest.raises(DipacoError, match="could not write"):
        write_json(path, {"rows": [{"name": "a"}, {"name": "b", "pad": "x" * 10_000}]})
    monkeypatch.undo()
    assert path.read_text() == before and strict(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no half-written sibling left


def test_write_json_creates_the_directory(tmp_path):
    path = write_json(tmp_path / "new" / "dir" / "out.json", {"x": 1})
    assert strict(path.read_text()) == {"x": 1} and path.read_text().endswith("\n")


# ----------------------------------------------------------------------------- rows


def test_the_row_syntax_parses_a_row_and_its_overrides():
    assert parse_row("diloco_fp32") == ("diloco_fp32", [])
    assert parse_row("dipaco_2x2_iid@outer.rescale=sqrt_paths@run.seed=1") == (
        "dipaco_2x2_iid", ["outer.rescale=sqrt_paths", "run.seed=1"])
    assert parse_row("r@data.path=a=b") == ("r", ["data.path=a=b"])  # the value may hold '='


@pytest.mark.parametrize(("name", "message"), [
    ("delayed_int8@outer.momentum", "'outer.momentum' is not key=value"),
    ("delayed_int8@", "'' is not key=value"),
    ("delayed_int8@@outer.lr=1", "'' is not key=value"),
    ("delayed_int8@=1", "'=1' is not key=value"),
    ("@outer.lr=1", "no row name before '@'"),
])
def test_a_malformed_row_is_a_clear_error(name, message):
    with pytest.raises(RowSyntaxError, match=f"row {name!r}: {message}"):
        parse_row(name)


def test_unknown_rows_names_the_unknown_and_the_malformed():
    assert unknown_rows(["a", "a@x=1", "b@x=1", "a@x", "a"], known={"a"}) == ["b@x=1", "a@x"]
    assert safe_name("dense@outer.lr=0.7/x") == "dense_outer.lr_0.7_x"


# ----------------------------------------------------------------------------- table and machine


def test_markdown_table_cells():
    rows = [{"name": "a|b", "ppl": 12.345, "note": None}, {"name": "c", "ppl": 7.0}]
    table = markdown_table(rows, [("row", "name"), ("val ppl", lambda r: f"{r['ppl']:.2f}"), ("note", "note")])
    assert table.splitlines() == ["| row | val ppl | note |", "|---|---|---|", "| a\\|b | 12.35 | - |", "| c | 7.00 | - |"]
    with pytest.raises(ValueError, match="no columns"):
        markdown_table(rows, [])


def test_environment_names_the_machine(tmp_path):
    import platform

    import torch

    env = environment("cpu")
    assert env["device"] == f"cpu ({platform.machine()})" and env["torch"] == torch.__version__
    assert env["threads"] == torch.get_num_threads() and env["cpus"] >= 1 and env["python"] == platform.python_version()
    assert env["date"].endswith("+00:00") and env["platform"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert env["git_commit"].split("+")[0] == head.stdout.strip()
    assert git_commit(tmp_path) is None  # outside a checkout: None, not a guess


# ----------------------------------------------------------------------------- python -m bench


def bench_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_python_m_bench_lists_every_benchmark_with_its_summary():
    for args in ((), ("--help",)):
        proc = bench_cli(*args)
        assert proc.returncode == 0, proc.stderr
        for name, summary in bench.BENCHMARKS.items():
            assert f"  {name}" in proc.stdout and summary in proc.stdout


def test_listing_imports_no_benchmark_and_no_torch():
    code = ("import sys, bench.__main__ as m; m.main([]); "
            "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('bench.') and n != 'bench.__main__'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_an_unknown_benchmark_is_an_error_naming_the_known_ones():
    proc = bench_cli("no_such_bench", "--smoke")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "unknown benchmark 'no_such_bench'" in proc.stderr
    assert all(name in proc.stderr for name in bench.BENCHMARKS)


def test_a_benchmark_s_help_names_the_command_that_runs_it():
    proc = bench_cli("tokenize", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m bench tokenize") and "--smoke" in proc.stdout


def test_a_bad_row_or_results_file_is_one_line_and_status_2(monkeypatch, capsys):
    def main(argv):
        parse_row(argv[0])

    monkeypatch.setitem(bench.BENCHMARKS, "toy", "a benchmark that parses its first argument as a row")
    monkeypatch.setitem(sys.modules, "bench.toy", types.SimpleNamespace(main=main))
    assert cli.main(["toy", "dense@lr"]) == 2
    err = capsys.readouterr().err
    assert err == "python -m bench toy: error: row 'dense@lr': 'lr' is not key=value (ROW@key=value@key=value)\n"
    assert cli.main(["toy", "dense@lr=1"]) == 0  # main returned None


def test_the_registry_lists_exactly_the_benchmark_modules():
    """A benchmark is a module of bench/ with a top-level ``main`` (a library module such as the harness has none):
    each is registered (else `python -m bench` cannot run it) and each registered name is such a module."""
    modules = {p.stem for p in (REPO / "bench").glob("*.py")
               if p.stem != "__main__" and "\ndef main(" in p.read_text(encoding="utf-8")}
    assert set(bench.BENCHMARKS) == modules
    assert all(f"\n{name} " in bench.__doc__ for name in modules)  # the package docstring lists them too
    moved = ("codecs", "checkpoint", "tokenize", "comm", "async", "serve", "quality", "scaling", "routing", "scale",
             "throughput")
    assert not any((REPO / "scripts" / f"bench_{m}.py").exists() for m in moved)


def test_the_import_contract_keeps_every_benchmark_apart():
    """pyproject.toml's independence contract names every registered benchmark: one left out could import another."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]
    apart = next(c for c in contracts if c["type"] == "independence")
    assert sorted(apart["modules"]) == sorted(f"bench.{name}" for name in bench.BENCHMARKS)


def test_free_port_is_a_loopback_port_a_server_can_bind():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
