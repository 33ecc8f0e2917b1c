"""mixprec's FP32 decisions as OpenVINO precision marks: bf16 without Converts.

A bf16 model with Casts makes OpenVINO pay a Convert at every FP32 island. OpenVINO can
say the same thing itself: the FP32 model, compiled with ``INFERENCE_PRECISION_HINT=bf16``,
with the nodes mixprec keeps FP32 marked in their runtime info. The mark is OpenVINO's own
"do not lower" attribute (``ov::disable_fp16_compression``: in OpenVINO 2026 the
``DisablePrecisionConversion`` attribute, ``dynamic:f16``, written in the IR as
``<attribute name="DisablePrecisionConversion" version="0" value="dynamic:f16"/>``). The
CPU plugin reads it when it builds its graph (``Node``: ``is_conversion_disabled(op, f16)``
sets ``keepOriginalPrecision``) and ``Graph::EnforceInferencePrecision`` leaves such nodes in
their original precision while it lowers the rest to the hint.

From Python the mark is set as the attribute's earlier key, ``"precise_0"``, which
OpenVINO's IR serializer writes as the attribute above; read back from the IR it is the
typed attribute the plugin checks (set in memory it is a string the plugin ignores, so
marked models always go through an IR file).
:func:`mixprec.runtime.openvino.write_marked_ir` checks on reading back that the marks
landed on exactly the ops it marked.

An ONNX node becomes one or more OpenVINO ops (a Conv with a bias: a Convolution, an Add
and the bias's reshape ops; a graph output's op is named after the tensor). The ops of a
node are found by tensor names, which the ONNX front end keeps: from the ops that produce
the node's outputs back to the ops that produce any other named tensor (its inputs).

The marked model is carried two ways (the fields: :mod:`mixprec.io.runtime_fields`): in
memory as the FP32 ONNX model with ``FP32_NODES_KEY`` (the names of the nodes kept FP32, a
JSON list) in its ``metadata_props``, marked when it is loaded; on disk as that model
beside an IR (``OUT.xml``/``OUT.bin``) that ``RUNTIME_MODEL_KEY`` names, which any
OpenVINO reads.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from mixprec.io.runtime_fields import RUNTIME_MODEL_KEY, props_of
from mixprec.runtime.engine import RuntimeLoadError

__all__ = [
    "MARK_KEYS",
    "SET_KEY",
    "MarkedIr",
    "RuntimeLayer",
    "mark_fp32_ops",
    "marked_names",
    "ops_of_nodes",
    "resolved_runtime_model",
    "runtime_layers",
    "runtime_model_path",
]

#: How the mark is set from Python (OpenVINO's IR serializer writes it as the attribute).
SET_KEY = "precise_0"
#: The keys a marked op carries once read from an IR (2026: the first; earlier: the second).
MARK_KEYS = ("DisablePrecisionConversion_0", "precise_0")
#: Ops that are never marked: data, not computation.
_UNMARKED = frozenset({"Parameter", "Result", "Constant"})


@dataclass(frozen=True)
class MarkedIr:
    """What marking (and writing) a model did.

    Attributes:
        xml: The IR's ``.xml`` (its ``.bin`` beside it).
        marked: Friendly names of the OpenVINO ops marked to stay FP32.
        unmapped: Names of FP32 nodes no OpenVINO op was found for (an Identity, a node
            inside a subgraph): nothing to mark.
    """

    xml: str
    marked: frozenset[str]
    unmapped: tuple[str, ...]


@dataclass(frozen=True)
class RuntimeLayer:
    """One layer of a compiled model's runtime graph: its name, type (``layerType``), the
    precision it ran in (``runtimePrecision``) and the model's ops fused into it."""

    name: str
    type: str
    precision: str
    originals: tuple[str, ...]


def ops_of_nodes(ov_model: Any, graph: onnx.GraphProto) -> dict[str, list[Any]]:
    """The OpenVINO ops each named node of ``graph`` (the main graph) became, by node name.

    An op belongs to a node when it lies between the node's outputs and the tensors it
    reads: found from the ops producing the node's output tensors, backwards, stopping at
    ops that produce a tensor of another name (the node's inputs, other nodes' outputs,
    initializers). Constants and parameters are never listed; a node whose outputs no op
    produces under their own name (an Identity) gets an empty list.
    """
    producers: dict[str, Any] = {}
    for op in ov_model.get_ordered_ops():
        if op.get_type_name() == "Result":
            continue
        for port in op.outputs():
            for name in port.get_names():
                producers[name] = op
    found: dict[str, list[Any]] = {}
    for node in graph.node:
        if node.name:
            outputs = {o for o in node.output if o}
            found[node.name] = _region(producers, outputs)
    return found


