"""What each graph output holds, read as its users read it: the one home of the output kinds.

The INT8 accuracy guard holds each output to the check its kind calls for, ``validate``
reports top-1 only on class scores, and ``tune``'s ``top1`` metric reads the same class
axis. The rules, first match wins (each kind carries the reason it was chosen):

1. **match**: a non-float output (an ArgMax, a length, a mask): equal elements.
2. **top1** (class scores on a class axis):

   * a Softmax/LogSoftmax output, through shape-only ops, on **its own axis** (the last
     one after a reshape);
   * (**scores**) a Sigmoid output, through shape-only ops: scores answered by argmax on
     the last axis (the channels of a rank-4 map), each also a yes/no at 0.5;
   * **plain logits**: a float output made by Gemm/MatMul (a bias Add after it included;
     class axis: the last), or by a
     Conv followed by a global pool (GlobalAveragePool/GlobalMaxPool, or ReduceMean/
     ReduceMax over every spatial axis; class axis: the channels), through shape-only ops.
     Not when the model also has Softmax/LogSoftmax class scores among its outputs (the
     Gemm outputs beside them are box or landmark regressions, as in MTCNN), nor when
     the output is named like a regression (box, landmark, offset...).

   An axis of size 1, or of unknown size for logits, is never a class axis: rel L2.
3. **embedding** (one vector per row along the last axis), for an output that
   is named like one (``*embed*``, ``pooler_output``, ``pooled_output``), a normalized
   vector (LpNormalization, or ``x / norm(x)``: a Div whose divisor is computed from its
   dividend through ReduceL2/ReduceSumSquare/Sqrt), or a pooled encoder output (a
   ReduceMean/ReduceSum over axis 1, the sequence, of a rank-3 ``[batch, sequence,
   features]`` tensor, possibly divided by a count: mean pooling). A per-token
   ``last_hidden_state`` is none of these.
4. **other**: everything else, regression heads (named like one, or beside class
   scores) included, read further by its FP32 values where it is checked
   (:mod:`mixprec.core.readings`: a detection head, scores in [0, 1], an embedding, or
   channels). ``rel-l2`` is a kind a user may name (one relative L2 per sample).

Only the graph is read here (ops, attributes, constants, declared shapes): no run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import onnx_ir as ir

from mixprec.core.constants import const_tensor

__all__ = ["CHECKS", "OutputKind", "classify_outputs", "shape_class_axis"]

#: The kinds the graph tells, by the name the guard, its report and the CLI show.
CHECKS = ("top1", "scores", "embedding", "other", "match")
_SHAPE_ONLY = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity"})
_CLASS_SCORES = frozenset({"Softmax", "LogSoftmax"})
_SIGMOIDS = frozenset({"Sigmoid", "HardSigmoid"})
_GLOBAL_POOLS = frozenset({"GlobalAveragePool", "GlobalMaxPool"})
_SPATIAL_REDUCE = frozenset({"ReduceMean", "ReduceMax"})
_NORMS = frozenset({"ReduceL2", "ReduceSumSquare", "Sqrt"})
_EMBEDDING_NAME = re.compile(r"embed|pooler_output|pooled_output", re.IGNORECASE)
_REGRESSION_NAME = re.compile(
    r"box|landmark|offset|coord|delta|regress|keypoint|(^|[^a-z])(loc|reg)([^a-z]|$)",
    re.IGNORECASE,
)
#: How far back through the divisor a norm of the dividend is looked for (x / norm(x)).
_NORM_DEPTH = 6
_SCORES = "class scores"


@dataclass(frozen=True)
class OutputKind:
    """How one output is checked, and why.

    Attributes:
        check: "top1", "scores", "embedding", "other" or "match" (:data:`CHECKS`), or a
            check :mod:`mixprec.core.readings` makes of them ("decision", "detection",
            "row-cosine", "neighbours", "channels", "rel-l2").
        axis: top1/scores: the class axis (-1: the last); embedding: the vector axis
            (-1); channels: the channel axis; detection: the feature axis.
        reason: why this kind, for the report and the CLI.
    """

    check: str
    axis: int = -1
    reason: str = ""

    @property
    def spec(self) -> str:
        """``"top1"``, ``"top1@1"`` (another class axis), ``"embedding"``, ..."""
        axed = self.check in ("top1", "top1-active", "scores", "channels", "decision", "detection")
        return f"{self.check}@{self.axis}" if axed and self.axis != -1 else self.check


def classify_outputs(model: ir.Model) -> dict[str, OutputKind]:
    """Each graph output's kind (see the module docstring), by output name.

    Example:
        >>> kinds = classify_outputs(model)                      # doctest: +SKIP
        >>> kinds["logits"].check, kinds["logits"].reason        # doctest: +SKIP
        ('top1', "plain logits: Gemm 'fc' (class axis -1, 1000 classes)")
    """
    outputs = list(model.graph.outputs)
    alone = {value.name or "": _classify(value, []) for value in outputs}
    scored = [
        n
        for n, k in alone.items()
        if k.check == "scores" or (k.check == "top1" and k.reason.startswith(_SCORES))
    ]
    return {value.name or "": _classify(value, scored) for value in outputs}


def shape_class_axis(shape: tuple[int, ...]) -> int | None:
    """The class axis of a float output known only by its shape (no graph: a converted
    model's outputs compared by :func:`~mixprec.core.metrics.compare_outputs`): the last
    axis of a rank-2 or rank-3 output holding 2 to 100000 classes, else None."""
    if 2 <= len(shape) <= 3 and 2 <= shape[-1] <= 100_000:
        return -1
    return None


def _classify(value: ir.Value, scored: list[str]) -> OutputKind:
    name = value.name or ""
    if not _is_float(value):
        return OutputKind("match", reason="not a float output: equal elements")
    node, reshaped = _source(value)
    op = _op(node)
    if node is not None and op in _CLASS_SCORES:
        attr = node.attributes.get("axis")
        axis = -1 if reshaped or attr is None else attr.as_int()
        return _top1(value, axis, f"{_SCORES}: {_named(node)}", size=None)
    if node is not None and op in _SIGMOIDS:
        rank = None if reshaped else _rank(value)
        axis = 1 if rank == 4 else -1
        return OutputKind("scores", axis, f"sigmoid scores: {_named(node)}")
    embedding = _embedding(value, node, reshaped)
    if embedding:
        return OutputKind("embedding", -1, f"an embedding: {embedding}")
    logits = _logits(node, reshaped, None if reshaped else _rank(value))
    if logits is None:
        return OutputKind("other", reason="other float output")
    axis, size, what = logits
    if _REGRESSION_NAME.search(name):
        return OutputKind("other", reason=f"{what}, named like a regression head")
    others = [s for s in scored if s != name]
    if others:
        why = f"{what} beside the class scores {others[0]!r}: a regression head"
        return OutputKind("other", reason=why)
    return _top1(value, axis, f"plain logits: {what}", size)


def _top1(value: ir.Value, axis: int, why: str, size: int | None) -> OutputKind:
    """top1 on ``axis`` of ``value``, or rel L2 when that axis has size 1 (one class: its
    arg-max always agrees) or, for logits (``size`` from the producer's weight), an
    unknown size."""
    shape = value.shape
    rank = len(shape) if shape is not None else None
    if rank:
        axis = axis % rank
        dim = shape[axis] if shape is not None else None
        size = dim if isinstance(dim, int) else size
        axis = -1 if axis == rank - 1 else axis
    if size is not None and size < 2:
        return OutputKind("other", reason=f"{why}; its class axis has size {size}")
    if size is None and not why.startswith(_SCORES):
        return OutputKind("other", reason=f"{why}; class axis of unknown size")
    count = f", {size} classes" if size is not None else ""
    return OutputKind("top1", axis, f"{why} (class axis {axis}{count})")


def _named(node: ir.Node) -> str:
    """``Softmax 'name'`` (the op alone when the node has no name)."""
    return f"{node.op_type} {node.name!r}" if node.name else node.op_type


def _is_float(value: ir.Value) -> bool:
    dtype = value.dtype
    return dtype is None or dtype.is_floating_point()


def _op(node: ir.Node | None) -> str:
    return node.op_type if node is not None else ""


def _source(value: ir.Value) -> tuple[ir.Node | None, bool]:
    """The node producing ``value`` through shape-only ops, and whether any reshaped it."""
    node = value.producer()
    reshaped = False
    while node is not None and node.op_type in _SHAPE_ONLY and node.inputs:
        reshaped = True
        first = node.inputs[0]
        node = first.producer() if first is not None else None
    return node, reshaped


def _embedding(value: ir.Value, node: ir.Node | None, reshaped: bool) -> str:
    """Why ``value`` is an embedding, or "" (see the module docstring)."""
    shape = value.shape
    last = shape[-1] if shape is not None and len(shape) else None
    if isinstance(last, int) and last < 2:
        return ""
    if _EMBEDDING_NAME.search(value.name or ""):
        return f"named {value.name!r}"
    if node is None:
        return ""
    if node.op_type == "LpNormalization":
        return f"a normalized vector ({_named(node)})"
    if node.op_type == "Div" and len(node.inputs) == 2 and _divided_by_norm(node):
        return f"a vector divided by its norm ({_named(node)})"
    pooled = node
    if node.op_type == "Div" and node.inputs and node.inputs[0] is not None:
        pooled = node.inputs[0].producer() or node
    out_rank = None if reshaped else _rank(value)
    if pooled.op_type in ("ReduceMean", "ReduceSum") and _sequence_pool(pooled, out_rank):
        return f"mean-pooled over the sequence axis ({_named(pooled)})"
    return ""


def _divided_by_norm(div: ir.Node) -> bool:
    """Whether Div's divisor is a norm (ReduceL2/ReduceSumSquare/Sqrt) of its dividend."""
    dividend, divisor = div.inputs[0], div.inputs[1]
    if dividend is None or divisor is None:
        return False
    frontier, norm_seen = [divisor], False
    for _ in range(_NORM_DEPTH):
        nodes = [v.producer() for v in frontier if v is not None and v.producer() is not None]
        if not nodes:
            return False
        norm_seen = norm_seen or any(n.op_type in _NORMS for n in nodes if n is not None)
        frontier = [i for n in nodes if n is not None for i in n.inputs if i is not None]
        if norm_seen and any(i is dividend for i in frontier):
            return True
    return False


def _axes(node: ir.Node) -> list[int] | None:
    """A Reduce node's axes (attribute before opset 18, constant input after), or None."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return list(attr.as_ints())
    if len(node.inputs) > 1:
        tensor = const_tensor(node.inputs[1])
        if tensor is not None:
            return [int(a) for a in tensor.numpy().reshape(-1)]
    return None


def _rank(value: ir.Value | None) -> int | None:
    shape = value.shape if value is not None else None
    return len(shape) if shape is not None else None


def _input_rank(node: ir.Node, axes: list[int], out_rank: int | None) -> int | None:
    """The rank of a Reduce node's input: declared, else from its output's rank (its own,
    or ``out_rank``: the graph output it makes) and ``keepdims``."""
    rank = _rank(node.inputs[0] if node.inputs else None)
    if rank is not None:
        return rank
    made = _rank(node.outputs[0]) if node.outputs else None
    made = made if made is not None else out_rank
    if made is None:
        return None
    keep = node.attributes.get("keepdims")
    return made if keep is None or keep.as_int() else made + len(axes)


def _sequence_pool(node: ir.Node, out_rank: int | None) -> bool:
    """A reduction over axis 1 (only) of a rank-3 ``[batch, sequence, features]`` input."""
    axes = _axes(node)
    if axes is None:
        return False
    rank = _input_rank(node, axes, out_rank)
    return rank == 3 and [a % 3 for a in axes] == [1]


def _logits(
    node: ir.Node | None, reshaped: bool, out_rank: int | None
) -> tuple[int, int | None, str] | None:
    """(class axis, class count if the weight tells it, what) of plain logits, else None."""
    if node is None:
        return None
    node = _unbiased(node)
    if node.op_type in ("Gemm", "MatMul"):
        return -1, _weight_columns(node), _named(node)
    pooled = node.op_type in _GLOBAL_POOLS or (
        node.op_type in _SPATIAL_REDUCE and _spatial_pool(node, out_rank)
    )
    first = node.inputs[0] if node.inputs else None
    conv = first.producer() if first is not None else None
    if not pooled or conv is None or conv.op_type != "Conv":
        return None
    weight = const_tensor(conv.inputs[1]) if len(conv.inputs) > 1 else None
    first_dim = weight.shape[0] if weight is not None and len(weight.shape) else None
    channels = first_dim if isinstance(first_dim, int) else None
    what = f"{_named(conv)} then {_named(node)}"
    return (-1 if reshaped else 1), channels, what


def _unbiased(node: ir.Node) -> ir.Node:
    """The MatMul/Gemm under a bias Add (an Add of a constant), else ``node``."""
    if node.op_type != "Add" or len(node.inputs) != 2:
        return node
    a, b = node.inputs
    for x, bias in ((a, b), (b, a)):
        made = x.producer() if x is not None else None
        constant = const_tensor(bias) is not None
        if made is not None and made.op_type in ("MatMul", "Gemm") and constant:
            return made
    return node


def _spatial_pool(node: ir.Node, out_rank: int | None) -> bool:
    """A reduction over every axis after the channels of a rank >= 3 input."""
    axes = _axes(node)
    rank = _input_rank(node, axes, out_rank) if axes is not None else None
    if rank is None or rank < 3 or axes is None:
        return False
    return sorted(a % rank for a in axes) == list(range(2, rank))


def _weight_columns(node: ir.Node) -> int | None:
    """The output width of a Gemm/MatMul with a constant weight, else None."""
    if len(node.inputs) < 2:
        return None
    weight = const_tensor(node.inputs[1])
    if weight is None or len(weight.shape) < 1:
        return None
    dims = [d if isinstance(d, int) else -1 for d in weight.shape]
    if node.op_type == "Gemm":
        attr = node.attributes.get("transB")
        width = dims[0] if attr is not None and attr.as_int() else dims[-1]
    else:
        width = dims[-1]
    return width if width >= 0 else None
