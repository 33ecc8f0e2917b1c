"""How a model reaches an engine, whichever it is: the protobuf size limit, the
external-data skeleton of a model over it, a file an engine can read, one-node probe
models (kernel lookups), and the thread cap.

Models larger than 2 GB cannot be serialized as one protobuf message: they are handed to
an engine as a file whose initializers live in an external-data file beside it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import TensorProto, numpy_helper

from mixprec.core.config import THREADS_ENV
from mixprec.core.errors import MixprecError
from mixprec.core.limits import INLINE_LIMIT
from mixprec.io.protos import IN_MEMORY, copy_fields, element_count

__all__ = [
    "check_external",
    "external_skeleton",
    "model_file",
    "probe_model",
    "skeleton_file",
    "thread_cap",
]

# Packed sub-byte types: numpy holds them one element per byte, so raw bytes differ.
_PACKED_TYPES = frozenset(
    getattr(TensorProto, n)
    for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(TensorProto, n)
)


def external_skeleton(model: onnx.ModelProto, directory: Path) -> onnx.ModelProto:
    """Writes the main graph's initializers to ``directory/model.onnx.data``.

    Returns a copy of ``model`` whose initializers refer to that file. ``model`` itself
    is left untouched, and only one tensor's bytes are duplicated at a time.
    """
    data_name = "model.onnx.data"
    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, frozenset({"graph"}))
    copy_fields(model.graph, skeleton.graph, frozenset({"initializer"}))
    data_fields = frozenset(
        {
            "raw_data",
            "float_data",
            "int32_data",
            "string_data",
            "int64_data",
            "double_data",
            "uint64_data",
            "external_data",
            "data_location",
        }
    )
    offset = 0
    with open(directory / data_name, "wb") as f:
        for t in model.graph.initializer:
            keep_inline = (
                t.data_location == TensorProto.EXTERNAL
                or t.data_type in (TensorProto.STRING, *_PACKED_TYPES)
                or element_count(t.dims) < 1024
            )
            if keep_inline:
                skeleton.graph.initializer.add().CopyFrom(t)
                continue
            raw = t.raw_data if t.raw_data else numpy_helper.to_array(t).tobytes()
            nt = skeleton.graph.initializer.add()
            copy_fields(t, nt, data_fields)
            for key, value in (("location", data_name), ("offset", offset), ("length", len(raw))):
                entry = nt.external_data.add()
                entry.key = key
                entry.value = str(value)
            nt.data_location = TensorProto.EXTERNAL
            f.write(raw)
            offset += len(raw)
    if skeleton.ByteSize() > INLINE_LIMIT:
        raise MixprecError(
            "the model is over 2 GB even without its initializers (large Constant nodes?); "
            "save it with external data and pass its path"
        )
    return skeleton


def _is_in_memory(t: TensorProto) -> bool:
    return any(e.key == "location" and e.value == IN_MEMORY for e in t.external_data)


def check_external(model: onnx.ModelProto) -> None:
    """Raises when an initializer's external data is not loaded (a proto cannot carry it)."""
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL and not _is_in_memory(t):
            raise MixprecError(
                f"initializer {t.name!r} has external data that is not loaded; load the model "
                "with onnx.load(path) or pass its path"
            )


def thread_cap(threads: int) -> int:
    """``threads`` (0: ORT's choice, all cores) capped by :data:`THREADS_ENV` when set."""
    text = os.environ.get(THREADS_ENV, "")
    cap = int(text) if text.isdigit() and int(text) > 0 else 0
    if cap == 0:
        return threads
    return cap if threads <= 0 else min(threads, cap)


def probe_model(node: ir.Node, opsets: Mapping[str, int]) -> onnx.ModelProto | None:
    """A one-node model of ``node`` (its inputs as graph inputs, with their dtypes) at
    ``opsets``: what an engine needs to look its kernel up. None when it cannot stand alone."""
    if any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values()
    ):
        return None
    values = [v for v in node.inputs if v is not None]
    if any(v.dtype is None for v in values) or any(v.dtype is None for v in node.outputs):
        return None
    proto = ir.serde.serialize_node(node)
    inputs = {v.name or "": int(v.dtype or 0) for v in values}
    outputs = {v.name: int(v.dtype or 0) for v in node.outputs if v.name}
    graph = onnx.helper.make_graph(
        [proto],
        "probe",
        [onnx.helper.make_tensor_value_info(n, t, None) for n, t in inputs.items()],
        [onnx.helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
    )
    opset_imports = [onnx.helper.make_opsetid(d, v) for d, v in opsets.items()]
    return onnx.helper.make_model(graph, opset_imports=opset_imports, ir_version=10)


def model_file(model: onnx.ModelProto | bytes | str | os.PathLike[str], tmp: Path) -> str:
    """A path an engine can read ``model`` from (an in-memory model is saved in ``tmp``,
    with external data when it is over the protobuf limit)."""
    if isinstance(model, str | os.PathLike):
        return os.fspath(model)
    path = tmp / "model.onnx"
    if isinstance(model, bytes | bytearray):
        path.write_bytes(model)
    elif model.ByteSize() <= INLINE_LIMIT:
        check_external(model)
        onnx.save_model(model, path)
    else:
        return skeleton_file(model, tmp)
    return str(path)


def skeleton_file(model: onnx.ModelProto, tmp: Path) -> str:
    """``model`` saved as ``tmp/model.onnx``, its initializers in an external-data file
    beside it (:func:`external_skeleton`); the path."""
    path = tmp / "model.onnx"
    onnx.save_model(external_skeleton(model, tmp), path)
    return str(path)
