"""Ifs decided by shapes, folded at a static input shape.

Exporters of dynamic models test shapes at run time (``Squeeze`` if a dim is 1,
``Unsqueeze`` if the rank is 2) and branch on the answer with ``If``. With the graph's
input dims static, those conditions are constants: each such ``If`` is replaced by the
branch it would take, an exact rewrite at that shape. OpenVINO's ONNX reader needs it: it
converts no node whose input rank depends on a branch (Silero VAD: "Conv-16 ... The input
data tensor's rank has to be known").

A branch that cannot run at the static shape is folded away too: where an ``If`` on a
value (Silero's ``sr == 16000``) has one branch that fails strict shape inference at that
shape (its 8 kHz branch, fed 576 samples, hands the LSTM a rank-4 input), the ``If`` is
replaced by the other. The result gives the same outputs on every input the original
answers at that shape; where the original raised an error, it answers as the branch kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass, RemoveUnusedNodesPass

from mixprec.io.protos import weightless_proto
from mixprec.passes.shapes import InferShapesPass

__all__ = ["FoldStaticIfsPass", "FoldStaticIfsResult"]

#: Rounds of fold-then-infer (a fold can decide an If nested under it).
_ROUNDS = 16
#: The most Ifs looked at for a branch that cannot run (two shape inferences each).
_DEAD_TRIES = 16
#: Largest tensor a condition is computed from (shape arithmetic, not model data).
_SMALL = 64

_Fn = Callable[[list[np.ndarray], ir.Node], np.ndarray]


def _axes(args: list[np.ndarray], node: ir.Node) -> tuple[int, ...] | None:
    if len(args) > 1:
        return tuple(int(a) for a in args[1].reshape(-1))
    attr = node.attributes.get("axes")
    return None if attr is None else tuple(int(a) for a in attr.as_ints())


def _cast(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    to = ir.DataType(node.attributes["to"].as_int())
    return args[0].astype(to.numpy())


def _gather(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    attr = node.attributes.get("axis")
    return np.take(args[0], args[1], axis=0 if attr is None else attr.as_int())


def _squeeze(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    return np.squeeze(args[0], axis=_axes(args, node))


def _unsqueeze(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    out = args[0]
    axes = _axes(args, node) or ()
    for axis in sorted(a % (out.ndim + len(axes)) for a in axes):
        out = np.expand_dims(out, axis)
    return out


def _concat(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    return np.concatenate(args, axis=node.attributes["axis"].as_int())


def _filled(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    attr = node.attributes.get("value")
    fill = np.zeros(1, np.float32) if attr is None else attr.as_tensor().numpy().reshape(-1)
    return np.full(tuple(int(d) for d in args[0]), fill[0], dtype=fill.dtype)


def _reshape(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    shape = [int(d) for d in args[1]]
    keep = node.attributes.get("allowzero")
    if keep is None or keep.as_int() == 0:  # 0 copies the input's dim
        shape = [args[0].shape[k] if d == 0 else d for k, d in enumerate(shape)]
    return args[0].reshape(shape)


def _transpose(args: list[np.ndarray], node: ir.Node) -> np.ndarray:
    perm = node.attributes.get("perm")
    return np.transpose(args[0], None if perm is None else tuple(perm.as_ints()))


def _slice(args: list[np.ndarray], _node: ir.Node) -> np.ndarray:
    data, starts, ends = args[0], args[1].reshape(-1), args[2].reshape(-1)
    axes = args[3].reshape(-1) if len(args) > 3 else np.arange(len(starts))
    steps = args[4].reshape(-1) if len(args) > 4 else np.ones(len(starts), np.int64)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        n = data.shape[int(axis)]  # ends past either side clamp, as ONNX says
        picked = range(*slice(int(start), int(end), int(step)).indices(n))
        data = np.take(data, np.array(picked, dtype=np.int64), axis=int(axis))
    return data


#: The ops a shape test is built of, computed exactly in numpy.
_OPS: dict[str, _Fn] = {
    "Equal": lambda a, _: np.equal(a[0], a[1]),
    "Greater": lambda a, _: np.greater(a[0], a[1]),
    "Less": lambda a, _: np.less(a[0], a[1]),
    "GreaterOrEqual": lambda a, _: np.greater_equal(a[0], a[1]),
    "LessOrEqual": lambda a, _: np.less_equal(a[0], a[1]),
    "Not": lambda a, _: np.logical_not(a[0]),
    "And": lambda a, _: np.logical_and(a[0], a[1]),
    "Or": lambda a, _: np.logical_or(a[0], a[1]),
    "Add": lambda a, _: np.add(a[0], a[1]),
    "Sub": lambda a, _: np.subtract(a[0], a[1]),
    "Mul": lambda a, _: np.multiply(a[0], a[1]),
    "Identity": lambda a, _: a[0],
    "Cast": _cast,
    "Gather": _gather,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Concat": _concat,
    "ConstantOfShape": _filled,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Slice": _slice,
}


def _static_dims(value: ir.Value) -> list[int] | None:
    if value.shape is None:
        return None
    dims = [d for d in value.shape if isinstance(d, int)]
    return dims if len(dims) == len(value.shape) else None


def _shape_of(node: ir.Node) -> np.ndarray | None:
    """What a Shape or Size node gives where its input's shape is static."""
    dims = _static_dims(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
    if dims is None:
        return None
    if node.op_type == "Size":
        return np.array(int(np.prod(dims)), dtype=np.int64)
    start, end = node.attributes.get("start"), node.attributes.get("end")
    lo = 0 if start is None else start.as_int()
    hi = len(dims) if end is None else end.as_int()
    return np.array(dims[lo:hi], dtype=np.int64)


def _known(value: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """The value's contents where constants and static shapes decide them, else None."""
    if value is None or depth > 32:
        return None
    const = ir.convenience.get_const_tensor(value)
    if const is not None:
        return const.numpy() if const.size <= _SMALL else None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in ("Shape", "Size"):
        return _shape_of(node)
    fn = _OPS.get(node.op_type)
    if fn is None or len(node.outputs) != 1 or any(v is None for v in node.inputs):
        return None
    args = [_known(v, depth + 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    out = np.asarray(fn([a for a in args if a is not None], node))
    return out if out.size <= _SMALL else None


@dataclasses.dataclass
class FoldStaticIfsResult(ir.passes.PassResult):
    """``folded``: one line per If replaced by a branch, saying which and why."""

    folded: list[str] = dataclasses.field(default_factory=list)


def _inline(node: ir.Node, branch: str) -> None:
    """Replaces the If ``node`` by the nodes of its ``branch`` ("then_branch"/"else_branch"):
    its outputs keep their names, produced by the branch's outputs."""
    graph = node.graph
    assert graph is not None
    body = node.attributes[branch].as_graph()
    moved = list(body)
    for inner in moved:
        body.remove(inner)
    for key in list(body.initializers):
        graph.register_initializer(body.initializers.pop(key))
    results = list(body.outputs)
    body.outputs.clear()
    graph.insert_before(node, moved)
    taken: set[int] = set()
    for out, result in zip(node.outputs, results, strict=True):
        name = out.name
        if result.producer() not in moved or result.is_graph_output() or id(result) in taken:
            copy = ir.node("Identity", [result])
            graph.insert_before(node, copy)
            result = copy.outputs[0]
        taken.add(id(result))
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        out.name = None
        result.name = name
    graph.remove(node, safe=True)


def _ifs(model: ir.Model) -> list[ir.Node]:
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.op_type == "If"]


def _decided(model: ir.Model) -> list[str]:
    """Folds each If whose condition constants and static shapes decide; one line each."""
    lines = []
    while True:  # looked up again after each fold: a branch dropped takes its Ifs along
        for node in _ifs(model):
            cond = _known(node.inputs[0])
            if cond is not None and cond.size == 1:
                branch = "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"
                lines.append(f"{_named(node)}: {branch.split('_')[0]} (shapes fix its condition)")
                _inline(node, branch)
                break
        else:
            return lines


def _computed(model: ir.Model) -> bool:
    """Replaces each small value that constants and static shapes decide (a pad, a
    shape test) by a Constant, so that shape inference sees through it; True if any."""
    changed = False
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        out = node.outputs[0] if len(node.outputs) == 1 else None
        if node.op_type == "Constant" or out is None or out.is_graph_output() or not out.uses():
            continue
        known = _known(out)
        if known is None:
            continue
        graph = node.graph
        assert graph is not None
        const = ir.node("Constant", [], attributes={"value": ir.tensor(known)})
        graph.insert_before(node, const)
        out.replace_all_uses_with(const.outputs[0])
        const.outputs[0].shape = ir.Shape(known.shape)
        if out.dtype is not None:
            const.outputs[0].dtype = out.dtype
        changed = True
    return changed


def _unshaped(model: ir.Model) -> bool:
    """Forgets every shape but the graph inputs' and outputs' (exporters declare shapes of
    values inside branches that hold for one branch only); shape inference then derives
    them again. True if some shape was forgotten."""
    kept = set(model.graph.inputs) | set(model.graph.outputs)
    forgotten = False
    for graph in model.graphs():
        values = [v for node in graph for v in node.outputs]
        if graph is not model.graph:
            values += list(graph.outputs)
        for value in values:
            if value.shape is not None and value not in kept:
                value.shape = None
                forgotten = True
    return forgotten


def _runs_with(model: ir.Model, index: int, branch: str) -> str | None:
    """None where the model, its ``index``-th If replaced by ``branch``, passes strict
    shape inference; else the first line of the error."""
    twin = ir.from_proto(weightless_proto(model, with_arrays=False)[0])  # shapes, no weights
    _inline(_ifs(twin)[index], branch)
    return InferShapesPass(reconcile=False).call(twin).failure


def _named(node: ir.Node) -> str:
    return node.name or f"an unnamed If (output {node.outputs[0].name})"


def _dead(model: ir.Model) -> list[str]:
    """Folds the first If (inner ones first) one of whose branches cannot run at the
    model's shapes where the other can; its line, or none."""
    ifs = _ifs(model)
    for index in list(reversed(range(len(ifs))))[:_DEAD_TRIES]:
        fails = {b: _runs_with(model, index, b) for b in ("then_branch", "else_branch")}
        alive = [b for b, why in fails.items() if why is None]
        if len(alive) != 1:
            continue
        dead = next(b for b in fails if b not in alive)
        line = (
            f"{_named(ifs[index])}: {alive[0].split('_')[0]} (its {dead.split('_')[0]} "
            f"branch cannot run at this shape: {fails[dead]})"
        )
        _inline(ifs[index], alive[0])
        return [line]
    return []


class FoldStaticIfsPass(ir.passes.InPlacePass):
    """Replaces each If that the model's static input shapes decide by its branch, and
    each If with a branch that cannot run at those shapes by the other one (the module's
    docstring says when that is exact). A model whose input dims are not all static, or
    that has no If, is left as it is. ``modified``: some If was folded, or some shape
    declaration or small computed value was rewritten on the way (``folded`` is empty
    then: the model computes the same, in the same Ifs)."""

    def call(self, model: ir.Model) -> FoldStaticIfsResult:
        result = FoldStaticIfsResult(model, modified=False)
        if not _ifs(model) or any(_static_dims(v) is None for v in model.graph.inputs):
            return result
        changed = _unshaped(model)
        for _ in range(_ROUNDS):
            changed |= InferShapesPass(reconcile=False, strict=False)(model).modified
            if _computed(model):
                changed = True
                continue
            step = _decided(model) or _dead(model)
            if not step:
                break
            result.folded.extend(step)
        if result.folded:  # the Identities a fold leaves chained, and its dead shape tests
            IdentityEliminationPass()(model)
            RemoveUnusedNodesPass()(model)
            InferShapesPass(reconcile=False)(model)
        result.modified = changed or bool(result.folded)
        return result