def _names_of(op: Any) -> set[str]:
    return {name for port in op.outputs() for name in port.get_names()}


def _region(producers: Mapping[str, Any], outputs: set[str]) -> list[Any]:
    """The ops from those producing ``outputs`` back to the first foreign named tensor."""
    stack = [producers[o] for o in sorted(outputs) if o in producers]
    seen: set[str] = set()
    region = []
    while stack:
        op = stack.pop()
        key = op.get_friendly_name()
        if key in seen:
            continue
        seen.add(key)
        if op.get_type_name() in _UNMARKED or not _names_of(op) <= outputs:
            continue  # a boundary: the node's inputs, or data
        region.append(op)
        stack.extend(value.get_node() for value in op.input_values())
    return region


def mark_fp32_ops(ov_model: Any, graph: onnx.GraphProto, names: Collection[str]) -> MarkedIr:
    """Marks the ops of the nodes ``names`` (of ``graph``) in ``ov_model`` to stay FP32;
    ``xml`` of the result is empty (nothing written)."""
    ops = ops_of_nodes(ov_model, graph)
    marked: set[str] = set()
    unmapped = []
    for name in sorted(set(names)):
        region = ops.get(name) or []
        if not region:
            unmapped.append(name)
        for op in region:
            op.get_rt_info()[SET_KEY] = ""
            marked.add(op.get_friendly_name())
    return MarkedIr("", frozenset(marked), tuple(unmapped))


def marked_names(ov_model: Any) -> set[str]:
    """Friendly names of the ops of ``ov_model`` (read from an IR) that carry the mark."""
    return {
        op.get_friendly_name()
        for op in ov_model.get_ordered_ops()
        if any(key in op.get_rt_info() for key in MARK_KEYS)
    }


def runtime_model_path(props: Mapping[str, str], folder: Path | None) -> Path | None:
    """The IR a model's ``metadata_props`` (``props``) say it runs as: the file
    :data:`RUNTIME_MODEL_KEY` names beside the model (in ``folder``, the model file's
    folder), or where it says when absolute (a model a caller resolved, as
    :func:`resolved_runtime_model` does). None when the model names none, or names one
    relative to a file the caller does not know (``folder`` None).

    Raises:
        RuntimeLoadError: one line, when the name is not a plain ``.xml`` file name or the
            file (or its ``.bin``) is not there.
    """
    name = props.get(RUNTIME_MODEL_KEY)
    if name is None:
        return None
    if Path(name).is_absolute():
        xml = Path(name)
    elif Path(name).name != name or not name.endswith(".xml"):
        raise RuntimeLoadError(
            f"metadata {RUNTIME_MODEL_KEY}={name!r} must be the file name of an OpenVINO "
            "IR (.xml) beside the model"
        )
    elif folder is None:
        return None
    else:
        xml = folder / name
    missing = [p.name for p in (xml, xml.with_suffix(".bin")) if not p.is_file()]
    if missing:
        raise RuntimeLoadError(
            f"the model's OpenVINO IR {' and '.join(missing)} is missing from {xml.parent} "
            f"(metadata {RUNTIME_MODEL_KEY}={name!r}): write the pair again, or run the "
            "ONNX model with --runtime ort"
        )
    return xml


def resolved_runtime_model(model: onnx.ModelProto, folder: Path) -> onnx.ModelProto:
    """``model`` (read from a file in ``folder``) with its :data:`RUNTIME_MODEL_KEY`
    made absolute, so that it still names its IR once in memory; ``model`` itself when it
    names none.

    Raises:
        RuntimeLoadError: the IR is not there (one line).
    """
    props = props_of(model)
    xml = runtime_model_path(props, folder)
    if xml is None:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for prop in out.metadata_props:
        if prop.key == RUNTIME_MODEL_KEY:
            prop.value = str(xml)
    return out


def runtime_layers(compiled: Any) -> list[RuntimeLayer]:
    """The layers of an OpenVINO compiled model's runtime graph
    (``get_runtime_model()``: ``layerType``, ``runtimePrecision``, ``originalLayersNames``)."""
    layers = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()

        def text(key: str, info: Any = info) -> str:
            return str(info[key].astype(str)) if key in info else ""

        originals = tuple(n for n in text("originalLayersNames").split(",") if n)
        layers.append(
            RuntimeLayer(
                op.get_friendly_name(), text("layerType"), text("runtimePrecision"), originals
            )
        )
    return layers
