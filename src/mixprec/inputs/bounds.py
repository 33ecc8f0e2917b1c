"""Lower bounds on a model's symbolic input lengths, read from the ops the inputs reach.

A generated input must be long enough for the ops that read it directly: a reflect
``Pad`` needs more samples than its pad width, a ``Conv`` or pooling window at least its
kernel (less the padding), an ``STFT`` at least one frame. :func:`length_bounds` reads
them from every graph (subgraphs too, which see the main graph's inputs by name);
:func:`~mixprec.inputs.feeds.resolve_input_shapes` guesses at least that much.

When such an op still refuses a generated input, :func:`length_readers` says which guessed
input dims its length axes carry (followed through the graph by ONNX shape inference), so
that only those grow (:func:`~mixprec.runtime.fit.fit_shapes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import iter_nodes
from mixprec.core.ops import is_onnx_domain, onnx_opset
from mixprec.io.protos import iter_model_graphs, weightless_proto

__all__ = ["LENGTH_OPS", "LENGTH_STEPS", "length_bounds", "length_readers", "next_step"]

#: The lengths a guessed dim takes: the default first, then longer ones.
LENGTH_STEPS = (64, 256, 512, 1024, 4096)

Bound = tuple[int, str]  # (the least length, why)


def next_step(at_least: int) -> int:
    """The first of :data:`LENGTH_STEPS` that is at least ``at_least`` (else itself)."""
    return next((s for s in LENGTH_STEPS if s >= at_least), at_least)


#: Ops whose output depends on more than their inputs' values: never folded here.
_UNFOLDED = frozenset(
    {"Shape", "Size", "If", "Loop", "Scan", "RandomNormal", "RandomUniform"}
    | {"RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
#: At most this many nodes are evaluated to fold one value.
_FOLD_LIMIT = 40


def _constant_nodes(value: ir.Value) -> tuple[list[ir.Node], dict[str, np.ndarray]] | None:
    """The nodes that compute ``value`` from constants alone (topological order) and
    those constants; None when it depends on anything else."""
    nodes: dict[int, ir.Node] = {}
    leaves: dict[str, np.ndarray] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        name = v.name or ""
        if name in leaves:
            continue
        tensor = const_tensor(v)
        if tensor is not None:
            leaves[name] = np.asarray(tensor.numpy())
            continue
        node = v.producer()
        if node is None or node.op_type in _UNFOLDED or not is_onnx_domain(node.domain):
            return None
        if id(node) not in nodes:
            if len(nodes) >= _FOLD_LIMIT:
                return None
            nodes[id(node)] = node
            stack.extend(i for i in node.inputs if i is not None)
    done: set[str] = set(leaves)
    ordered: list[ir.Node] = []
    pending = list(nodes.values())
    while pending:  # Kahn's order over the few nodes collected
        ready = [n for n in pending if all(i is None or i.name in done for i in n.inputs)]
        if not ready:
            return None
        for n in ready:
            ordered.append(n)
            done.update(o.name or "" for o in n.outputs)
            pending.remove(n)
    return ordered, leaves


def _fold(value: ir.Value, opset: int) -> np.ndarray | None:
    """``value`` evaluated by ONNX's reference evaluator when constants alone give it."""
    found = _constant_nodes(value)
    if found is None:
        return None
    nodes, leaves = found
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes],
        "fold",
        [],
        [onnx.helper.make_tensor_value_info(value.name or "", onnx.TensorProto.UNDEFINED, None)],
        [onnx.numpy_helper.from_array(a, k) for k, a in leaves.items()],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        outputs: list[Any] = list(ReferenceEvaluator(proto).run(None, {}))
        return np.asarray(outputs[0])
    except Exception:  # a best-effort read: no bound from this value
        return None


def _ints(value: ir.Value | None, opset: int) -> list[int] | None:
    """A constant int tensor's values, folded from constants when computed from them."""
    if value is None:
        return None
    tensor = const_tensor(value)
    array = np.asarray(tensor.numpy()) if tensor is not None else _fold(value, opset)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(x) for x in array.reshape(-1)]


def _pad_bounds(node: ir.Node, rank: int, opset: int) -> Iterator[tuple[int, Bound]]:
    mode = node.attributes.get("mode")
    if mode is None or mode.as_string() != "reflect":
        return
    pads = _ints(node.inputs[1] if len(node.inputs) > 1 else None, opset)
    axes = _ints(node.inputs[3] if len(node.inputs) > 3 else None, opset) or list(range(rank))
    if pads is None or len(pads) != 2 * len(axes):
        return
    for i, axis in enumerate(axes):
        width = max(pads[i], pads[i + len(axes)])
        if width > 0:
            yield axis % rank, (width + 1, f"the reflect Pad {node.name!r} pads {width}")


