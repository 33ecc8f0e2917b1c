"""Which weights become 4 or 8 bits, and why the others stay float (analysis only).

:class:`SelectWeightsPass` records a :class:`WeightDecision` on every MatMul and Gather of
the model (``node.meta[WEIGHTS]``); :mod:`mixprec.weights.apply` rewrites the ones it
marks int4/int8, and the report reads them all.

* A **linear** layer is a MatMul whose second input is a constant 2-D float32 weight
  (an initializer or a Constant, possibly through a ``Transpose``); a MatMul of two
  activations (attention) stays float.
* The **lm_head** is a linear layer whose result reaches a graph output through
  shape-only ops (Reshape, Transpose, Cast...) or a bias Add, or whose weight is an
  embedding table's transpose. It gets ``lm_head`` (int8 by default).
* An **embedding** is a Gather of a constant 2-D float32 table by integer indices on
  axis 0. It gets ``embeddings`` (int8 by default) where this ONNX Runtime has a
  ``GatherBlockQuantized`` kernel for uint8 data, and stays float with that reason where
  it does not.
* A table **tied** between an embedding and the lm_head (one initializer, the MatMul
  reading it through a ``Transpose``, or two initializers with equal values) is
  quantized once: at equal bits the Gather reads the MatMul's packed codes (recorded as
  the decision's ``table``), otherwise each use gets its own copy.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import NodeExclusions, iter_nodes
from mixprec.core.ops import FLOAT_TYPES, is_onnx_domain
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import engine_for
from mixprec.weights.config import WeightsConfig
from mixprec.weights.scaled import scaled_matrix

__all__ = [
    "WEIGHTS",
    "SelectWeightsPass",
    "WeightDecision",
    "WeightSource",
    "class_score_outputs",
    "embedding_table",
    "gather_kernel_missing",
    "matmul_weight",
    "weight_decision",
]

#: ``node.meta`` key of the weight-only decision.
WEIGHTS = "mixprec.weights"
#: Ops a value passes through unchanged on its way to a graph output (the lm_head test).
_PASS_THROUGH = frozenset(
    {"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Transpose", "Cast"}
)


@dataclasses.dataclass(frozen=True)
class WeightDecision:
    """One MatMul's or Gather's weight: its precision ("int4", "int8", "float"), role
    ("linear", "lm_head", "embedding"), why, and the table it shares when tied."""

    precision: str
    role: str
    reason: str
    table: str | None = None

    @property
    def quantized(self) -> bool:
        return self.precision != "float"


def weight_decision(node: ir.Node) -> WeightDecision | None:
    found = node.meta.get(WEIGHTS)
    return found if isinstance(found, WeightDecision) else None


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """The constant behind a MatMul's weight: ``value`` read as is, or its transpose."""

    value: ir.Value
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        """``(K, N)`` as the MatMul reads it."""
        tensor = const_tensor(self.value)
        assert tensor is not None
        rows, cols = (int(d) for d in tensor.shape.numpy())
        return (cols, rows) if self.transposed else (rows, cols)

    def matrix(self) -> np.ndarray:
        """The weight as the MatMul reads it, ``[K, N]``; a large weight AWQ scaled is read
        a slice of columns at a time (:class:`~mixprec.weights.scaled.ScaledArray`)."""
        scaled = scaled_matrix(self.value, self.transposed)
        if scaled is not None:
            return scaled  # type: ignore[return-value]
        tensor = const_tensor(self.value)
        assert tensor is not None
        array = tensor.numpy()
        return array.T if self.transposed else array


def _constant(value: ir.Value | None) -> WeightSource | None:
    """The constant 2-D float32 behind ``value``, directly or through one Transpose."""
    if value is None:
        return None
    if const_tensor(value) is not None:
        source = WeightSource(value, False)
    else:
        producer = value.producer()
        if (
            producer is None
            or producer.op_type != "Transpose"
            or not is_onnx_domain(producer.domain)
        ):
            return None
        perm = producer.attributes.get_ints("perm", [1, 0])
        if list(perm) != [1, 0] or const_tensor(producer.inputs[0]) is None:
            return None
        source = WeightSource(producer.inputs[0], True)  # type: ignore[arg-type]
    tensor = const_tensor(source.value)
    assert tensor is not None
    if tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None
    return source


def matmul_weight(node: ir.Node, inputs: set[ir.Value]) -> tuple[WeightSource | None, str]:
    """The constant weight of a MatMul, or None and why it has none we can quantize
    (``inputs``: the graph's inputs, which a caller may override at run time)."""
    if len(node.inputs) != 2 or node.inputs[0] is None:
        return None, "MatMul without two inputs"
    source = _constant(node.inputs[1])
    if source is None:
        tensor = const_tensor(node.inputs[1])
        if tensor is None:
            return None, "MatMul of two activations (no constant weight): stays float"
        return None, f"weight is {tensor.dtype.name} of rank {len(tensor.shape)}: only 2-D float32"
    x = node.inputs[0]
    if source.value in inputs:
        return None, "the weight is also a graph input (overridable at run time): stays float"
    if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
        return None, f"input is {x.dtype.name}: only float32 activations"
    rank = x.shape.rank() if x.shape is not None else None
    if rank == 1:
        return None, "1-D input (a vector-matrix product): stays float"
    return source, ""


