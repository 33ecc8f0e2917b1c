"""Proto helpers that need no ONNX Runtime: light and weightless copies of a model."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from mixprec.core.errors import MixprecError

__all__ = [
    "FILE_SPAN",
    "is_repeated",
    "iter_model_graphs",
    "iter_node_graphs",
    "iter_proto_graphs",
    "iter_proto_tensors",
    "weightless_proto",
]

# Initializers up to this many elements stay in light copies (shape inference may read them).
_LIGHT_MAX_ELEMS = 1024
# Location of external-data placeholders whose arrays are handed to ONNX Runtime in memory.
IN_MEMORY = "__mixprec_in_memory__"
#: ``tensor.meta`` key of a tensor whose bytes are a span of a checked data file:
#: ``(real path, offset)`` (set by :mod:`mixprec.io.external`).
FILE_SPAN = "mixprec.file_span"


def is_repeated(fd: Any) -> bool:
    """Whether protobuf field descriptor ``fd`` is a repeated field."""
    # protobuf >= 5 has ``is_repeated``; ``label`` is gone from newer upb descriptors.
    if hasattr(fd, "is_repeated"):
        return bool(fd.is_repeated)
    return bool(fd.label == fd.LABEL_REPEATED)


def copy_fields(src: Any, dst: Any, skip: frozenset[str]) -> None:
    """Copies every set field of protobuf message ``src`` into ``dst`` except ``skip``."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if is_repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def element_count(dims: Sequence[int]) -> int:
    return math.prod(int(d) for d in dims)


def light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for shape inference: large main-graph initializers become typed graph inputs.

    Shape inference only needs their types and shapes, so this keeps it cheap and
    below the 2 GB protobuf limit.
    """
    light = onnx.ModelProto()
    copy_fields(model, light, frozenset({"graph"}))
    copy_fields(model.graph, light.graph, frozenset({"initializer"}))
    input_names = {vi.name for vi in model.graph.input}
    for t in model.graph.initializer:
        if element_count(t.dims) <= _LIGHT_MAX_ELEMS and t.data_location != TensorProto.EXTERNAL:
            light.graph.initializer.add().CopyFrom(t)
        elif t.name not in input_names:
            light.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    return light


#: dtypes whose arrays ONNX Runtime takes from memory (``add_external_initializers``).
_PLACEHOLDER_DTYPES = frozenset(
    {
        ir.DataType.FLOAT,
        ir.DataType.FLOAT16,
        ir.DataType.DOUBLE,
        ir.DataType.INT64,
        ir.DataType.INT32,
        ir.DataType.INT8,
        ir.DataType.UINT8,
    }
)


def _span_in(tensor: ir.TensorProtocol, folder: str | None) -> tuple[str, int] | None:
    """``(location relative to folder, offset)`` of a tensor that is a file span there."""
    span = tensor.meta.get(FILE_SPAN) if folder else None
    if span is None or folder is None:
        return None
    path, offset = span
    if os.path.commonpath([path, folder]) != folder:
        return None  # not inside the folder the runtime will be told
    return os.path.relpath(path, folder), offset


def _external_ok(tensor: ir.ExternalTensor, name: str) -> bool:
    """Whether ``tensor`` may become a placeholder; refuses one that has no folder.

    ``mixprec.convert`` leaves no external tensor (:mod:`mixprec.io.external`); this guards
    models handed to the stages directly. An external tensor without ``base_dir`` would
    be read relative to the current directory.
    """
    if not os.fspath(tensor.base_dir):
        raise MixprecError(
            f"tensor {name!r} keeps its data in the external file {tensor.location!r} and "
            "has no folder to read it from; run mixprec.io.external.ResolveExternalDataPass"
            "(base_dir=...) first, or convert the model's path"
        )
    return tensor.dtype in _PLACEHOLDER_DTYPES


def weightless_proto(
    model: ir.Model,
    min_bytes: int = 4096,
    *,
    with_arrays: bool = True,
    data_folder: str | None = None,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model`` as a proto whose large main-graph initializers are in-memory placeholders.

    Returns the proto and, with ``with_arrays``, the placeholders' arrays (protobuf hands
    out a copy of each tensor's bytes: skip them when only shapes are needed). Shape work
    reads only dims; ONNX Runtime gets the arrays through ``add_external_initializers``
    (``collect_absmax(external=...)``), which copies them. With ``data_folder``, a tensor
    that is still a span of a checked file in that folder (:data:`FILE_SPAN`) is written
    as a reference to it instead: ONNX Runtime then maps the file itself (no copy) when
    told the folder (``LoadHints(data_folder=...)``). ``model`` is unchanged afterwards.
    """
    swapped: list[tuple[ir.Value, ir.TensorProtocol]] = []
    inlined: list[tuple[ir.Value, ir.TensorProtocol]] = []
    arrays: dict[str, np.ndarray] = {}
    in_memory: set[str] = set()
    in_files: set[str] = set()
    try:
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if tensor is None or value.is_graph_input():
                continue
            if isinstance(tensor, ir.ExternalTensor) and tensor.location == IN_MEMORY:
                in_memory.add(name)  # already a placeholder: its array is the caller's
                continue
            if isinstance(tensor, ir.ExternalTensor) and not _external_ok(tensor, name):
                # A dtype ORT cannot take from memory: its bytes go inline, read from the
                # tensor's own folder, so that no consumer resolves the location again.
                value.const_value = ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=name)
                inlined.append((value, tensor))
                continue
            # External tensors always become placeholders: ORT cannot resolve their files
            # from an in-memory model. Others only when large.
            if tensor.nbytes <= min_bytes and not isinstance(tensor, ir.ExternalTensor):
                continue
            if tensor.dtype not in _PLACEHOLDER_DTYPES:
                continue
            span = _span_in(tensor, data_folder)
            if span is not None:
                value.const_value = ir.ExternalTensor(
                    span[0],
                    span[1],
                    tensor.nbytes,
                    tensor.dtype,
                    shape=tensor.shape,  # type: ignore[arg-type]
                    name=name,
                    base_dir=data_folder or "",
                )
                swapped.append((value, tensor))
                in_files.add(name)
                continue
            if with_arrays:
                arrays[name] = tensor.numpy()
            value.const_value = ir.ExternalTensor(
                IN_MEMORY,
                0,
                tensor.nbytes,
                tensor.dtype,
                shape=ir.Shape([d if isinstance(d, int) else 0 for d in tensor.shape.dims]),
                name=name,
            )
            swapped.append((value, tensor))
        proto = ir.to_proto(model)
    finally:
        for value, tensor in [*swapped, *inlined]:
            value.const_value = tensor
    placeholders = ({value.name for value, _ in swapped} - in_files) | in_memory
    for t in proto.graph.initializer:
        if t.name in placeholders:
            del t.external_data[:]
            entry = t.external_data.add()
            entry.key, entry.value = "location", IN_MEMORY
    return proto, arrays


def iter_proto_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """Yields ``graph`` and all its subgraphs, depth first, in node/attribute order."""
    yield graph
    for node in graph.node:
        yield from iter_node_graphs(node)


def iter_node_graphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs in ``node``'s attributes (If branches, Loop/Scan bodies) and below."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield from iter_proto_graphs(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for sub in attr.graphs:
                yield from iter_proto_graphs(sub)


def iter_model_graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every graph below it, then those inside model-local functions."""
    yield from iter_proto_graphs(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from iter_node_graphs(node)


def iter_proto_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every initializer and tensor attribute (Constant values) in ``graph`` and below."""
    for g in iter_proto_graphs(graph):
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
