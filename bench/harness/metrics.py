"""Static measurements of a (converted) ONNX model: casts, precision shares, MACs.

All walks recurse into subgraphs (If / Loop / Scan bodies). Types and shapes come from
ONNX shape inference run on a copy whose graph inputs are fixed to the bench's concrete
input shapes. A node "runs in low precision" when its first floating-point input is
float16 or bfloat16. MACs are counted for Conv, ConvTranspose, MatMul and Gemm.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
LOW_TYPES = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
MAC_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm"}

Shape = tuple[int, ...]


@dataclass
class ValueInfo:
    elem_type: int | None = None
    shape: Shape | None = None  # None when not fully known


@dataclass
class ModelStats:
    nodes: int = 0
    casts: int = 0
    float_nodes: int = 0  # nodes (other than Cast) with a floating-point input
    low_nodes: int = 0
    unknown_type_nodes: int = 0
    macs_total: int = 0
    macs_low: int = 0
    mac_nodes: int = 0
    mac_nodes_unresolved: int = 0  # MAC ops whose shapes shape inference could not give
    op_types_low: dict[str, int] = field(default_factory=dict)
    shape_inference_error: str | None = None

    @property
    def low_node_share(self) -> float | None:
        return self.low_nodes / self.float_nodes if self.float_nodes else None

    @property
    def low_mac_share(self) -> float | None:
        return self.macs_low / self.macs_total if self.macs_total else None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["low_node_share"] = self.low_node_share
        out["low_mac_share"] = self.low_mac_share
        return out


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def walk_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from walk_nodes(sub)


def count_casts(model: onnx.ModelProto) -> int:
    return sum(1 for n in walk_nodes(model.graph) if n.op_type == "Cast" and n.domain in ("",
                                                                                        "ai.onnx"))


def fix_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Shape]) -> onnx.ModelProto:
    """Copy of ``model`` whose graph inputs carry the given concrete shapes."""
    fixed = copy.deepcopy(model)
    for vi in fixed.graph.input:
        if vi.name not in shapes or not vi.type.HasField("tensor_type"):
            continue
        tensor_type = vi.type.tensor_type
        tensor_type.ClearField("shape")
        tensor_type.shape.SetInParent()
        for dim in shapes[vi.name]:
            tensor_type.shape.dim.add().dim_value = int(dim)
    return fixed


def infer(model: onnx.ModelProto,
          shapes: Mapping[str, Shape]) -> tuple[onnx.ModelProto, str | None]:
    fixed = fix_input_shapes(model, shapes)
    try:
        return onnx.shape_inference.infer_shapes(fixed, strict_mode=False, data_prop=True), None
    except Exception as exc:  # a failing inference is reported, not fatal
        return fixed, f"{type(exc).__name__}: {str(exc)[:300]}"


def _info_from_type(tp: onnx.TypeProto) -> ValueInfo:
    if not tp.HasField("tensor_type"):
        return ValueInfo()
    tt = tp.tensor_type
    shape: Shape | None = None
    if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
        shape = tuple(int(d.dim_value) for d in tt.shape.dim)
    return ValueInfo(tt.elem_type or None, shape)


def _constant_info(node: onnx.NodeProto) -> ValueInfo | None:
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return ValueInfo(attr.t.data_type, tuple(int(d) for d in attr.t.dims))
        if attr.name in ("value_float", "value_floats"):
            shape = () if attr.name == "value_float" else (len(attr.floats),)
            return ValueInfo(TensorProto.FLOAT, shape)
    return None


def value_infos(graph: onnx.GraphProto, outer: Mapping[str, ValueInfo],
                known_shapes: Mapping[str, Shape] | None = None) -> dict[str, ValueInfo]:
    """Type/shape of every value visible in ``graph`` (outer scope included).

    ``known_shapes`` (shapes observed at run time) fill in what inference left unknown.
    """
    infos = dict(outer)
    for init in graph.initializer:
        infos[init.name] = ValueInfo(init.data_type, tuple(int(d) for d in init.dims))
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        known = _info_from_type(vi.type)
        if known.elem_type is not None:
            infos[vi.name] = known
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            info = _constant_info(node)
            if info is not None:
                infos[node.output[0]] = info
    if known_shapes:
        for node in graph.node:
            for name in node.output:
                if name in known_shapes and infos.get(name, ValueInfo()).shape is None:
                    infos[name] = ValueInfo(infos.get(name, ValueInfo()).elem_type,
                                            known_shapes[name])
    return infos


def _prod(values: Shape) -> int:
    return int(np.prod(values, dtype=np.int64)) if values else 1


def node_macs(node: onnx.NodeProto, infos: Mapping[str, ValueInfo]) -> int | None:
    """Multiply-accumulates of one Conv/ConvTranspose/MatMul/Gemm, or None if unknown."""

    def shape(index: int) -> Shape | None:
        if index >= len(node.input) or not node.input[index]:
            return None
        return infos.get(node.input[index], ValueInfo()).shape

    out = infos.get(node.output[0], ValueInfo()).shape if node.output else None
    if node.op_type == "Conv":
        weight = shape(1)
        if out is None or weight is None or len(weight) < 2:
            return None
        return _prod(out) * _prod(weight[1:])
    if node.op_type == "ConvTranspose":
        x, weight = shape(0), shape(1)
        if x is None or weight is None or len(weight) < 2:
            return None
        return _prod(x) * _prod(weight[1:])
    if node.op_type == "MatMul":
        a = shape(0)
        if out is None or a is None or not a:
            return None
        return _prod(out) * a[-1]
    if node.op_type == "Gemm":
        a = shape(0)
        if out is None or a is None or len(a) != 2:
            return None
        trans_a = any(at.name == "transA" and at.i for at in node.attribute)
        return _prod(out) * (a[0] if trans_a else a[1])
    return None


def first_float_input_type(node: onnx.NodeProto, infos: Mapping[str, ValueInfo]) -> int | None:
    """Elem type of the node's first float input; 0 if it has no float input, None if unknown."""
    unknown = False
    for name in node.input:
        if not name:
            continue
        elem = infos.get(name, ValueInfo()).elem_type
        if elem is None:
            unknown = True
            continue
        if elem in FLOAT_TYPES:
            return elem
    return None if unknown else 0


