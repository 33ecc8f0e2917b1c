"""Declared shapes against inferred ones: correct what the input model got wrong.

Exporters sometimes declare a graph output or a value_info entry with a shape the graph
does not compute (a scalar ``shape {}`` over a rank-4 detector output, ``[1, seqlen]``
over a rank-3 Reshape). ONNX Runtime runs such models, but ONNX shape inference, and
so ``onnx.checker.check_model(full_check=True)``, rejects them. Some contradictions show
only once a shape input becomes a constant (after folding or an opset upgrade).

:class:`ReconcileDeclaredShapesPass` infers every shape afresh from the graph inputs,
compares each declaration with the inference, and where they contradict replaces the
declaration with what was inferred. Each change is recorded so the report can say so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from mixprec.io.protos import weightless_proto

__all__ = [
    "InferShapesPass",
    "InferShapesResult",
    "ReconcileDeclaredShapesPass",
    "ReconcileDeclaredShapesResult",
    "ShapeFix",
]

Dim = int | str | None


@dataclasses.dataclass(frozen=True)
class ShapeFix:
    """One corrected declaration: the value, what was declared, what the graph computes."""

    value: str
    declared: tuple[Dim, ...]
    inferred: tuple[Dim, ...]

    def describe(self) -> str:
        return (
            f"{self.value!r} declared {_fmt(self.declared)} but the graph computes "
            f"{_fmt(self.inferred)}: declaration corrected"
        )


def _fmt(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


@dataclasses.dataclass
class ReconcileDeclaredShapesResult(ir.passes.PassResult):
    fixes: list[ShapeFix] = dataclasses.field(default_factory=list)


def _dims(shape: ir.Shape | None) -> tuple[Dim, ...] | None:
    if shape is None:
        return None
    out: list[Dim] = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        else:
            out.append(d.value if isinstance(d, ir.SymbolicDim) else None)
    return tuple(out)


def _proto_dims(vi: onnx.ValueInfoProto) -> tuple[Dim, ...] | None:
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    return tuple(
        int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
        for d in vi.type.tensor_type.shape.dim
    )


def contradicts(declared: Sequence[Dim], inferred: Sequence[Dim]) -> bool:
    """Different ranks, or a fixed dim that differs from a fixed inferred dim."""
    if len(declared) != len(inferred):
        return True
    pairs = zip(declared, inferred, strict=True)
    return any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in pairs)


def _inferred_shapes(model: ir.Model) -> dict[str, tuple[Dim, ...] | None]:
    """Shapes of every value of the main graph inferred with no declarations to lean on."""
    proto, _ = weightless_proto(model, with_arrays=False)
    graph = proto.graph
    declared_outputs = {o.name for o in graph.output}
    del graph.value_info[:]
    for out in graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # inference itself fails: nothing to compare with
        return {}
    result: dict[str, tuple[Dim, ...] | None] = {}
    for vi in [*inferred.graph.value_info, *inferred.graph.output]:
        if vi.name in declared_outputs or vi.name not in result:
            result[vi.name] = _proto_dims(vi)
    return result


class ReconcileDeclaredShapesPass(ir.passes.InPlacePass):
    """Replace declared shapes of the main graph's outputs and intermediate values that
    contradict shape inference; ``modified`` is True exactly when one was replaced.

    Graph inputs are the user's contract and are never changed. Declarations that agree
    with inference, or that inference cannot check, are left as they are.
    """

    def call(self, model: ir.Model) -> ReconcileDeclaredShapesResult:
        result = ReconcileDeclaredShapesResult(model, modified=False)
        candidates = [
            v
            for v in [*model.graph.outputs, *(o for n in model.graph for o in n.outputs)]
            if v.shape is not None and v.name and not v.is_graph_input()
        ]
        if not candidates:
            return result
        inferred = _inferred_shapes(model)
        if not inferred:
            return result
        seen: set[ir.Value] = set()
        for value in candidates:
            if value in seen:
                continue
            seen.add(value)
            declared = _dims(value.shape)
            assert declared is not None  # candidates have a shape
            new = inferred.get(value.name or "")
            if new is None or not contradicts(declared, new):
                continue
            value.shape = ir.Shape(list(new))
            result.fixes.append(ShapeFix(value.name or "", declared, new))
            result.modified = True
        return result


@dataclasses.dataclass
class InferShapesResult(ir.passes.PassResult):
    """``failure``: the first line of the inference error when inference failed;
    ``fixes``: declarations corrected so that inference could succeed."""

    failure: str | None = None
    fixes: list[ShapeFix] = dataclasses.field(default_factory=list)


def _infer(model: ir.Model, strict: bool = True) -> ir.Model | str:
    """The model with shapes inferred (data propagation; ``strict``: all or nothing), or
    the error's line."""
    proto, _ = weightless_proto(model, with_arrays=False)
    try:
        return ir.from_proto(
            onnx.shape_inference.infer_shapes(proto, strict_mode=strict, data_prop=True)
        )
    except Exception as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


class InferShapesPass(ir.passes.InPlacePass):
    """ONNX shape inference (strict, with data propagation) merged into the model's values.

    When strict inference fails and ``reconcile`` is set, the declarations that contradict
    the graph are corrected (:class:`ReconcileDeclaredShapesPass`) and inference runs
    again: the common case costs one inference. With ``only_untyped`` it runs only when
    some node output has no type (after a rewrite such as the opset upgrade) that its
    producer does not imply (Shape: int64, type-preserving ops: their input's). Unlike
    ``onnx_ir``'s own pass it runs on a weightless copy (no weight serialization) and
    reports a failure in its result instead of logging a traceback; the model is then left
    as it was. ``strict=False`` merges what inference finds past the nodes it cannot
    infer. ``modified`` is True when a declaration, type or shape changed.
    """

    def __init__(
        self, *, reconcile: bool = True, only_untyped: bool = False, strict: bool = True
    ) -> None:
        super().__init__()
        self.reconcile = reconcile
        self.only_untyped = only_untyped
        self.strict = strict

    def call(self, model: ir.Model) -> InferShapesResult:
        result = InferShapesResult(model, modified=False)
        if self.only_untyped and all(
            v.dtype is not None for g in model.graphs() for n in g for v in n.outputs if v.name
        ):
            return result  # every value typed already: nothing a paint step would miss
        inferred = _infer(model, self.strict)
        if isinstance(inferred, str) and self.reconcile:
            fixed = ReconcileDeclaredShapesPass().call(model)
            if fixed.modified:
                result.fixes = fixed.fixes
                result.modified = True
                inferred = _infer(model, self.strict)
        if isinstance(inferred, str):
            result.failure = inferred
            return result
        for graph, twin in zip(model.graphs(), inferred.graphs(), strict=False):
            known = ir.convenience.create_value_mapping(twin)
            for name, value in ir.convenience.create_value_mapping(graph).items():
                other = known.get(name)
                if other is None:
                    continue
                if other.shape is not None and value.shape != other.shape:
                    value.shape = other.shape
                    result.modified = True
                if other.dtype is not None and value.dtype != other.dtype:
                    value.dtype = other.dtype
                    result.modified = True
        return result
