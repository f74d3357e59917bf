"""``python -m bench NAME [args...]`` runs benchmark NAME (``bench.NAME``'s ``main(args)``); ``python -m bench``
or ``--help`` lists the benchmarks. Listing imports no benchmark module, so it needs no torch."""

from __future__ import annotations

import importlib
import sys

from bench import BENCHMARKS

USAGE = "usage: python -m bench NAME [args...]   (python -m bench NAME --help: a benchmark's own flags)"


def listing() -> str:
    """The usage line and every benchmark with its one-line summary."""
    width = max(map(len, BENCHMARKS))
    return "\n".join([USAGE, "", "benchmarks:", *(f"  {name:<{width}}  {summary}" for name, summary in BENCHMARKS.items())])


def main(argv: list[str] | None = None) -> int:
    """Runs the named benchmark and returns its exit status (0 when its ``main`` returns None); 2 for an unknown
    name, after a line naming the known ones."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"{USAGE}\npython -m bench: error: unknown benchmark {name!r}; the benchmarks are: "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    from bench.harness import ResultsFileError, RowSyntaxError
    from dipaco.errors import DipacoError

    module = importlib.import_module(f"bench.{name}")
    try:
        status = module.main(args)
    except (ResultsFileError, RowSyntaxError, DipacoError) as exc:  # a bad --rows, results file or option: one line
        print(f"python -m bench {name}: error: {exc}", file=sys.stderr)
        return 2
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
