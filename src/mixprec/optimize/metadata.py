"""How the chosen model says how to run it: ``metadata_props`` ``mixprec.runtime`` (``ort`` |
``openvino``) and ``mixprec.runtime_hints`` (a JSON object of the engine's properties,
``{"INFERENCE_PRECISION_HINT": "bf16"}``, ``{"provider": "cuda"}`` for a winner on a GPU
device, ``{}`` for none).

A model with OpenVINO precision marks (:mod:`mixprec.runtime.ov_marks`) is written as a
pair by :func:`save_marked`: ``OUT.onnx`` (the FP32 model) names its IR ``OUT.xml`` in
``mixprec.runtime_model``, which OpenVINO's engine reads instead of the ONNX model.

An absent ``mixprec.runtime`` means ONNX Runtime: the input chosen as it is in ONNX
Runtime gets no fields at all, so that it is written byte for byte as given.
:func:`mixprec.runtime.engines.options_from_metadata` reads the fields back
(:func:`mixprec.validate` runs a model the way they say).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import onnx
import onnx_ir as ir

from mixprec.io.models import check_output_path, save_model
from mixprec.io.runtime_fields import (
    HINTS_KEY,
    RUNTIME_FIELDS,
    RUNTIME_KEY,
    RUNTIME_MODEL_KEY,
    runtime_fields_of,
    with_props,
)
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import runtime_hints, write_marked_ir

__all__ = ["runtime_metadata", "save_marked", "stamp", "unstamped"]


def runtime_metadata(options: RuntimeOptions) -> dict[str, str]:
    """The two fields for ``options``: ``{"mixprec.runtime": "openvino",
    "mixprec.runtime_hints": '{"INFERENCE_PRECISION_HINT": "f32"}'}``."""
    hints = json.dumps(runtime_hints(options), sort_keys=True)
    return {RUNTIME_KEY: options.name, HINTS_KEY: hints}


def stamp(model: onnx.ModelProto, options: RuntimeOptions) -> onnx.ModelProto:
    """A copy of ``model`` whose ``metadata_props`` say to run it with ``options`` (fields
    of an earlier stamp replaced, the model's other fields kept)."""
    return with_props(model, add=runtime_metadata(options))


def unstamped(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without the runtime fields (the model itself when it has none): what
    runs in ONNX Runtime, as the fields' absence says."""
    return with_props(model, drop=RUNTIME_FIELDS) if runtime_fields_of(model) else model


def save_marked(
    model: onnx.ModelProto, path: str | os.PathLike[str], *, external_data: bool = False
) -> Path:
    """Writes ``model`` (FP32, listing the nodes kept FP32) as ``path`` (``OUT.onnx``)
    beside its OpenVINO IR ``OUT.xml``/``OUT.bin`` with those nodes marked; the ONNX
    model says to run it in OpenVINO with the bf16 hint, and ``mixprec.runtime_model``
    names the IR. Each file is written atomically, the IR first (removed again when the
    ONNX file cannot be written). Returns the IR's path.

    Example:
        >>> proto, _ = bf16_marked(onnx.load("m.onnx"), samples)  # doctest: +SKIP
        >>> save_marked(proto, "m_bf16.onnx")  # also m_bf16.xml, m_bf16.bin  # doctest: +SKIP

    Raises:
        MixprecError: a folder that cannot be written, or OpenVINO cannot write the marks.
    """
    out = check_output_path(path)
    xml = out.with_suffix(".xml") if out.suffix != ".xml" else out.with_name(out.name + ".xml")
    check_output_path(xml)
    write_marked_ir(model, xml)
    named = stamp(model, RuntimeOptions("openvino", precision="bf16"))
    named = with_props(named, add={RUNTIME_MODEL_KEY: xml.name})
    try:
        save_model(ir.from_proto(named), out, external_data=external_data)
    except BaseException:
        for left in (xml, xml.with_suffix(".bin")):
            with contextlib.suppress(OSError):
                left.unlink()
        raise
    return xml
