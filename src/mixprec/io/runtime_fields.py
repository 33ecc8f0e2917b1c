"""The fields a written model carries in its ``metadata_props`` to say how it runs: the
engine and its properties (``mixprec optimize`` writes them; engines read them through
:func:`mixprec.runtime.engines.options_of_model`), the OpenVINO IR beside the model, and
the nodes kept FP32 under OpenVINO's bf16 hint (:mod:`mixprec.runtime.ov_marks` marks
them). One home for the four keys and their plain reading and writing."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import onnx

from mixprec.core.errors import MixprecError

__all__ = [
    "FP32_NODES_KEY",
    "HINTS_KEY",
    "RUNTIME_FIELDS",
    "RUNTIME_KEY",
    "RUNTIME_MODEL_KEY",
    "fp32_nodes",
    "json_field",
    "props_of",
    "runtime_fields_of",
    "with_fp32_nodes",
    "with_props",
]

#: The engine a model is meant to run in (absent: ONNX Runtime).
RUNTIME_KEY = "mixprec.runtime"
#: The engine's properties as a JSON object (``{}``: none).
HINTS_KEY = "mixprec.runtime_hints"
#: The OpenVINO IR (``OUT.xml``, beside the ONNX file) that the model runs as in OpenVINO.
RUNTIME_MODEL_KEY = "mixprec.runtime_model"
#: The names of the nodes kept FP32 under OpenVINO's bf16 hint (a JSON list).
FP32_NODES_KEY = "mixprec.openvino_fp32_nodes"
#: Every key that says how a model runs (an earlier run's are dropped together).
RUNTIME_FIELDS = (RUNTIME_KEY, HINTS_KEY, RUNTIME_MODEL_KEY, FP32_NODES_KEY)


def props_of(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def with_props(
    model: onnx.ModelProto, drop: Iterable[str] = (), add: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """A copy of ``model`` whose ``metadata_props`` lose the keys ``drop`` and those of
    ``add``, then end with ``add``'s (the other fields kept, in their order)."""
    add = dict(add or {})
    gone = set(drop) | set(add)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [(p.key, p.value) for p in out.metadata_props if p.key not in gone]
    del out.metadata_props[:]
    for key, value in [*kept, *add.items()]:
        out.metadata_props.add(key=key, value=value)
    return out


def json_field(model: onnx.ModelProto, key: str, kind: type, what: str) -> Any:
    """The JSON value of the field ``key`` (None where the model has none).

    Raises:
        MixprecError: the field is not JSON, or not a ``kind`` (``what`` says what it must be).
    """
    text = props_of(model).get(key)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise MixprecError(f"metadata {key} is not JSON ({e.msg})") from None
    if not isinstance(value, kind):
        raise MixprecError(f"metadata {key} must be {what}, not {value!r}")
    return value


def runtime_fields_of(model: onnx.ModelProto) -> dict[str, str]:
    """The model's fields of :data:`RUNTIME_FIELDS` (an earlier ``mixprec optimize``'s),
    ``{}`` for none."""
    return {k: v for k, v in props_of(model).items() if k in RUNTIME_FIELDS}


def fp32_nodes(model: onnx.ModelProto) -> list[str] | None:
    """The node names :data:`FP32_NODES_KEY` lists (None: the model carries no marks).

    Raises:
        MixprecError: the field is not a JSON list of names.
    """
    names = json_field(model, FP32_NODES_KEY, list, "a JSON list of node names")
    if names is not None and not all(isinstance(n, str) for n in names):
        raise MixprecError(f"metadata {FP32_NODES_KEY} must be a JSON list of node names")
    return names


def with_fp32_nodes(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose ``metadata_props`` list ``names`` as the nodes kept FP32
    (sorted; an earlier list and IR name replaced)."""
    listed = {FP32_NODES_KEY: json.dumps(sorted(set(names)))}
    return with_props(model, drop=(RUNTIME_MODEL_KEY,), add=listed)
