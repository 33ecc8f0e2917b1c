"""The one JSON writer of what mixprec writes for users: every ``--json`` output, each
line of a batch's ``results.jsonl`` and its ``--json`` lines, a report's JSON.

Strict JSON has no ``Infinity`` or ``NaN`` (``json.dumps`` writes them by default, and
strict parsers, ``jq`` and most languages' among them, refuse the text): a non-finite
float is written as the string ``"inf"``, ``"-inf"`` or ``"nan"``, and a text that would
hold one anyway is an error here, not a file another tool cannot read.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["json_ready", "json_text"]


def json_ready(value: Any) -> Any:
    """``value`` (dicts, lists and tuples of it, nested) with every non-finite float
    written as the string ``"inf"``, ``"-inf"`` or ``"nan"``: strict JSON has no
    Infinity or NaN, and a report read by another tool must parse.

    Example:
        >>> json_ready({"rel_l2": float("inf"), "rows": (1.5, float("nan"))})
        {'rel_l2': 'inf', 'rows': [1.5, 'nan']}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value


def json_text(value: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """``value`` as strict JSON text: :func:`json_ready`, then ``json.dumps`` with
    ``allow_nan=False`` (a non-finite float left over, a float key, raises ``ValueError``)
    and ``default=str`` (a path, or any other object JSON has no type for, is its
    ``str``). ``indent`` and ``sort_keys`` as in ``json.dumps``: a finite value's text is
    byte for byte ``json.dumps(value, indent=..., sort_keys=..., default=str)``.

    Example:
        >>> json_text({"rel_l2": float("inf"), "model": "m.onnx"})
        '{"rel_l2": "inf", "model": "m.onnx"}'
    """
    return json.dumps(
        json_ready(value), indent=indent, sort_keys=sort_keys, default=str, allow_nan=False
    )