def _walk_stats(graph: onnx.GraphProto, outer: Mapping[str, ValueInfo], stats: ModelStats,
                macs_fallback: Mapping[str, int]) -> None:
    infos = value_infos(graph, outer)
    for node in graph.node:
        stats.nodes += 1
        if node.op_type == "Cast":
            stats.casts += 1
        else:
            elem = first_float_input_type(node, infos)
            if elem is None:
                stats.unknown_type_nodes += 1
            elif elem != 0:
                stats.float_nodes += 1
                if elem in LOW_TYPES:
                    stats.low_nodes += 1
                    stats.op_types_low[node.op_type] = stats.op_types_low.get(node.op_type, 0) + 1
            if node.op_type in MAC_OPS:
                stats.mac_nodes += 1
                macs = node_macs(node, infos)
                if macs is None:
                    macs = macs_fallback.get(node.name)
                if macs is None:
                    stats.mac_nodes_unresolved += 1
                else:
                    stats.macs_total += macs
                    if elem in LOW_TYPES:
                        stats.macs_low += macs
        for sub in subgraphs(node):
            _walk_stats(sub, infos, stats, macs_fallback)


def macs_by_name(model: onnx.ModelProto, shapes: Mapping[str, Shape],
                 known_shapes: Mapping[str, Shape] | None = None) -> dict[str, int]:
    """MACs of every named MAC node (used to fill in nodes a converted model leaves unknown)."""
    inferred, _ = infer(model, shapes)
    result: dict[str, int] = {}

    def visit(graph: onnx.GraphProto, outer: Mapping[str, ValueInfo]) -> None:
        infos = value_infos(graph, outer, known_shapes)
        for node in graph.node:
            if node.op_type in MAC_OPS and node.name:
                macs = node_macs(node, infos)
                if macs is not None:
                    result[node.name] = macs
            for sub in subgraphs(node):
                visit(sub, infos)

    visit(inferred.graph, {})
    return result


def model_stats(model: onnx.ModelProto, shapes: Mapping[str, Shape],
                macs_fallback: Mapping[str, int] | None = None) -> ModelStats:
    inferred, error = infer(model, shapes)
    stats = ModelStats(shape_inference_error=error)
    _walk_stats(inferred.graph, {}, stats, macs_fallback or {})
    return stats


def _outer_references(graph: onnx.GraphProto) -> list[str]:
    """Values a subgraph (or its own subgraphs) reads from enclosing scopes."""
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    local |= {o for node in graph.node for o in node.output}
    used = {name for node in graph.node for name in node.input if name}
    used |= {out.name for out in graph.output}
    for node in graph.node:
        for sub in subgraphs(node):
            used |= set(_outer_references(sub))
    return sorted(used - local)


def _run_exposing_all(graph: onnx.GraphProto, opsets: list[onnx.OperatorSetIdProto],
                      ir_version: int, feeds: Mapping[str, np.ndarray],
                      extra_inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Runs ``graph`` as a model whose outputs are every node output of its top level."""
    import onnxruntime as ort

    g = copy.deepcopy(graph)
    for name, array in extra_inputs.items():
        g.input.append(onnx.helper.make_tensor_value_info(
            name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype), array.shape))
    declared = {o.name for o in g.output}
    for node in g.node:
        for name in node.output:
            if name and name not in declared:
                g.output.append(onnx.ValueInfoProto(name=name))
                declared.add(name)
    model = onnx.helper.make_model(g, opset_imports=opsets)
    model.ir_version = ir_version
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    all_feeds = {k: v for k, v in {**feeds, **extra_inputs}.items() if k in inputs}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, all_feeds), strict=True))


def runtime_shapes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, Shape]:
    """Shapes of every value observed by running ``model`` on ``feeds`` in ONNX Runtime.

    The main graph runs with all its values exposed as outputs. If-branch bodies are then
    run standalone, fed with the outer-scope values they read, so their shapes are known
    too (both branches are tried; one that fails is skipped).
    """
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # a branch that cannot run alone is expected here
    shapes: dict[str, Shape] = {}
    try:
        values = _run_exposing_all(model.graph, list(model.opset_import), model.ir_version,
                                   feeds, {})
    except Exception:  # shapes then come from static inference only
        return shapes
    shapes.update({k: tuple(np.shape(v)) for k, v in values.items()})
    scope = {**dict(feeds), **values}
    for node in model.graph.node:
        if node.op_type != "If":
            continue
        for sub in subgraphs(node):
            refs = _outer_references(sub)
            if not all(r in scope for r in refs):
                continue
            try:
                sub_values = _run_exposing_all(
                    sub, list(model.opset_import), model.ir_version, {},
                    {r: np.asarray(scope[r]) for r in refs})
            except Exception:  # a branch that cannot run alone is skipped
                continue
            shapes.update({k: tuple(np.shape(v)) for k, v in sub_values.items()})
    ort.set_default_logger_severity(2)
    return shapes