def embedding_table(node: ir.Node, inputs: set[ir.Value]) -> tuple[ir.Value | None, str]:
    """The constant table of an embedding Gather, or None and why it is not one."""
    table, indices = (*node.inputs, None, None)[:2]
    if table is None or indices is None:
        return None, "Gather without two inputs"
    tensor = const_tensor(table)
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None, "not a lookup in a constant 2-D float32 table"
    if table in inputs:
        return None, "the table is also a graph input (overridable at run time): stays float"
    if node.attributes.get_int("axis", 0) not in (0, -2):
        return None, "Gather on axis 1 (columns, not rows): stays float"
    if const_tensor(indices) is not None:
        return None, "constant indices (folded at load time, not a lookup): stays float"
    if indices.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None, "indices are not int32/int64"
    return table, ""


@functools.cache
def gather_kernel_missing() -> str | None:
    """Why the runtime (ONNX Runtime's CPU provider) cannot run ``GatherBlockQuantized``
    on uint8 data (None: it can), asked once of its kernel probe."""
    typed = {"data": ir.DataType.UINT8, "indices": ir.DataType.INT64, "scales": ir.DataType.FLOAT}
    inputs = [ir.Value(name=name, type=ir.TensorType(dtype)) for name, dtype in typed.items()]
    attributes = [
        ir.AttrInt64(name, value)
        for name, value in (
            ("bits", 4),
            ("block_size", 16),
            ("gather_axis", 0),
            ("quantize_axis", 1),
        )
    ]
    node = ir.Node("com.microsoft", "GatherBlockQuantized", inputs, attributes, num_outputs=1)
    node.outputs[0].name = "out"
    node.outputs[0].dtype = ir.DataType.FLOAT
    engine = engine_for(RuntimeOptions())
    if engine.has_kernel(node, {"": 17, "com.microsoft": 1}):
        return None
    return f"this {engine.label} has no GatherBlockQuantized for uint8 tables"


def class_score_outputs(model: ir.Model) -> set[str]:
    """The graph outputs that hold class scores: made by an lm_head (its decision
    recorded) or a Softmax/LogSoftmax, through pass-through ops or a bias Add. Top-1
    agreement means something there, not on hidden states or embeddings."""
    found = set()
    for output in model.graph.outputs:
        value: ir.Value | None = output
        for _ in range(8):
            node = value.producer() if value is not None else None
            if node is None:
                break
            decision = weight_decision(node)
            if node.op_type in ("Softmax", "LogSoftmax") or (
                decision and decision.role == "lm_head"
            ):
                found.add(output.name or "")
                break
            bias = node.op_type == "Add" and any(const_tensor(v) is not None for v in node.inputs)
            if node.op_type not in _PASS_THROUGH and not bias:
                break
            value = next(
                (v for v in node.inputs if v is not None and const_tensor(v) is None), None
            )
    return found


def _reaches_output(value: ir.Value, outputs: set[ir.Value], depth: int = 6) -> bool:
    """``value`` is a graph output, or becomes one through pass-through ops or an Add of
    a constant (a bias)."""
    if value in outputs:
        return True
    if depth == 0:
        return False
    for user, _ in value.uses():
        bias = user.op_type == "Add" and any(const_tensor(v) is not None for v in user.inputs)
        passes = is_onnx_domain(user.domain) and (user.op_type in _PASS_THROUGH or bias)
        if passes and any(_reaches_output(v, outputs, depth - 1) for v in user.outputs):
            return True
    return False


