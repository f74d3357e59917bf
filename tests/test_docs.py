"""The documentation a newcomer reads (issue 50): a short README, one page of today's results, no dead links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = DOCS / "results.md"

# A command, after any `VAR=value`, `until`, `timeout N` or `/usr/bin/time ...` in front of it.
PREFIX = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+|until\s+|timeout\s+\d+\s+|/usr/bin/time(?:\s+-\w+(?:\s+\"[^\"]*\")?)*\s+)*"
COMMAND = re.compile(PREFIX + r"(?:python3?\s|dipaco\s|make(?:\s|$)|torchrun\s|scripts/)")
DEVICE = re.compile(r"\b(?:CPU|GPU|H100|H200)\b")


def sections(text: str) -> dict[str, str]:
    """The `## ` sections of a markdown text outside code blocks, by heading."""
    found: dict[str, list[str]] = {}
    current = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            current = line[3:].strip()
            found[current] = []
            continue
        if current is not None:
            found[current].append(line)
    return {heading: "\n".join(lines) for heading, lines in found.items()}


def commands(section: str) -> list[str]:
    """Every line of a fenced code block and every backticked span, stripped."""
    lines, fenced = [], False
    for line in section.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append(line.strip())
    prose = re.sub(r"```.*?```", "", section, flags=re.DOTALL)
    lines += [span.strip() for span in re.findall(r"`([^`\n]+)`", prose)]
    return lines


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+://|mailto:|#", t)]


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; reference material belongs in docs/guide.md"


def test_every_results_section_has_a_command_and_a_device():
    found = sections(RESULTS.read_text(encoding="utf-8"))
    assert len(found) >= 10, sorted(found)
    for heading, body in found.items():
        assert any(COMMAND.match(c) for c in commands(body)), f"results.md, {heading!r}: no command"
        assert DEVICE.search(body), f"results.md, {heading!r}: names no device"


def test_the_benchmark_log_is_split_into_notes():
    assert not (DOCS / "benchmarks.md").exists(), "docs/benchmarks.md is split into docs/notes/"
    notes = sorted(p.name for p in (DOCS / "notes").glob("*.md") if p.name != "README.md")
    assert notes and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", n) for n in notes), notes
    index = (DOCS / "notes" / "README.md").read_text(encoding="utf-8")
    assert [n for n in notes if f"]({n})" not in index] == [], "docs/notes/README.md lists every note"


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md", "docs/guide.md",
                                 *sorted(str(p.relative_to(REPO)) for p in (DOCS / "notes").glob("*.md"))])
def test_relative_links_resolve(doc):
    path = REPO / doc
    missing = [t for t in relative_links(path) if t and not (path.parent / t).exists()]
    assert missing == [], f"{doc} links to {missing}, which do not exist"


def test_every_figure_of_the_readme_summary_is_on_the_results_page():
    """README's "Where things stand" quotes results.md, never a figure of its own (issue 60): every decimal and
    every percentage there appears on the results page."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    summary = readme.split("## Where things stand", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"\d+(?:\.\d+)?%|\d+\.\d+", summary)
    assert len(figures) >= 5, figures
    results = RESULTS.read_text(encoding="utf-8")
    assert [f for f in figures if f not in results] == []


def test_results_files_live_in_a_folder_of_their_own():
    # issue 73: the benchmarks' JSON results sat among the pages of docs/ (66 files)
    assert sorted(p.name for p in DOCS.glob("*.json")) == []
    assert len(list((DOCS / "results").glob("*.json"))) >= 60


def test_the_guide_quotes_no_figure_the_results_page_does_not_have():
    """The guide gives reasons and links the measurement (issue 73): a percentage or an "N.Nx" ratio in it appears
    on the results page, where its command and date are."""
    guide = (DOCS / "guide.md").read_text(encoding="utf-8")
    figures = re.findall(r"\d+(?:\.\d+)?%|\d+(?:\.\d+)?x\b", guide)
    results = RESULTS.read_text(encoding="utf-8")
    assert [f for f in figures if f not in results] == []
