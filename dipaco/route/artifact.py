"""The one loader of a run's router artifact (``routing/router/``), for every job that routes new text."""

from __future__ import annotations

from dipaco.errors import DataError
from dipaco.run_dir import RunDir
from routing.router import Router, RouterFileError


def load_router(run: RunDir, num_paths: int) -> Router:
    """The run's router, checked to route to ``num_paths`` paths; a clear error when it is missing or unfit."""
    path = run.routing / "router"
    try:
        router = Router.load(path)
        router.check_fits(num_paths)
    except RouterFileError as exc:
        raise DataError(f"{exc}; run `dipaco route` first") from None
    except ValueError as exc:
        raise DataError(f"{path}: {exc}") from None
    return router
