"""Multiply-accumulates of a model's Conv/ConvTranspose/MatMul/Gemm nodes, from concrete
shapes (onnx shape inference on a weightless copy) and the op registry's MAC formulas."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import onnx

from mixprec.core.registry import MacArgs, op_info
from mixprec.io.protos import iter_proto_graphs, light_copy

__all__ = ["concrete_shapes", "count_macs"]


def _shape_map(graph: onnx.GraphProto, out: dict[str, list[int | None]]) -> None:
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            out[vi.name] = [
                d.dim_value if d.HasField("dim_value") else None
                for d in vi.type.tensor_type.shape.dim
            ]
    for init in graph.initializer:
        out[init.name] = list(init.dims)
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    out[node.output[0]] = list(attr.t.dims)
        for attr in node.attribute:
            if attr.HasField("g"):
                _shape_map(attr.g, out)
            for g in attr.graphs:
                _shape_map(g, out)


def _known(shape: Sequence[int | None] | None) -> list[int] | None:
    """``shape`` as plain ints when every dim is known and positive, else None."""
    if shape is None or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    return [int(d) for d in shape if d is not None]


def concrete_shapes(
    proto: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]
) -> tuple[onnx.ModelProto, dict[str, list[int | None]]]:
    """Shapes of every value, by name, with the inputs fixed to ``input_shapes``.

    Shapes come from onnx shape inference on a copy; returns that copy and the map.
    """
    m = light_copy(proto)  # no weight payloads: shapes only need dims
    for graph_input in m.graph.input:
        dims = input_shapes.get(graph_input.name)
        if dims is None or not graph_input.type.HasField("tensor_type"):
            continue
        shape = graph_input.type.tensor_type.shape
        del shape.dim[:]
        for d in dims:
            shape.dim.add().dim_value = int(d)
    # Stale or wrong declarations (Paddle writes -1 dims) would pin shapes: infer afresh.
    del m.graph.value_info[:]
    for graph_output in m.graph.output:
        if graph_output.type.HasField("tensor_type"):
            graph_output.type.tensor_type.ClearField("shape")
    with contextlib.suppress(Exception):  # shape inference is best effort here
        m = onnx.shape_inference.infer_shapes(m, data_prop=True)
    shapes: dict[str, list[int | None]] = {}
    _shape_map(m.graph, shapes)
    return m, shapes


def count_macs(
    proto: onnx.ModelProto, shapes: Mapping[str, Sequence[int | None]]
) -> dict[str, int]:
    """Multiply-accumulates of each node whose op has a MAC formula in the op registry
    (Conv, ConvTranspose, MatMul, Gemm), by node name.

    ``shapes`` comes from :func:`concrete_shapes`; nodes with unknown shapes count 0.
    """
    macs: dict[str, int] = {}
    for graph in iter_proto_graphs(proto.graph):
        for node in graph.node:
            formula = op_info(node.op_type, node.domain).macs
            if formula is None:
                continue
            args = MacArgs(
                inputs=[_known(shapes.get(name)) for name in node.input],
                outputs=[_known(shapes.get(name)) for name in node.output],
                ints={a.name: int(a.i) for a in node.attribute if a.type == a.INT},
            )
            macs[node.name] = formula(args)
    return macs
