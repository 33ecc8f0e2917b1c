"""What the HTML report draws: each graph's nodes and edges with their precision and details.

Read from one place only: the decisions the stages recorded (the :class:`Report`'s rows,
built from ``node.meta``; for a model that was not converted, ``node.meta`` itself), the
calibration on ``model.meta``, and the model's own Cast / QuantizeLinear /
DequantizeLinear nodes. Decisions are attached to the drawn nodes by node name, so the
picture of a converted model shows what was done and why.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import CALIBRATION, MACS, Calibration
from mixprec.core.constants import const_tensor
from mixprec.core.graphs import subgraphs_of
from mixprec.core.ops import FLOAT_TYPES, QDQ_OPS, is_onnx_domain
from mixprec.core.policy import SHAPE_ONLY_OPS
from mixprec.int8.params import activation_qparams
from mixprec.io.protos import iter_proto_graphs, weightless_proto
from mixprec.pipeline.report import NodeReport, Report, node_row

__all__ = ["GraphView", "NodeView", "build_views", "node_precision"]

#: Edge colour classes by dtype.
_EDGE_KIND = {
    ir.DataType.FLOAT: "f32",
    ir.DataType.DOUBLE: "f32",
    ir.DataType.FLOAT16: "f16",
    ir.DataType.BFLOAT16: "bf16",
    ir.DataType.INT8: "i8",
    ir.DataType.UINT8: "i8",
}
#: What each precision class is called on the page.
PRECISION_LABELS = {
    "fp32": "FP32",
    "fp16": "FP16",
    "bf16": "BF16",
    "int8": "INT8",
    "int4": "INT4",
    "int": "integer / shape",
    "cast": "Cast",
    "qdq": "Q / DQ",
    "io": "graph input / output",
}


@dataclass
class NodeView:
    """One drawn box: a node, or a graph input/output."""

    id: str
    label: str
    name: str
    precision: str  # a key of PRECISION_LABELS
    detail: dict[str, Any]
    macs: int = 0
    op_type: str = ""
    small: bool = False  # drawn as a small box (Constant nodes)


@dataclass
class GraphView:
    """One graph (the main graph or an If/Loop/Scan body) ready to lay out."""

    id: str
    title: str
    nodes: list[NodeView] = field(default_factory=list)
    edges: list[tuple[int, int, str]] = field(default_factory=list)  # (from, to, dtype kind)
    #: Layout weight of each edge: a node's first input from a computing node weighs
    #: more, so the main data path runs straight down past side inputs.
    weights: list[int] = field(default_factory=list)


Dtypes = dict[str, ir.DataType]


def _dtype(value: ir.Value, dtypes: Dtypes | None) -> ir.DataType | None:
    """The value's dtype; a converted model forgets intermediate types (only what the
    input annotated is written), so those come from ``dtypes`` (inferred by name)."""
    if value.dtype is not None:
        return value.dtype
    return dtypes.get(value.name or "") if dtypes else None


def _is_float(value: ir.Value | None, dtypes: Dtypes | None) -> bool:
    return value is not None and _dtype(value, dtypes) in FLOAT_TYPES


def _edge_kind(value: ir.Value, dtypes: Dtypes) -> str:
    dtype = _dtype(value, dtypes)
    return _EDGE_KIND.get(dtype, "other") if dtype is not None else "other"


def inferred_dtypes(model: ir.Model) -> Dtypes:
    """Element types of every value by name, from onnx type inference on a weightless
    copy (empty when inference fails: the page then shows unknown types as "other")."""
    found: Dtypes = {}
    try:
        proto, _ = weightless_proto(model, with_arrays=False)
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # best effort: a picture never fails for want of types
        return found

    for graph in iter_proto_graphs(inferred.graph):
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                found[vi.name] = ir.DataType(vi.type.tensor_type.elem_type)
        for init in graph.initializer:
            found[init.name] = ir.DataType(init.data_type)
    return found


def _dims(value: ir.Value) -> list[int | str] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else str(d) for d in value.shape]


def _tensor_text(value: ir.Value, shapes: dict[str, list[int]], dtypes: Dtypes) -> dict[str, Any]:
    name = value.name or ""
    dims = shapes.get(name) or _dims(value)
    known = _dtype(value, dtypes)
    dtype = known.name.lower() if known is not None else "?"
    return {"name": name, "dtype": dtype, "shape": dims}


def _qparams_text(node: ir.Node) -> str | None:
    """``scale s zp z`` of a QuantizeLinear / DequantizeLinear node's constant inputs."""
    scale = const_tensor(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    if scale is None:
        return None
    s = np.asarray(scale.numpy(), dtype=np.float64)
    zp_in = node.inputs[2] if len(node.inputs) > 2 else None
    zp = const_tensor(zp_in) if zp_in is not None else None
    z = np.asarray(zp.numpy()).astype(np.int64) if zp is not None else np.zeros(1, np.int64)
    if s.size == 1:
        return f"scale {float(s.reshape(-1)[0]):.4g}, zero point {int(z.reshape(-1)[0])}"
    return f"per-channel scale {s.min():.3g}..{s.max():.3g} ({s.size} channels)"


def node_precision(
    node: ir.Node, row: NodeReport | None, target: str, dtypes: Dtypes | None = None
) -> str:
    """The precision class a drawn node is coloured by."""
    if node.op_type == "Cast" and is_onnx_domain(node.domain):
        return "cast"
    if node.op_type in QDQ_OPS:
        return "qdq"
    if node.op_type in SHAPE_ONLY_OPS and is_onnx_domain(node.domain):
        return "int"
    if not any(_is_float(v, dtypes) for v in [*node.inputs, *node.outputs]):
        return "int"
    if row is not None:
        if row.precision in ("int8", "int4"):  # INT8, or weight-only int8/int4
            return row.precision
        if row.precision == "low":
            return "bf16" if target == "bfloat16" else "fp16"
        return "fp32"
    found = {_dtype(v, dtypes) for v in node.outputs if _is_float(v, dtypes)}
    if ir.DataType.FLOAT16 in found:
        return "fp16"
    if ir.DataType.BFLOAT16 in found:
        return "bf16"
    return "fp32"


def _rows_from_meta(model: ir.Model, graphs: list[ir.Graph]) -> dict[str, NodeReport]:
    """Report rows read straight from ``node.meta`` (a model given without a report)."""
    rows = (node_row(node) for graph in graphs for node in graph)
    return {row.name: row for row in rows if row is not None}


def _walk(graph: ir.Graph, gid: str, title: str) -> Iterator[tuple[ir.Graph, str, str]]:
    yield graph, gid, title
    k = 0
    for node in graph:
        for name, attr in node.attributes.items():
            subs = []
            if attr.type == ir.AttributeType.GRAPH:
                subs = [attr.as_graph()]
            elif attr.type == ir.AttributeType.GRAPHS:
                subs = list(attr.as_graphs())
            for j, sub in enumerate(subs):
                k += 1
                suffix = f"[{j}]" if len(subs) > 1 else ""
                label = f"{node.op_type} {node.name or '?'} / {name}{suffix}"
                yield from _walk(sub, f"{gid}.{k}", label)


def build_views(model: ir.Model, report: Report | None) -> list[GraphView]:
    """The main graph and every subgraph as :class:`GraphView` objects (main first)."""
    walked = list(_walk(model.graph, "g0", "main graph"))
    graphs = [g for g, _, _ in walked]
    rows = {r.name: r for r in report.nodes} if report is not None else {}
    if not rows:
        rows = _rows_from_meta(model, graphs)
    target = report.target if report is not None else "float16"
    calibration = model.meta.get(CALIBRATION)
    calib = calibration if isinstance(calibration, Calibration) else Calibration()
    shapes = dict(calib.shapes)
    body_ids: dict[int, list[tuple[str, str]]] = {}
    for sub, gid, title in walked[1:]:
        body_ids.setdefault(id(sub), []).append((gid, title))
    untyped = any(
        v.dtype is None for g in graphs for node in g for v in node.outputs if v is not None
    )
    ctx = _Context(rows, target, calib, shapes, body_ids, inferred_dtypes(model) if untyped else {})
    return [_graph_view(graph, gid, title, ctx) for graph, gid, title in walked]


@dataclass
class _Context:
    """What every node's view reads: decisions, target, calibration, shapes, types."""

    rows: dict[str, NodeReport]
    target: str
    calib: Calibration
    shapes: dict[str, list[int]]
    body_ids: dict[int, list[tuple[str, str]]]
    dtypes: Dtypes


def _graph_view(graph: ir.Graph, gid: str, title: str, ctx: _Context) -> GraphView:
    view = GraphView(gid, title)
    index: dict[ir.Value, int] = {}  # value -> drawn producer
    initializers = set(graph.initializers.values())
    for value in graph.inputs:
        if value in initializers:
            continue
        index[value] = len(view.nodes)
        view.nodes.append(
            NodeView(
                f"{gid}_i{len(view.nodes)}",
                value.name or "input",
                value.name or "",
                "io",
                {"kind": "graph input", "tensor": _tensor_text(value, ctx.shapes, ctx.dtypes)},
            )
        )
    nodes = list(graph)
    first = len(view.nodes)
    constants = set()
    for k, node in enumerate(nodes, start=first):
        for out in node.outputs:
            index[out] = k
        if node.op_type == "Constant":
            constants.add(k)
    seen: set[tuple[int, int]] = set()
    for k, node in enumerate(nodes, start=first):
        view.nodes.append(_node_view(node, f"{gid}_n{k}", ctx))
        for slot, used in enumerate(node.inputs):
            src = index.get(used) if used is not None else None
            if used is not None and src is not None and (src, k) not in seen:
                seen.add((src, k))
                view.edges.append((src, k, _edge_kind(used, ctx.dtypes)))
                side = slot > 0 or src in constants
                view.weights.append(1 if side else 10)
    for value in graph.outputs:
        k = len(view.nodes)
        view.nodes.append(
            NodeView(
                f"{gid}_o{k}",
                value.name or "output",
                value.name or "",
                "io",
                {"kind": "graph output", "tensor": _tensor_text(value, ctx.shapes, ctx.dtypes)},
            )
        )
        src = index.get(value)
        if src is not None:
            view.edges.append((src, k, _edge_kind(value, ctx.dtypes)))
            view.weights.append(10)
    return view


def _node_view(node: ir.Node, nid: str, ctx: _Context) -> NodeView:
    row = ctx.rows.get(node.name or "")
    calib = ctx.calib
    precision = node_precision(node, row, ctx.target, ctx.dtypes)
    op = node.op_type if is_onnx_domain(node.domain) else f"{node.domain}::{node.op_type}"
    detail: dict[str, Any] = {
        "op": op,
        "name": node.name or "",
        "precision": PRECISION_LABELS[precision],
        "outputs": [_tensor_text(v, ctx.shapes, ctx.dtypes) for v in node.outputs],
    }
    if row is not None:
        detail.update(list_class=row.op_class, step=row.step, reason=row.reason)
    elif precision == "cast":
        detail["reason"] = "inserted or kept by the conversion: changes a tensor's dtype"
    elif precision == "qdq":
        detail["reason"] = "quantizes or dequantizes a tensor at an INT8 boundary"
    elif precision == "int":
        detail["reason"] = "not painted: no float tensor in or out"
    macs = row.macs if row is not None else int(node.meta.get(MACS, 0))
    if macs:
        detail["macs"] = macs
    ranges = []
    for v in node.outputs:
        name = v.name or ""
        stat = calib.stats.get(name)
        lo, hi = getattr(stat, "min", None), getattr(stat, "max", None)
        if lo is not None and hi is not None:
            ranges.append(f"{name}: min {lo:.4g}, max {hi:.4g}")
        elif name in calib.absmax:
            ranges.append(f"{name}: |x| max {calib.absmax[name]:.4g}")
    if ranges:
        detail["calibrated"] = ranges
    qparams = _node_qparams(node)
    if not qparams and precision == "int8":
        qparams = _planned_qparams(node, calib)
    if qparams:
        detail["qparams"] = qparams
    bodies = [sub for sub in subgraphs_of(node)]
    if bodies:
        detail["bodies"] = [entry for sub in bodies for entry in ctx.body_ids.get(id(sub), [])]
    name = node.name or ""
    small = node.op_type == "Constant" and is_onnx_domain(node.domain)
    return NodeView(nid, op, name, precision, detail, macs, node.op_type, small)


def _planned_qparams(node: ir.Node, calib: Calibration) -> list[str]:
    """For an INT8 plan (no Q/DQ yet): the output scale and zero point ``quantize``'s
    defaults (MinMax, uint8 activations) would give from the calibrated range."""
    found = []
    for value in node.outputs:
        stats = calib.stats.get(value.name or "")
        if stats is None or getattr(stats, "min", None) is None:
            continue
        params = activation_qparams(stats, "minmax", unsigned=True)
        if not isinstance(params, str):
            found.append(f"output {value.name} (planned, MinMax uint8): {params.describe()}")
    return found


def _node_qparams(node: ir.Node) -> list[str]:
    """Scale and zero point of the node's own Q/DQ, or of the DQ feeding it and the Q
    after it (an INT8 node of a QDQ model)."""
    if node.op_type in QDQ_OPS:
        text = _qparams_text(node)
        return [text] if text else []
    found = []
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "DequantizeLinear":
            text = _qparams_text(producer)
            if text:
                found.append(f"input {value.name}: {text}")  # type: ignore[union-attr]
    for value in node.outputs:
        for user, _ in value.uses():
            if user.op_type == "QuantizeLinear":
                text = _qparams_text(user)
                if text:
                    found.append(f"output {value.name}: {text}")
                break
    return found
