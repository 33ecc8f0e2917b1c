"""A model's input signature: the graph inputs a caller feeds, their element types and
declared dims (shared by generated inputs, :mod:`mixprec.inputs.feeds`, and given samples,
:mod:`mixprec.inputs.samples`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import BF16

__all__ = [
    "BF16",
    "Feeds",
    "ModelArg",
    "as_ir",
    "declared_dims",
    "dtype_of",
    "first_line",
    "fmt_dims",
    "graph_inputs",
    "signature_only",
]


ModelArg = onnx.ModelProto | ir.Model
Feeds = Mapping[str, np.ndarray]


def as_ir(model: ModelArg) -> ir.Model:
    """``model`` as an ``onnx_ir.Model`` (a proto is wrapped; weight bytes are shared)."""
    return model if isinstance(model, ir.Model) else ir.from_proto(model)


def signature_only(model: ModelArg) -> ir.Model:
    """A model holding only ``model``'s graph inputs that a caller feeds (names, element
    types, dims): what a sample reader checks samples against, without keeping the
    weights alive beside the pipeline's own copy of the model (MiniLM: 86 MB)."""
    source = as_ir(model)
    inputs = [ir.Value(name=v.name, type=v.type, shape=v.shape) for v in graph_inputs(source)]
    graph = ir.Graph(inputs, [], nodes=[], opset_imports=dict(source.opset_imports))
    return ir.Model(graph, ir_version=source.ir_version)


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error message, at most 400 characters."""
    for line in str(error).splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= 400 else text[:397] + "..."
    return type(error).__name__


def graph_inputs(model: ir.Model) -> list[ir.Value]:
    """Graph inputs a caller must feed (those that are not also initializers)."""
    inits = model.graph.initializers
    return [v for v in model.graph.inputs if v.name not in inits]


def dtype_of(value: ir.Value) -> ir.DataType:
    if not isinstance(value.type, ir.TensorType):
        kind = type(value.type).__name__ if value.type is not None else "value of unknown type"
        raise MixprecError(f"input {value.name!r} is a {kind}, not a tensor; mixprec needs tensors")
    return value.type.dtype


def declared_dims(value: ir.Value) -> list[int | str | None] | None:
    if value.shape is None:
        return None
    dims: list[int | str | None] = []
    for d in value.shape.dims:
        if isinstance(d, int) and d > 0:
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value:
            dims.append(d.value)
        else:
            dims.append(None)
    return dims


def fmt_dims(dims: Sequence[int | str | None]) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in dims) + "]"
