"""Which routing an experiment was trained on: fingerprints of the run's routing and the experiment's record.

A run has one ``routing/`` directory, and ``dipaco reroute`` rewrites it for the experiment it
re-routes. Every other experiment of the run would then silently resume, evaluate and serve on
shards it was never trained on; so each kmeans experiment records the fingerprint of the routing it
trained on (``train/<name>/routing.json``) and every job that reads routing for it checks it.
An experiment's own re-routing (``dipaco reroute``, or ``route.em_rounds`` inside ``dipaco train``)
notes the fingerprint it is about to write there before it replaces the routing, so a stop between
the two still finds the experiment's own routing accepted.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from dipaco import json_text
from dipaco.atomic import write_text
from dipaco.errors import DataError
from dipaco.run_dir import RunDir

ROUTED_INFO = "routing_info.json"  # in routing/data: what the routed splits were routed from, and their fingerprint
EXPERIMENT_ROUTING = "routing.json"  # in an experiment directory: the fingerprint of its routing


FINGERPRINT_ROWS = 1 << 20


def routing_fingerprint(paths: dict[str, np.ndarray], router_dir: Path) -> str:
    """sha256 of every routed path id (as int64) and of the router's files: equal only for the same
    routing. The ids are hashed ``FINGERPRINT_ROWS`` at a time (the same digest): the int64 copy and its
    bytes were 16 bytes a document at once, 144 MB at 10M."""
    digest = hashlib.sha256()
    for split in sorted(paths):
        digest.update(split.encode())
        ids = paths[split]
        for a in range(0, len(ids), FINGERPRINT_ROWS):
            digest.update(np.ascontiguousarray(ids[a : a + FINGERPRINT_ROWS], dtype=np.int64).tobytes())
    for file in sorted(router_dir.iterdir()):
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def read_record(path: Path) -> dict | None:
    """A JSON record of a run (None when there is none); one that is not a JSON object is a DataError
    naming the file, whose fix is to write it again."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); it is written by the job that made it: run that again") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: not a JSON object; it is written by the job that made it: run that again")
    return record


def routed_info(run: RunDir) -> dict | None:
    """What ``dipaco route`` recorded next to the routed splits (None before it ran)."""
    return read_record(run.routing / "data" / ROUTED_INFO)


def current_fingerprint(run: RunDir) -> str | None:
    """The fingerprint of the run's routing now (None without one, or from before fingerprints existed)."""
    info = routed_info(run)
    return None if info is None else info.get("fingerprint")


def _recorded(exp_dir: Path) -> dict | None:
    record = read_record(exp_dir / EXPERIMENT_ROUTING)
    if record is not None and not isinstance(record.get("fingerprint"), str):
        raise DataError(f"{exp_dir / EXPERIMENT_ROUTING}: no routing fingerprint in it; delete it to train on the "
                        f"run's routing as it is now")
    return record


def record_routing(run_dir: str | Path, exp_dir: Path, routed: bool, rerouting: str | None = None) -> None:
    """Notes which routing the experiment trains on (``routed``: it trains on routed shards; routing from
    before fingerprints existed is not recorded). ``rerouting``: the fingerprint of a re-routing of this
    experiment that is about to replace the run's routing; it stays accepted as the experiment's own
    until the next record (see :func:`check_routing`)."""
    fingerprint = current_fingerprint(RunDir(run_dir)) if routed else None
    if fingerprint is not None:
        exp_dir.mkdir(parents=True, exist_ok=True)
        entry = {"fingerprint": fingerprint, **({"rerouting": rerouting} if rerouting else {})}
        write_text(exp_dir / EXPERIMENT_ROUTING, json_text.dumps(entry) + "\n")


def pending_rerouting(exp_dir: Path) -> str | None:
    """The fingerprint of the experiment's own re-routing that was written (or about to be) but not
    recorded as the routing it trains on: a stop came in between."""
    record = _recorded(exp_dir)
    return None if record is None else record.get("rerouting")


def check_routing(run_dir: str | Path, exp_dir: Path, routed: bool) -> None:
    """Refuses an experiment whose run's routing is no longer the one it was trained on, nor its own re-routing."""
    record = _recorded(exp_dir)
    if not routed or record is None:
        return
    run = RunDir(run_dir)
    trained_on, current = record["fingerprint"], current_fingerprint(run)
    if current not in (trained_on, record.get("rerouting")):
        raise DataError(
            f"{run.routing} is not the routing experiment {exp_dir.name!r} was trained on (fingerprint "
            f"{str(current)[:12]} vs {trained_on[:12]}): a `dipaco route`, or a `dipaco reroute` of another "
            f"experiment, replaced it. Give each re-routed experiment its own run directory, or route again "
            f"with the settings this experiment used."
        )
