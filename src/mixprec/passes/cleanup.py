"""The last stages: forget annotations the input did not have, and hold the result to
the full ONNX checker."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from mixprec.core.errors import InternalError, MixprecError
from mixprec.core.graphs import all_graphs, iter_nodes
from mixprec.io.protos import light_copy, weightless_proto
from mixprec.passes.shapes import ReconcileDeclaredShapesPass, ReconcileDeclaredShapesResult

__all__ = [
    "INPUT_SKETCH",
    "CheckModelPass",
    "DropAddedAnnotationsPass",
    "KeepInputSketchPass",
    "annotated_values",
]


def annotated_values(model: ir.Model) -> set[str]:
    """Names of intermediate values that carry a type annotation (value_info)."""
    return {
        v.name
        for n in iter_nodes(model.graph)
        for v in n.outputs
        if v.name and v.type is not None and not v.is_graph_output()
    }


class DropAddedAnnotationsPass(ir.passes.InPlacePass):
    """Forget the types/shapes of intermediates that the input model did not annotate.

    Shape inference annotated every value while converting; writing all of that as
    value_info would grow small models by a tenth and add nothing a runtime needs.
    Annotations the input had (``keep``, by name) are kept, retyped where the value
    changed dtype. Initializers never need one: the tensor carries dtype and dims.
    """

    def __init__(self, keep: set[str]) -> None:
        super().__init__()
        self.keep = keep

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        values = [
            v
            for n in iter_nodes(model.graph)
            for v in n.outputs
            if v.name not in self.keep and not v.is_graph_output()
        ]
        for graph in all_graphs(model.graph):
            values += [
                v
                for v in graph.initializers.values()
                if not v.is_graph_input() and not v.is_graph_output()
            ]
        for value in values:
            if value.type is not None or value.shape is not None:
                value.type = None
                value.shape = None
                modified = True
        return ir.passes.PassResult(model, modified=modified)


class CheckModelPass(ir.passes.InPlacePass):
    """``onnx.checker.check_model(full_check=True)``; raises :class:`InternalError`.

    Runs on a copy without large weight payloads (they become typed graph inputs): the
    same checks on structure, types and shapes, without serializing the weights. A
    declared shape that only now contradicts the graph (a Reshape whose shape input became
    a constant in the opset upgrade) is corrected and the check runs again; the result's
    ``fixes`` say so, and ``modified`` is True then. Any other failure is mixprec's fault.
    """

    def call(self, model: ir.Model) -> ReconcileDeclaredShapesResult:
        failure = _check(model)
        result = ReconcileDeclaredShapesResult(model, modified=False)
        if failure is not None:
            fixed = ReconcileDeclaredShapesPass().call(model)
            if fixed.modified:
                result = fixed
                failure = _check(model)
        if failure is not None:
            sketch = model.meta.get(INPUT_SKETCH)
            before = _check_proto(sketch) if isinstance(sketch, onnx.ModelProto) else None
            if before is not None:
                raise MixprecError(
                    f"the input model fails onnx.checker ({before}), and mixprec cannot "
                    f"repair it: {failure}"
                )
            raise InternalError(f"the converted model fails onnx.checker: {failure}")
        return result


def _check(model: ir.Model) -> str | None:
    return _check_proto(light_copy(weightless_proto(model, with_arrays=False)[0]))


def _check_proto(light: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(light, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        return str(exc).strip().splitlines()[0]
    return None


#: ``model.meta`` key: the input as prepare received it, without its weights, so that the
#: final check can tell an input onnx.checker already rejects (the user's: exit 2) from a
#: fault of mixprec's (exit 3).
INPUT_SKETCH = "mixprec.input_sketch"


class KeepInputSketchPass(ir.passes.InPlacePass):
    """Keeps a weightless copy of the input in ``model.meta`` (:data:`INPUT_SKETCH`) for
    :class:`CheckModelPass`. Changes nothing in the model."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        try:
            model.meta[INPUT_SKETCH] = light_copy(weightless_proto(model, with_arrays=False)[0])
        except Exception:  # a model onnx cannot serialize: the final check blames mixprec
            model.meta.pop(INPUT_SKETCH, None)
        return ir.passes.PassResult(model, modified=False)
