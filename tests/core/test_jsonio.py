"""Tests of mixprec.core.jsonio: the one JSON writer of what mixprec writes for users."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import strict_json
from mixprec.core.jsonio import json_ready, json_text


def test_non_finite_floats_are_strings_at_any_depth() -> None:
    value = {
        "worst": -math.inf,
        "rows": [1.5, math.nan, (math.inf, {"deep": [np.float64("nan")]})],
        "shape": (1, 3),
        "path": Path("out") / "m.onnx",
        "passed": False,
        "none": None,
    }
    for indent in (None, 2):
        assert strict_json(json_text(value, indent=indent)) == {
            "worst": "-inf",
            "rows": [1.5, "nan", ["inf", {"deep": ["nan"]}]],
            "shape": [1, 3],
            "path": str(Path("out") / "m.onnx"),
            "passed": False,
            "none": None,
        }
    assert json_ready((math.inf,)) == ["inf"] and json_ready("nan") == "nan"


def test_finite_values_are_written_as_json_dumps_writes_them() -> None:
    value = {"b": [0.1, 2, np.float64(1e-300), True], "a": {"p": Path("x.onnx"), "t": (1.0,)}}
    for kwargs in ({}, {"indent": 2}, {"sort_keys": True}, {"indent": 1, "sort_keys": True}):
        assert json_text(value, **kwargs) == json.dumps(value, default=str, **kwargs)


def test_a_non_finite_value_json_ready_cannot_reach_raises() -> None:
    """A non-finite float key is left by :func:`json_ready`: the writer refuses it rather
    than write ``NaN``."""
    with pytest.raises(ValueError, match="not JSON compliant"):
        json_text({math.nan: 1})
