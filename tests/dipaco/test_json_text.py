"""dipaco.json_text: JSON files without NaN or Infinity, which strict parsers refuse (issue 48)."""

import json
import math

import numpy as np
import torch

from dipaco import json_text


def strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_null_with_a_reason_beside_them():
    value = {"ppl": math.nan, "loss": torch.tensor(math.inf), "norm": np.float32("-inf"), "ok": 1.5,
             "rows": [1.0, math.nan], "nested": {"x": float("nan")}}
    out = strict_loads(json_text.dumps(value))
    assert out["ppl"] is None and out["ppl_null_reason"] == "not a finite number (nan)"
    assert out["loss"] is None and out["loss_null_reason"] == "not a finite number (inf)"
    assert out["norm"] is None and "inf" in out["norm_null_reason"]
    assert out["ok"] == 1.5 and out["rows"] == [1.0, None] and out["nested"]["x"] is None


def test_a_writers_own_reason_is_kept():
    out = strict_loads(json_text.dumps({"ppl": math.nan, "ppl_null_reason": "no validation document is routed here"}))
    assert out == {"ppl": None, "ppl_null_reason": "no validation document is routed here"}
