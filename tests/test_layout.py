"""The package layout is the architecture: these imports must not creep in."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_after(*modules: str) -> set[str]:
    """Every module of ``dipaco``/``routing`` loaded by importing ``modules`` in a fresh interpreter."""
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print('\\n'.join(m for m in sys.modules if m.split('.')[0] in ('dipaco', 'routing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return set(out.stdout.split())


def test_serving_does_not_import_the_training_driver():
    loaded = imported_after("dipaco.serve.pipeline", "dipaco.serve.http", "dipaco.serve.export")
    assert not loaded & {"dipaco.train.loop", "dipaco.train.experiment", "dipaco.sync"}


def test_communication_knows_no_sync_algorithm():
    loaded = imported_after("dipaco.comm.reduce", "dipaco.comm.feedback", "dipaco.comm.codecs", "dipaco.comm.world")
    assert not {m for m in loaded if m.startswith(("dipaco.sync", "dipaco.train"))}


def test_routing_package_never_imports_dipaco():
    loaded = imported_after("routing.router", "routing.kmeans", "routing.featurize", "routing.discriminative",
                            "routing.quality", "routing.assignment")
    assert not {m for m in loaded if m.startswith("dipaco")}
