"""How the chosen model says how to run it: ``metadata_props`` ``mixprec.runtime`` (``ort`` |
``openvino``) and ``mixprec.runtime_hints`` (a JSON object of the engine's properties,
``{"INFERENCE_PRECISION_HINT": "bf16"}``, ``{"provider": "cuda"}`` for a winner on a GPU
device, ``{}`` for none).

An absent ``mixprec.runtime`` means ONNX Runtime: the input chosen as it is in ONNX
Runtime gets no fields at all, so that it is written byte for byte as given.
:func:`mixprec.runtime.engines.options_from_metadata` reads the fields back
(:func:`mixprec.validate` runs a model the way they say).
"""

from __future__ import annotations

import json

import onnx

from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import HINTS_KEY, RUNTIME_KEY, runtime_hints

__all__ = ["runtime_fields", "runtime_metadata", "stamp", "unstamped"]


def runtime_metadata(options: RuntimeOptions) -> dict[str, str]:
    """The two fields for ``options``: ``{"mixprec.runtime": "openvino",
    "mixprec.runtime_hints": '{"INFERENCE_PRECISION_HINT": "f32"}'}``."""
    hints = json.dumps(runtime_hints(options), sort_keys=True)
    return {RUNTIME_KEY: options.name, HINTS_KEY: hints}


def stamp(model: onnx.ModelProto, options: RuntimeOptions) -> onnx.ModelProto:
    """A copy of ``model`` whose ``metadata_props`` say to run it with ``options`` (fields
    of an earlier stamp replaced, the model's other fields kept)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fields = runtime_metadata(options)
    kept = [(p.key, p.value) for p in out.metadata_props if p.key not in fields]
    del out.metadata_props[:]
    for key, value in [*kept, *fields.items()]:
        out.metadata_props.add(key=key, value=value)
    return out


def runtime_fields(model: onnx.ModelProto) -> dict[str, str]:
    """The model's ``mixprec.runtime`` / ``mixprec.runtime_hints`` fields (an earlier
    ``mixprec optimize``'s), ``{}`` for none."""
    return {p.key: p.value for p in model.metadata_props if p.key in (RUNTIME_KEY, HINTS_KEY)}


def unstamped(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the runtime fields (the model itself when it has none): what
    runs in ONNX Runtime, as the fields' absence says."""
    if not runtime_fields(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [(p.key, p.value) for p in out.metadata_props if p.key not in (RUNTIME_KEY, HINTS_KEY)]
    del out.metadata_props[:]
    for key, value in kept:
        out.metadata_props.add(key=key, value=value)
    return out