def _window_bounds(node: ir.Node, rank: int, opset: int) -> Iterator[tuple[int, Bound]]:
    kernel = node.attributes.get("kernel_shape")
    sizes = list(kernel.as_ints()) if kernel is not None else None
    if sizes is None and node.op_type == "Conv" and len(node.inputs) > 1:
        weight = node.inputs[1]
        if weight is not None and weight.shape is not None:
            sizes = [d if isinstance(d, int) else 0 for d in list(weight.shape)[2:]]
    pads_attr = node.attributes.get("pads")
    pads = list(pads_attr.as_ints()) if pads_attr is not None else [0] * (2 * len(sizes or []))
    for i, k in enumerate(sizes or []):
        need = k - pads[i] - pads[i + len(sizes or [])] if len(pads) == 2 * len(sizes or []) else k
        if need > 1:
            yield 2 + i, (need, f"the {node.op_type} {node.name!r} has a window of {k}")


def _stft_bounds(node: ir.Node, rank: int, opset: int) -> Iterator[tuple[int, Bound]]:
    frame = _ints(node.inputs[3] if len(node.inputs) > 3 else None, opset)
    if frame:
        yield 1, (frame[0], f"the STFT {node.name!r} takes frames of {frame[0]}")


_READERS = {
    "Pad": _pad_bounds,
    "Conv": _window_bounds,
    "AveragePool": _window_bounds,
    "MaxPool": _window_bounds,
    "LpPool": _window_bounds,
    "STFT": _stft_bounds,
}


def length_bounds(model: ir.Model) -> dict[tuple[str, int], Bound]:
    """``{(input, axis): (least length, why)}`` for the graph inputs that ops read
    directly; the largest bound per dim wins."""
    inputs = {v.name: v for v in model.graph.inputs if v.name}
    opset = onnx_opset(model.opset_imports, 17)
    found: dict[tuple[str, int], Bound] = {}
    for node in iter_nodes(model.graph):
        reader = _READERS.get(node.op_type)
        first = node.inputs[0] if node.inputs else None
        if reader is None or first is None or not is_onnx_domain(node.domain):
            continue
        source = inputs.get(first.name or "")
        if source is None or source.shape is None:
            continue
        rank = len(source.shape)
        for axis, bound in reader(node, rank, opset):
            key = (first.name or "", axis)
            if axis < rank and bound[0] > found.get(key, (0, ""))[0]:
                found[key] = bound
    return found


#: Ops that refuse a first input too short for them, and its length axes: ``None`` for
#: every axis (a Pad), ``2`` for the spatial ones (from 2 on), ``-1`` for the ``axis``
#: attribute's (a Gather index past the end), else the one axis.
LENGTH_OPS: dict[str, int | None] = {
    "Pad": None,
    "Gather": -1,
    "Conv": 2,
    "ConvTranspose": 2,
    "AveragePool": 2,
    "MaxPool": 2,
    "LpPool": 2,
    "STFT": 1,
}

Readers = dict[str, dict[int, list[tuple[str, int]]]]


def _tagged_proto(
    model: ir.Model, guessed: Mapping[tuple[str, int], str]
) -> tuple[onnx.ModelProto, dict[str, list[tuple[str, int]]]]:
    """A weightless copy whose guessed input dims each carry a symbol (the declared one,
    or a fresh one for an unnamed dim), and ``{symbol: [(input, axis), ...]}``."""
    proto, _ = weightless_proto(model, with_arrays=False)
    for graph in iter_model_graphs(proto):
        del graph.value_info[:]  # inferred afresh, from the tagged dims
    symbols: dict[str, list[tuple[str, int]]] = {}
    for vi in proto.graph.input:
        for k, dim in enumerate(vi.type.tensor_type.shape.dim):
            label = guessed.get((vi.name, k))
            if label is None:
                continue
            symbol = label if label != "?" else f"mixprec.guess.{vi.name}.{k}"
            dim.Clear()
            dim.dim_param = symbol
            symbols.setdefault(symbol, []).append((vi.name, k))
    return proto, symbols


def length_readers(model: ir.Model, guessed: Mapping[tuple[str, int], str]) -> Readers:
    """``{node name: {axis: [(input, axis), ...]}}``: for each op of :data:`LENGTH_OPS`,
    the guessed input dims that its first input's length axes carry, found by ONNX shape
    inference (strict off; on failure, the ops that read a graph input directly)."""
    proto, symbols = _tagged_proto(model, guessed)
    # a best-effort read: on failure the graph inputs' own dims still tell
    with contextlib.suppress(Exception):
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    dims: dict[str, list[str]] = {}
    for graph in iter_model_graphs(proto):
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
                dims[vi.name] = [d.dim_param for d in vi.type.tensor_type.shape.dim]
    found: Readers = {}
    for graph in iter_model_graphs(proto):
        for node in graph.node:
            if node.op_type not in LENGTH_OPS or not node.input:
                continue
            shape = dims.get(node.input[0], [])
            for axis in _length_axes(node, len(shape)) if is_onnx_domain(node.domain) else []:
                if shape[axis] in symbols:
                    found.setdefault(node.name, {})[axis] = symbols[shape[axis]]
    return found


def _length_axes(node: onnx.NodeProto, rank: int) -> list[int]:
    """The axes of ``node``'s first input (of ``rank``) that its op may find too short."""
    kind = LENGTH_OPS[node.op_type]
    if kind is None:
        return list(range(rank))
    if kind == 2:
        return list(range(2, rank))
    if kind == -1:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        return [axis % rank] if -rank <= axis < rank else []
    return [kind] if kind < rank else []
