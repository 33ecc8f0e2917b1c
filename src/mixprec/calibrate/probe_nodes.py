"""The nodes a :class:`~mixprec.calibrate.probes.ProbeSession` adds after a measured tensor.

* :func:`range_nodes`: its exact ``ReduceMin``, ``ReduceMax`` and ``Shape``;
* :func:`channel_nodes`: a per-channel ``ReduceMean`` or ``ReduceMax(Abs(x))``;
* :func:`sample_nodes`: what a histogram needs, in one run: the exact min, max and shape,
  a uniform random sample of its values and its exact largest ``|x|``, with the
  constants every tensor shares (:class:`SampleConstants`).

The sample is a ``Gather`` of the flattened tensor at ``floor(u * size)`` for positions
``u`` in ``[0, 1)`` fed with every run (:data:`POSITIONS`, float64: exact for any tensor
under 2**52 values), so each run samples other places; stratified positions
(:func:`draw_positions`) spread them evenly without a stride that could alias with the
tensor's channels.

The largest ``|x|`` come without sorting the whole tensor: the tensor is read as rows
(its last axis), each row's min and max are reduced (two read-only passes, which also
give the exact min and max), and only the ``top`` rows with the largest ``|x|`` (which
hold the ``top`` largest values) go through ``Abs`` and ``TopK``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

__all__ = [
    "POSITIONS",
    "SampleConstants",
    "channel_nodes",
    "draw_positions",
    "range_nodes",
    "sample_indices",
    "sample_nodes",
]

#: Name of the probe model's extra input: one run's sample positions in ``[0, 1)``.
POSITIONS = "__mp_positions"
# Positions stay below 1 - 2**-30, so floor(u * size) < size for any size under 2**52.
_BELOW_ONE = 1.0 - 2.0**-30


def draw_positions(rng: np.random.Generator, size: int) -> np.ndarray:
    """``size`` sorted float64 positions in ``[0, 1)``, one uniform in each of ``size``
    equal strata (a jittered grid: even coverage, no fixed stride)."""
    return np.minimum((np.arange(size) + rng.random(size)) / size, _BELOW_ONE)


def sample_indices(positions: np.ndarray, count: int) -> np.ndarray:
    """The flat indices the probes gather at ``positions`` from a tensor of ``count``
    values (the same float64 product and truncation ONNX Runtime computes)."""
    return (positions * np.float64(count)).astype(np.int64)


def _const(name: str, array: np.ndarray) -> tuple[ir.Node, ir.Value]:
    value = ir.Value(name=name, type=ir.TensorType(ir.DataType(ir.tensor(array).dtype)))
    node = ir.Node(
        "",
        "Constant",
        [],
        attributes=[ir.AttrTensor("value", ir.tensor(array))],
        outputs=[value],
        name=f"{name}_node",
    )
    return node, value


@dataclass
class SampleConstants:
    """The values every tensor's :func:`sample_nodes` share: the positions input, and
    Constant nodes (``nodes``, to insert before the first user)."""

    size: int
    top: int
    opset: int
    positions: ir.Value
    nodes: list[ir.Node]
    values: dict[str, ir.Value]

    @classmethod
    def create(cls, size: int, top: int, opset: int) -> SampleConstants:
        """The shared values for samples of ``size`` values and the ``top`` largest
        ``|x|``, in a graph of ai.onnx ``opset`` (10 or later: ``TopK`` takes ``K``)."""
        positions = ir.Value(
            name=POSITIONS, type=ir.TensorType(ir.DataType.DOUBLE), shape=ir.Shape([size])
        )
        arrays = {
            "top": np.array([top], np.int64),
            "one": np.array([1], np.int64),
            "minus_one": np.array([-1], np.int64),  # flat shapes, the last axis
            "end": np.array([np.iinfo(np.int64).max], np.int64),
        }
        nodes, values = [], {}
        for key, array in arrays.items():
            node, values[key] = _const(f"__mp_sample_{key}", array)
            nodes.append(node)
        return cls(size, top, opset, positions, nodes, values)


class _Nodes:
    """Collects the nodes of one tensor's probes (outputs named ``__mp_{tag}_{k}``)."""

    def __init__(self, k: int, shared: SampleConstants) -> None:
        self.k = k
        self.shared = shared
        self.nodes: list[ir.Node] = []

    def add(
        self, op: str, inputs: list[ir.Value], tag: str, *more: ir.Attr, **ints: int
    ) -> ir.Value:
        """A node ``op`` with integer attributes ``ints`` (and ``more``); its output."""
        out = ir.Value(name=f"__mp_{tag}_{self.k}")
        attrs = [*more, *(ir.AttrInt64(key, v) for key, v in ints.items())]
        self.nodes.append(ir.Node("", op, inputs, attributes=attrs, outputs=[out], name=out.name))
        return out

    def reduce(self, op: str, x: ir.Value, tag: str, *, rows: bool) -> ir.Value:
        """``op`` over the last axis (``rows``) or over all axes, keepdims 0."""
        if not rows:
            return self.add(op, [x], tag, keepdims=0)
        if self.shared.opset >= 18:  # axes became an input
            return self.add(op, [x, self.shared.values["minus_one"]], tag, keepdims=0)
        return self.add(op, [x], tag, ir.AttrInt64s("axes", [-1]), keepdims=0)

    def at_most_top(self, x: ir.Value, tag: str) -> ir.Value:
        """``[min(top, size of x)]``, the ``K`` of a ``TopK`` over ``x``."""
        c = self.shared.values
        size = self.add("Reshape", [self.add("Size", [x], f"{tag}_size"), c["one"]], f"{tag}_n")
        if self.shared.opset >= 12:  # Min of integers
            return self.add("Min", [size, c["top"]], f"{tag}_k")
        fewer = self.add("Less", [size, c["top"]], f"{tag}_fewer")
        return self.add("Where", [fewer, size, c["top"]], f"{tag}_k")

    def top_k(self, x: ir.Value, tag: str) -> tuple[ir.Value, ir.Value]:
        """(largest values, their indices) of 1-D ``x``, at most ``top`` of them."""
        values = ir.Value(name=f"__mp_{tag}_{self.k}")
        indices = ir.Value(name=f"__mp_{tag}_indices_{self.k}")
        count = self.at_most_top(x, tag)
        self.nodes.append(
            ir.Node("", "TopK", [x, count], outputs=[values, indices], name=values.name)
        )
        return values, indices


