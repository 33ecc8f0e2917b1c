"""Lower bounds on a model's symbolic input lengths, read from the ops the inputs reach.

A generated input must be long enough for the ops that read it directly: a reflect
``Pad`` needs more samples than its pad width, a ``Conv`` or pooling window at least its
kernel (less the padding), an ``STFT`` at least one frame. :func:`length_bounds` reads
them from every graph (subgraphs too, which see the main graph's inputs by name);
:func:`~mixprec.io.feeds.resolve_input_shapes` guesses at least that much.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
from onnx.reference import ReferenceEvaluator

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import iter_nodes
from mixprec.core.ops import is_onnx_domain, onnx_opset

__all__ = ["LENGTH_STEPS", "length_bounds", "next_step"]

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
