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


def test_no_import_cycle_lazy_imports_included():
    """Tarjan's strongly connected components of the module graph import-linter builds (grimp reads the
    imports inside functions too): every component is a single module."""
    grimp = pytest.importorskip("grimp", reason="import-linter's graph builder: pip install -e '.[dev]'")
    graph = grimp.build_graph("dipaco", "routing")
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in edges:
        if module not in index:
            visit(module)
    assert len(edges) > 50 and cycles == []


def _is_config(annotation: ast.expr | None) -> bool:
    """``Config``, or a union/optional with it (``Config | None``)."""
    return annotation is not None and any(isinstance(n, ast.Name) and n.id == "Config" for n in ast.walk(annotation))


def config_signatures() -> dict[str, list[str]]:
    """file -> the functions (and methods) of dipaco/ with a parameter annotated ``Config``, and the classes
    with a ``Config`` field (a dataclass's generated ``__init__`` takes it: ``Class.__init__``)."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "dipaco").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(_is_config(a.annotation) for a in args):
                    found.setdefault(str(path.relative_to(REPO)), []).append(node.name)
            elif isinstance(node, ast.ClassDef) and path.name != "config.py":
                if any(isinstance(f, ast.AnnAssign) and _is_config(f.annotation) for f in node.body):
                    found.setdefault(str(path.relative_to(REPO)), []).append(f"{node.name}.__init__")
    return found


def test_only_the_composition_root_takes_the_whole_config():
    """Components get their sections; the whole Config goes to the composition root (dipaco/run.py)
    and to the schema's own comparison (dipaco/config.py: config_diff). A dataclass with a Config field
    counts: the trainer held one until it was given the config's text and the root's resume check."""
    found = config_signatures()
    # Serving's root: Pipeline.from_run reads a trained experiment's stored config.yaml, whole, into this.
    assert found.pop("dipaco/serve/pipeline.py") == ["LoadedExperiment.__init__"]
    outside = {f: sorted(names) for f, names in found.items() if f != "dipaco/config.py"}
    assert outside == {"dipaco/run.py": ["__init__", "apply_overrides", "build_trainer", "check_config"]}
    assert found.get("dipaco/config.py") == ["config_diff"]  # the schema's own comparison of two configs
    assert sum(map(len, found.values())) <= 5  # issue 32's bound, on the training side