def sample_nodes(
    value: ir.Value, dtype: ir.DataType, k: int, shared: SampleConstants
) -> tuple[list[ir.Node], tuple[ir.Value, ir.Value, ir.Value], ir.Value, ir.Value]:
    """The nodes that measure ``value`` for a histogram, and their outputs: (min, max,
    shape) as :func:`range_nodes` gives them, the sample (``shared.size`` float32
    values) and the largest ``|x|`` (at most ``shared.top``, float32, descending)."""
    c = shared.values
    n = _Nodes(k, shared)
    float32, int64, float64 = (int(ir.DataType[t]) for t in ("FLOAT", "INT64", "DOUBLE"))
    x = value if dtype == ir.DataType.FLOAT else n.add("Cast", [value], "f32", to=float32)
    shape = n.add("Shape", [value], "shape")
    last = n.add("Slice", [shape, c["minus_one"], c["end"]], "last")  # [] for a scalar
    grid = n.add(
        "Reshape", [x, n.add("Concat", [c["minus_one"], last], "grid_shape", axis=0)], "grid"
    )
    row_max = n.reduce("ReduceMax", grid, "row_max", rows=True)
    row_min = n.reduce("ReduceMin", grid, "row_min", rows=True)
    lo = n.reduce("ReduceMin", row_min, "min", rows=False)
    hi = n.reduce("ReduceMax", row_max, "max", rows=False)
    row_abs = n.add("Max", [row_max, n.add("Neg", [row_min], "row_neg")], "row_abs")
    _, rows = n.top_k(n.add("Reshape", [row_abs, c["minus_one"]], "row_flat"), "rows")
    chosen = n.add("Abs", [n.add("Gather", [grid, rows], "chosen", axis=0)], "chosen_abs")
    top, _ = n.top_k(n.add("Reshape", [chosen, c["minus_one"]], "chosen_flat"), "top")
    size = n.add("Cast", [n.add("Size", [value], "size")], "size64", to=float64)
    index = n.add("Cast", [n.add("Mul", [shared.positions, size], "spread")], "index", to=int64)
    sample = n.add(
        "Gather", [n.add("Reshape", [x, c["minus_one"]], "flat"), index], "sample", axis=0
    )
    for out in (lo, hi, sample, top):
        out.type = ir.TensorType(ir.DataType.FLOAT)
    shape.type = ir.TensorType(ir.DataType.INT64)
    return n.nodes, (lo, hi, shape), sample, top


