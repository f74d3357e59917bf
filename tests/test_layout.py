"""The package layout is the architecture: import-linter's contracts (pyproject.toml) hold, and the
composition root is the only code that takes the whole Config. (Serving a request loads nothing of
training: tests/dipaco/serve/test_serve_imports.py.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    """The layers in data-flow order, serving apart from training, routing apart from dipaco, the
    config a leaf: every import counts, the ones inside functions too (import-linter reads them all)."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    if not lint_imports.is_file():
        pytest.skip("make lint's import-linter is not installed: pip install -e '.[dev]'")
    out = subprocess.run([str(lint_imports)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def config_signatures() -> dict[str, list[str]]:
    """file -> the functions (and methods) of dipaco/ with a parameter annotated ``Config``."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "dipaco").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(isinstance(a.annotation, ast.Name) and a.annotation.id == "Config" for a in args):
                    found.setdefault(str(path.relative_to(REPO)), []).append(node.name)
    return found


def test_only_the_composition_root_takes_the_whole_config():
    """Components get their sections; the whole Config goes to the composition root (dipaco/run.py)
    and to the schema's own operations (dipaco/config.py: merge, diff, resume check)."""
    outside = {f: sorted(names) for f, names in config_signatures().items() if f != "dipaco/config.py"}
    assert outside == {"dipaco/run.py": ["__init__", "apply_overrides", "build_trainer", "check_config"]}
