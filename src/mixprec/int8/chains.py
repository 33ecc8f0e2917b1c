"""Chains of weighted layers joined by ops that commute with a per-channel scale: what
cross-layer equalization (:mod:`mixprec.int8.equalize`) rescales.

A :class:`Pair` is two Conv/ConvTranspose/Gemm/MatMul nodes with float32 constant weights
(initializers or Constant nodes) that only they read, where the first's output reaches the
second's input through single-use values and ops ``f`` with ``f(x / s) = f(x) / s`` per
channel for ``s > 0`` (:class:`Link`). :func:`find_pairs` says for every other weighted
node why it starts no pair.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.layers import is_layer
from mixprec.core.ops import is_onnx_domain, trans_b, weight_out_axis
from mixprec.core.registry import node_info

__all__ = ["DEAD_RANGE", "Layer", "Link", "Pair", "channel_spread", "find_pairs"]

#: f(a x) = a f(x) for a > 0, and f(x) = x for x >= 0 (a bias shift passes where x >= c >= 0).
_RELU_LIKE = frozenset({"Relu", "PRelu", "LeakyRelu"})
#: Per-channel pools: positively homogeneous; the ones that also commute with a shift.
_POOLS = frozenset({"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"})
_SHIFTING_POOLS = frozenset({"MaxPool", "GlobalAveragePool", "GlobalMaxPool"})
#: A channel range below this share of the largest counts as dead (pruned).
DEAD_RANGE = 1e-8


def channel_spread(weight: np.ndarray, axis: int) -> float:
    """Largest over smallest per-channel range (``max |w|``) along ``axis``: what a
    per-tensor INT8 scale costs the weakest channel (1 is ideal). Dead channels (under
    1e-8 of the largest, pruned) are left out."""
    ranges = np.abs(weight).max(axis=tuple(k for k in range(weight.ndim) if k != axis))
    alive = ranges[ranges > DEAD_RANGE * ranges.max(initial=0.0)]
    return float(alive.max() / alive.min()) if alive.size else 1.0


@dataclasses.dataclass
class Layer:
    """A Conv/ConvTranspose/Gemm/MatMul with constant weights, as float64 working copies."""

    node: ir.Node
    weight: np.ndarray
    bias: np.ndarray | None
    out_axis: int
    group: int
    changed: bool = False

    @property
    def dense(self) -> bool:
        return node_info(self.node).layer != "conv"

    @property
    def channels(self) -> int:
        return int(self.weight.shape[self.out_axis])

    def in_axis(self) -> int:
        """The weight axis of the input channels (a Conv's groups: see :meth:`in_index`)."""
        op = self.node.op_type
        if op == "Conv":
            return 1
        if op == "Gemm":
            return 1 if trans_b(self.node) else 0
        return 0  # ConvTranspose, MatMul

    def in_index(self) -> np.ndarray:
        """For each weight element (broadcast), the input channel it reads."""
        w = self.weight
        shape = [1] * w.ndim
        if self.node.op_type == "Conv":
            out, per_group = w.shape[0], w.shape[1]
            group_of = np.arange(out) // (out // self.group)
            index = group_of[:, None] * per_group + np.arange(per_group)[None, :]
            return index.reshape(out, per_group, *shape[2:])
        axis = self.in_axis()
        shape[axis] = w.shape[axis]
        return np.arange(w.shape[axis]).reshape(shape)

    def in_channels(self) -> int:
        if self.node.op_type == "Conv":
            return int(self.weight.shape[1] * self.group)
        return int(self.weight.shape[self.in_axis()])

    def out_ranges(self) -> np.ndarray:
        axes = tuple(k for k in range(self.weight.ndim) if k != self.out_axis)
        return np.abs(self.weight).max(axis=axes)

    def in_ranges(self) -> np.ndarray:
        a = np.abs(self.weight)
        if self.node.op_type == "Conv":
            out, per_group = a.shape[:2]
            per = a.reshape(out, per_group, -1).max(axis=2)
            return per.reshape(self.group, out // self.group, per_group).max(axis=1).reshape(-1)
        axis = self.in_axis()
        return a.max(axis=tuple(k for k in range(a.ndim) if k != axis))

    def scale_out(self, s: np.ndarray) -> None:
        """Divide output channel ``i`` (weights and bias) by ``s_i``."""
        shape = [1] * self.weight.ndim
        shape[self.out_axis] = -1
        self.weight = self.weight / s.reshape(shape)
        if self.bias is not None:
            self.bias = self.bias / s  # per output channel (Gemm: along its last axis)
        self.changed = True

    def scale_in(self, s: np.ndarray) -> None:
        """Multiply the weights that read input channel ``i`` by ``s_i``."""
        self.weight = self.weight * s[self.in_index()]
        self.changed = True


@dataclasses.dataclass
class Link:
    """An op between the two layers of a pair."""

    node: ir.Node
    kind: str  # "act" (ReLU-like), "pool", "scale" (Mul/Div), "shift" (Add/Sub), "identity"
    const: np.ndarray | None = None  # scale/shift: the constant, one value per channel
    index: int = 1  # scale/shift: which input holds the constant
    shifts: bool = True  # whether ``f(x - c) = f(x) - c`` (pools)


@dataclasses.dataclass
class Pair:
    first: Layer
    second: Layer
    links: list[Link]
    scale: np.ndarray  # the product of every sweep's s

    @property
    def axis(self) -> int:
        """The channel axis of the values between, counted from the end."""
        return -1 if self.first.dense else -(self.first.weight.ndim - 1)


def find_pairs(graph: ir.Graph, skipped: dict[str, str]) -> list[Pair]:
    """The equalizable pairs of ``graph`` (one per first layer); ``skipped`` gets why the
    others are not."""
    layers: dict[ir.Node, Layer] = {}

    def layer_of(node: ir.Node) -> Layer | str:
        if node not in layers:
            found = _layer(node)
            if isinstance(found, str):
                return found
            layers[node] = found
        return layers[node]

    pairs: list[Pair] = []
    for node in graph:
        if not is_layer(node):
            continue
        found = _pair_from(node, layer_of)
        if isinstance(found, str):
            skipped[node.name or ""] = found
        else:
            pairs.append(found)
    return pairs


def _pair_from(node: ir.Node, layer_of: Callable[[ir.Node], Layer | str]) -> Pair | str:
    first = layer_of(node)
    if isinstance(first, str):
        return first
    axis = -1 if first.dense else -(first.weight.ndim - 1)
    links, consumer = _walk(node, first.channels, axis)
    if isinstance(links, str):
        return links
    assert consumer is not None
    second = layer_of(consumer)
    if isinstance(second, str):
        return f"next layer {consumer.name!r}: {second}"
    if first.dense != second.dense:
        return f"{node.op_type} feeds {consumer.op_type}: their channel layouts differ"
    if second.in_channels() != first.channels:
        return f"{consumer.name!r} reads {second.in_channels()} channels, not {first.channels}"
    return Pair(first, second, links, np.ones(first.channels))


def _layer(node: ir.Node) -> Layer | str:
    """The weights of a Conv/ConvTranspose/Gemm/MatMul, or why they cannot be rescaled."""
    weight = _own_constant(node, 1, "weight")
    if isinstance(weight, str):
        return weight
    bias: np.ndarray | None = None
    kind = node_info(node).layer
    if kind != "matmul" and len(node.inputs) > 2 and node.inputs[2] is not None:
        given = _own_constant(node, 2, "bias")
        if isinstance(given, str):
            return given
        bias = given
    group = _int_attr(node, "group", 1)
    op = node.op_type
    if kind == "conv" and (weight.ndim < 3 or group < 1 or weight.shape[0] % group):
        return "malformed weight or group"
    if op == "ConvTranspose" and group != 1:
        return "ConvTranspose with groups"
    if op == "MatMul" and weight.ndim != 2:
        return "MatMul weight is not a matrix"
    if op == "Gemm" and (weight.ndim != 2 or _int_attr(node, "transA", 0)):
        return "Gemm with transA or a non-matrix weight"
    out_axis = weight_out_axis(node, weight.ndim)
    assert out_axis is not None  # a layer's weight of rank 2 or more
    channels = weight.shape[out_axis]
    if bias is not None:
        bias = _bias_vector(bias, channels, op)
        if bias is None:
            return "bias is not one value per output channel"
    return Layer(node, weight, bias, out_axis, group)


def _bias_vector(bias: np.ndarray, channels: int, op: str) -> np.ndarray | None:
    if op == "Gemm" and bias.size == 1:
        return np.full(channels, float(bias.reshape(-1)[0]))
    if bias.size == channels and (op != "Gemm" or bias.shape[-1] == channels):
        return bias.reshape(-1)
    return None


def _own_constant(node: ir.Node, index: int, what: str) -> np.ndarray | str:
    """Input ``index`` of ``node`` as float64, when it is a float32 constant only it reads."""
    value = node.inputs[index] if len(node.inputs) > index else None
    tensor = const_tensor(value)
    if value is None or tensor is None:
        return f"{what} is not a constant"
    if tensor.dtype != ir.DataType.FLOAT:
        return f"{what} is not float32"
    users = {use.node for use in value.uses()}
    if len(users) > 1 or value.is_graph_output():
        return f"{what} {value.name!r} is shared with {len(users) - 1} other node(s)"
    try:
        return tensor.numpy().astype(np.float64)
    except ValueError:
        return f"{what} data does not fit its shape"


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return attr.as_int() if attr is not None and attr.type == ir.AttributeType.INT else default


def _walk(node: ir.Node, channels: int, axis: int) -> tuple[list[Link] | str, ir.Node | None]:
    """The ops from ``node``'s output to the next weighted layer, and that layer; or why
    the chain ends first."""
    links: list[Link] = []
    value = node.outputs[0]
    while True:
        if value.is_graph_output():
            return f"{value.name!r} is a graph output", None
        uses = list(value.uses())
        if len(uses) != 1:
            return f"{value.name!r} feeds {len(uses)} nodes", None
        nxt, index = uses[0].node, uses[0].idx
        if nxt.graph is not node.graph or not is_onnx_domain(nxt.domain):
            return f"{value.name!r} feeds {nxt.op_type} in another graph or domain", None
        if is_layer(nxt) and index == 0:
            return links, nxt
        link = _link(nxt, index, channels, axis)
        if isinstance(link, str):
            return link, None
        if any(o is not None and o.uses() for o in nxt.outputs[1:]):
            return f"{nxt.op_type} {nxt.name!r} has a second output in use", None
        links.append(link)
        value = nxt.outputs[0]


def _link(node: ir.Node, index: int, channels: int, axis: int) -> Link | str:
    """``node`` as a link that commutes with a positive per-channel scale, or why not."""
    op = node.op_type
    if op in _RELU_LIKE and index == 0:
        return Link(node, "act")
    if op in _POOLS:
        pads = node.attributes.get("pads")
        padded = pads is not None and any(pads.as_ints())
        return Link(node, "pool", shifts=op in _SHIFTING_POOLS or not padded)
    if op == "Identity":
        return Link(node, "identity")
    if op == "Clip":
        return _clip_link(node)
    if op in ("Mul", "Div", "Add", "Sub") and len(node.inputs) == 2:
        other = 1 - index
        if op == "Div" and other != 1:
            return "Div of a constant by the value is not scale-equivariant"
        tensor = const_tensor(node.inputs[other])
        if tensor is None or tensor.dtype != ir.DataType.FLOAT:
            return f"{op} {node.name!r} with a non-constant or non-float32 operand"
        vector = _channel_vector(tensor.numpy(), channels, axis)
        if vector is None:
            return f"{op} {node.name!r} constant is not one value per channel"
        kind = "scale" if op in ("Mul", "Div") else "shift"
        return Link(node, kind, vector, other)
    return f"{op} {node.name!r} does not commute with a per-channel scale"


def _clip_link(node: ir.Node) -> Link | str:
    """Clip(0, inf) is a ReLU and Clip(-inf, inf) nothing; a finite bound (ReLU6) moves
    under a scale and ends the chain (kept: replacing it by ReLU would change the model)."""
    bounds: list[float | None] = []
    for k, name in ((1, "min"), (2, "max")):
        attr = node.attributes.get(name)
        value = node.inputs[k] if len(node.inputs) > k else None
        if attr is not None:
            bounds.append(attr.as_float())
        elif value is None:
            bounds.append(None)
        else:
            tensor = const_tensor(value)
            if tensor is None or tensor.size != 1:
                return f"Clip {node.name!r} with a non-constant bound"
            bounds.append(float(tensor.numpy().reshape(-1)[0]))
    lo, hi = (None if b is None or math.isinf(b) else b for b in bounds)
    if hi is None and lo in (None, 0.0):
        return Link(node, "identity" if lo is None else "act")
    return (
        f"Clip {node.name!r} ({lo}, {hi}) is not scale-equivariant (a ReLU6 is kept as it "
        "is: replacing it by ReLU would change the FP32 model)"
    )


def _channel_vector(array: np.ndarray, channels: int, axis: int) -> np.ndarray | None:
    """``array`` as one float64 per channel when it varies along ``axis`` (from the end)
    only, else None."""
    if array.size == 1:
        return np.full(channels, float(array.reshape(-1)[0]))
    if array.ndim < -axis or (axis != -1 and array.ndim > -axis + 1):
        return None
    for k, dim in enumerate(array.shape):
        if dim != (channels if k - array.ndim == axis else 1):
            return None
    return array.reshape(-1).astype(np.float64)
