"""What a fresh clone relies on outside the Python code: Makefile, .ci/run, README, packaging, .gitignore."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_test_lists_skip_reasons(tmp_path):
    # -n prints the recipe without running it; a missing VENV only adds the install lines.
    out = subprocess.run(["make", "-n", "-C", str(REPO), "test", f"VENV={tmp_path / 'venv'}"],
                         capture_output=True, text=True, check=True).stdout
    pytest_lines = [line for line in out.splitlines() if " -m pytest" in line]
    assert len(pytest_lines) == 1, out
    assert "-rs" in pytest_lines[0].split()


def test_ci_runs_make_test_requiring_end_to_end_tests_and_fails_with_it(tmp_path):
    """.ci/run against a stand-in `make` that records its arguments and environment, then fails."""
    record = tmp_path / "make.log"
    fake = tmp_path / "bin" / "make"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$* DIPACO_REQUIRE_E2E=$DIPACO_REQUIRE_E2E" >> "{record}"\nexit 3\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("DIPACO_REQUIRE_E2E", None)
    proc = subprocess.run(["bash", str(REPO / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert record.read_text().splitlines() == ["test DIPACO_REQUIRE_E2E=1"]
    assert proc.returncode == 3, proc.stdout + proc.stderr  # nothing after a failed `make test` runs


def test_the_readme_install_without_make_is_what_make_test_runs():
    """Issue 34: the README's commands without make lacked the `bench` extra and `-rs`."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    make_extras = re.findall(r'pip install --quiet (?:--no-compile )?-e "\.\[([\w,]+)\]"', makefile)
    readme_extras = re.findall(r'^pip install -e "\.\[([\w,]+)\]"', readme, re.MULTILINE)
    # the demo's install first (its own extra), then the dev stack's, which the README's commands are
    assert make_extras == ["demo", "dev,demo,bench"] and readme_extras == make_extras[-1:]
    make_pytest = re.findall(r"\$\(PY\) -m pytest([^\n]*)", makefile)
    readme_pytest = re.findall(r"^python -m pytest([^#\n]*)", readme, re.MULTILINE)
    assert make_pytest and [a.split() for a in readme_pytest] == [a.split() for a in make_pytest]


def test_make_demo_installs_only_what_the_demo_runs():
    """Issue 76: `make demo` installed the whole dev stack (Ray, lm-eval, W&B, mypy: 145 packages) to run the demo."""
    proc = subprocess.run(["make", "-n", "-C", str(REPO), "demo", "VENV=/nonexistent-venv"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in proc.stdout.splitlines() if "pip install" in line]
    assert [re.findall(r'-e "\.\[([\w,]+)\]"', line) for line in installs if " -e " in line] == [["demo"]]
    # its jobs run in one process (dipaco pipeline): each `dipaco <job>` imported torch and transformers again
    jobs = [line for line in proc.stdout.splitlines() if "/bin/dipaco " in line]
    assert len(jobs) == 1 and " pipeline " in jobs[0] and "--baseline" in jobs[0], jobs
    proc = subprocess.run(["make", "-n", "-C", str(REPO), "test", "VENV=/nonexistent-venv"], capture_output=True,
                          text=True, timeout=60)
    assert '-e ".[dev,demo,bench]"' in proc.stdout  # the suite gets the dev stack
    # the demo leaves bytecode to the imports it makes; the suite's hundreds of interpreters get the venv compiled
    assert all("--no-compile" in line for line in installs if "torch==" in line or '".[demo]"' in line), installs
    assert "-m compileall" in proc.stdout


def test_readme_points_a_clone_only_at_what_it_has():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    # Outside the repository only ../shared/data is mentioned, as optional (benchmarks).
    assert set(re.findall(r"\.\./shared/([\w.-]+)", text)) <= {"data"}
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (REPO / target).exists(), f"README links to {target}, which a clone lacks"


def test_exported_models_are_ignored_by_git(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("exported/path_003/model.safetensors", "exported/path_000/config.json"):
        proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", path])
        assert proc.returncode == 0, f"{path} is not ignored"
    assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", "dipaco/serve/export.py"]).returncode == 1


def test_license_is_an_spdx_string_and_builds_without_its_deprecation_warning(tmp_path):
    pytest.importorskip("setuptools")
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "Apache-2.0"
    # The metadata step of `pip install`, as setuptools runs it, with every warning shown.
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "project.license" not in proc.stdout + proc.stderr, proc.stderr
    metadata = (tmp_path / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
