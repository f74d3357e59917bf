"""The run's comparison table (`dipaco report`): one row per evaluated model, read from the ``eval.json``
files that `dipaco eval` wrote. It reads JSON only, so the command answers without loading torch."""

from __future__ import annotations

import json
from pathlib import Path

from dipaco.errors import DataError
from dipaco.run_dir import RunDir

REPORT = "eval.json"


_ROW_KEYS = ("experiment", "topology", "num_paths", "steps_per_path", "params_per_path", "params_total", "overall")


def _read_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is unreadable ({exc}); run `dipaco eval` for it again") from None
    if not isinstance(report, dict) or any(k not in report for k in _ROW_KEYS) or "ppl" not in report["overall"]:
        raise DataError(f"{path} is not an eval report of this dipaco; run `dipaco eval` for it again")
    return report


def training_compute(report: dict) -> int:
    """Paths x steps per path x parameters per path: training FLOPs up to a constant (each step of
    each path is a forward and backward pass over the same number of tokens)."""
    return report["num_paths"] * report["steps_per_path"] * report["params_per_path"]


def comparison_table(run_dir: str | Path) -> str:
    """One row per evaluated model of a run: the pretrained init and every experiment, with the compute
    each trained for beside its steps per path (relative: to the cheapest experiment)."""
    run = RunDir(run_dir)
    reports = [run.pretrain / REPORT] + [e / REPORT for e in run.experiments()]
    rows = [_read_report(p) for p in reports if p.is_file()]
    trained = [training_compute(r) for r in rows if r["experiment"] != "pretrained" and training_compute(r) > 0]
    unit = min(trained) if trained else None
    header = (f"{'model':<18} {'topology':<44} {'params/path':>11} {'params total':>12} {'steps/path':>10} "
              f"{'compute':>9} {'relative':>8} {'val ppl':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        compute = training_compute(r)
        relative = f"{compute / unit:.3g}x" if unit and r["experiment"] != "pretrained" else "-"
        lines.append(
            f"{r['experiment']:<18} {r['topology']:<44} {r['params_per_path']:>11,} {r['params_total']:>12,} "
            f"{r['steps_per_path']:>10} {compute:>9.3g} {relative:>8} {r['overall']['ppl']:>9.2f}"
        )
    lines.append("compute = paths x steps/path x params/path; relative to the cheapest experiment")
    return "\n".join(lines)
