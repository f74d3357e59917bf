"""Plot chosen rows of one or more `bench_quality.py` results files: validation perplexity against
training tokens, one panel per results file.

    python scripts/plot_quality.py --out docs/plot.png \\
        --panel "BBC=runs/bbc/results.json" --panel "mix=runs/mix/results.json" \\
        --rows diloco_4@train.rounds=16 dipaco_2x2_iid@outer.rescale=sqrt_paths@train.rounds=16

A row may live in any of several results files of one panel (``TITLE=A.json,B.json``): rows of one
corpus are often split across out-dirs that ran side by side. A row named but found in none of a
panel's files is an error, so a plot never silently drops a row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def panel_rows(files: list[Path], names: list[str]) -> list[dict]:
    """The named rows, in the order named, from the first of ``files`` that holds each."""
    found: dict[str, dict] = {}
    for path in files:
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError) as err:
            raise SystemExit(f"error: {path}: not a bench_quality results file ({err})") from None
        for row in rows:
            found.setdefault(row["name"], row)
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"error: rows not in {', '.join(map(str, files))}: {', '.join(missing)}")
    return [found[name] for name in names]


def parse_panel(spec: str) -> tuple[str, list[Path]]:
    title, sep, files = spec.partition("=")
    if not sep or not title or not files:
        raise SystemExit(f"error: --panel {spec!r}: expected TITLE=results.json[,more.json]")
    return title, [Path(f) for f in files.split(",")]


def plot(panels: list[tuple[str, list[dict]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        for i, row in enumerate(rows):
            ax.plot([c["tokens"] / 1e6 for c in row["curve"]], [c["ppl"] for c in row["curve"]],
                    marker="osD^v<>"[i % 7], label=f"{row['name']} ({row['ppl']:.2f})")
        ax.set_title(title)
        ax.set_xlabel("training tokens, all paths (M)")
        ax.set_ylabel("validation perplexity")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--panel", action="append", required=True, metavar="TITLE=results.json[,more.json]")
    p.add_argument("--rows", nargs="+", required=True, help="row names, as in results.json")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    panels = [(title, panel_rows(files, args.rows)) for title, files in map(parse_panel, args.panel)]
    plot(panels, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
