"""JSON text every parser reads: Python's ``json`` writes NaN and Infinity, which are not JSON (jq,
JavaScript and strict parsers refuse the whole file). Every JSON file dipaco writes goes through
:func:`dumps`: a number that is not finite is written as ``null``, with ``<key>_null_reason`` beside it
(unless the writer already put a more specific reason there, e.g. a path with 0 validation documents)."""

from __future__ import annotations

import json
import math
from typing import Any


def _scalar(value: Any) -> Any:
    """A 0-d tensor or numpy scalar as the Python number it holds; anything else as it is."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def without_non_finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None; in a mapping, a reason is added beside it."""
    value = _scalar(value)
    if isinstance(value, dict):
        out: dict = {}
        for key, item in value.items():
            item = _scalar(item)
            if _non_finite(item):
                out[key] = None
                out.setdefault(f"{key}_null_reason", f"not a finite number ({item})")
            else:
                out[key] = without_non_finite(item)  # a writer's own "<key>_null_reason", later, replaces ours
        return out
    if isinstance(value, (list, tuple)):
        return [None if _non_finite(_scalar(v)) else without_non_finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes NaN or Infinity (see the module docstring)."""
    return json.dumps(without_non_finite(value), allow_nan=False, **kwargs)