def range_nodes(
    value: ir.Value, dtype: ir.DataType, k: int
) -> tuple[list[ir.Node], tuple[ir.Value, ir.Value, ir.Value]]:
    """``ReduceMin``, ``ReduceMax`` and ``Shape`` of ``value`` (outputs named by ``k``),
    and those three outputs."""
    nodes = []
    for op in ("ReduceMin", "ReduceMax"):
        out = ir.Value(name=f"__mp_{op}_{k}", type=ir.TensorType(dtype), shape=ir.Shape([]))
        attrs = [ir.AttrInt64("keepdims", 0)]
        nodes.append(ir.Node("", op, [value], attributes=attrs, outputs=[out], name=out.name))
    shape = ir.Value(name=f"__mp_shape_{k}", type=ir.TensorType(ir.DataType.INT64))
    nodes.append(ir.Node("", "Shape", [value], outputs=[shape], name=shape.name))
    return nodes, (nodes[0].outputs[0], nodes[1].outputs[0], shape)


def channel_nodes(
    kind: str, value: ir.Value, axis: int, rank: int, k: int, opset: int
) -> list[ir.Node]:
    """Per-channel ``ReduceMean`` (kind "mean") or ``ReduceMax`` of ``Abs`` (kind "absmax")
    of ``value`` over every axis but ``axis`` (output ``__mp_{kind}_k``)."""
    axes = [i for i in range(rank) if i != axis % rank]
    out = ir.Value(name=f"__mp_{kind}_{k}", type=ir.TensorType(ir.DataType.FLOAT))
    first: list[ir.Node] = []
    op = "ReduceMean"
    if kind == "absmax":
        op = "ReduceMax"
        magnitude = ir.Value(name=f"__mp_abs_{k}", type=ir.TensorType(ir.DataType.FLOAT))
        first = [ir.Node("", "Abs", [value], outputs=[magnitude], name=magnitude.name)]
        value = magnitude
    if opset >= 18:  # axes became an input
        given = ir.Value(
            name=f"__mp_{kind}_axes_{k}",
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape([len(axes)]),
        )
        const = ir.Node(
            "",
            "Constant",
            [],
            attributes=[ir.AttrTensor("value", ir.tensor(np.array(axes, np.int64)))],
            outputs=[given],
            name=f"{given.name}_node",
        )
        node = ir.Node(
            "",
            op,
            [value, given],
            attributes=[ir.AttrInt64("keepdims", 0)],
            outputs=[out],
            name=out.name,
        )
        return [*first, const, node]
    attrs = [ir.AttrInt64s("axes", axes), ir.AttrInt64("keepdims", 0)]
    return [*first, ir.Node("", op, [value], attributes=attrs, outputs=[out], name=out.name)]