class SelectWeightsPass(ir.passes.InPlacePass):
    """Record a :class:`WeightDecision` on every MatMul and Gather (analysis only; see
    the module doc for the rules).

    Args:
        config: the options: bits, lm_head, embeddings, exclusions, per-layer choices.
    """

    def __init__(self, config: WeightsConfig) -> None:
        super().__init__()
        self.config = config
        self._exclude = NodeExclusions(config.exclude_nodes)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        main = set(graph)
        for node in iter_nodes(graph):
            node.meta.pop(WEIGHTS, None)
            if node not in main and node.op_type in ("MatMul", "Gather"):
                node.meta[WEIGHTS] = WeightDecision("float", "none", "inside a subgraph")
        inputs, outputs = set(graph.inputs), set(graph.outputs)
        tables: dict[ir.Value, list[ir.Node]] = {}
        linear: dict[ir.Node, WeightSource] = {}
        for node in graph:
            if not is_onnx_domain(node.domain) or node.op_type not in ("MatMul", "Gather"):
                continue
            if node.op_type == "MatMul":
                source, why = matmul_weight(node, inputs)
                if source is None:
                    weighted = len(node.inputs) > 1 and const_tensor(node.inputs[1]) is not None
                    role = "linear" if weighted else "none"
                    node.meta[WEIGHTS] = WeightDecision("float", role, why)
                else:
                    linear[node] = source
                continue
            data = const_tensor(node.inputs[0]) if node.inputs else None
            if data is None or data.dtype not in FLOAT_TYPES:
                continue  # a Gather of computed values or integers (shapes): no weight, no row
            table, why = embedding_table(node, inputs)
            if table is None:
                node.meta[WEIGHTS] = WeightDecision("float", "embedding", why)
            else:
                tables.setdefault(table, []).append(node)
        for node, source in linear.items():
            self._decide_linear(node, source, tables, outputs)
        for table, nodes in tables.items():
            for node in nodes:
                node.meta[WEIGHTS] = self._decide_embedding(node, table)
        _share_tied(graph, tables)
        return ir.passes.PassResult(model, modified=False)

    def _decide_linear(
        self,
        node: ir.Node,
        source: WeightSource,
        tables: dict[ir.Value, list[ir.Node]],
        outputs: set[ir.Value],
    ) -> None:
        k, n = source.shape
        output = _reaches_output(node.outputs[0], outputs)
        tied = _tied_table(source, tables) if output or source.transposed else None
        if tied is not None or output:
            lm_head = self.config.lm_head
            why = f"the output projection (lm_head) [{k}, {n}]: {lm_head} (lm_head=)"
            if tied is not None:
                why += f", tied to the embedding table {tied.name!r}"
            decision = self._choose(node, "lm_head", lm_head, why)
            node.meta[WEIGHTS] = dataclasses.replace(decision, table=tied.name if tied else None)
            return
        precision = self.config.precision
        why = f"MatMul weight [{k}, {n}]: {precision} (weights={precision})"
        node.meta[WEIGHTS] = self._choose(node, "linear", precision, why)

    def _decide_embedding(self, node: ir.Node, table: ir.Value) -> WeightDecision:
        tensor = const_tensor(table)
        assert tensor is not None
        v, h = tensor.shape
        precision = self.config.embeddings
        decision = self._choose(
            node, "embedding", precision, f"embedding table [{v}, {h}]: {precision} (embeddings=)"
        )
        if not decision.quantized:
            return decision
        missing = gather_kernel_missing()
        if missing is not None:
            return WeightDecision("float", "embedding", f"{missing}: stays float")
        return decision

    def _choose(self, node: ir.Node, role: str, precision: str, why: str) -> WeightDecision:
        """Exclusions win, then the per-layer map, then the role's default."""
        excluded = self._exclude.reason(node)
        if excluded is not None:
            return WeightDecision("float", role, excluded)
        choice = self.config.layers.get(node.name or "")
        if choice is not None:
            return WeightDecision(choice.precision, role, choice.reason)
        return WeightDecision(precision, role, why)


def _tied_table(source: WeightSource, tables: dict[ir.Value, list[ir.Node]]) -> ir.Value | None:
    """The embedding table an lm_head weight equals (transposed), if any."""
    if source.transposed:
        return source.value if source.value in tables else None
    weight = source.matrix()
    for table in tables:
        tensor = const_tensor(table)
        assert tensor is not None
        if tuple(tensor.shape) != weight.shape[::-1]:
            continue
        table_array = tensor.numpy()
        # a strided look first (cheap), then the whole table in memory order, a slice of
        # rows at a time: comparing through a transposed view misses the cache on every
        # element (38 s on SmolLM2), and a whole transposed copy is the table's size again
        if np.array_equal(table_array[::97, ::13], weight.T[::97, ::13]) and all(
            np.array_equal(
                table_array[i : i + _ROWS], np.ascontiguousarray(weight[:, i : i + _ROWS].T)
            )
            for i in range(0, len(table_array), _ROWS)
        ):
            return table
    return None


#: Table rows compared at a time by :func:`_tied_table`.
_ROWS = 8192


def _share_tied(graph: ir.Graph, tables: dict[ir.Value, list[ir.Node]]) -> None:
    """Mark the embeddings whose table an lm_head at the same precision quantizes: they
    read its codes (``table``); at other precisions each use keeps its own copy."""
    heads: dict[str, str] = {}
    for node in graph:
        d = weight_decision(node)
        if d is not None and d.role == "lm_head" and d.table is not None and d.quantized:
            heads[d.table] = d.precision
    for table, nodes in tables.items():
        for node in nodes:
            d = weight_decision(node)
            if d is None or not d.quantized or heads.get(table.name or "") != d.precision:
                continue
            why = f"{d.reason}; shares the lm_head's {d.precision} codes (tied table)"
            node.meta[WEIGHTS] = dataclasses.replace(d, reason=why, table=table.name)
