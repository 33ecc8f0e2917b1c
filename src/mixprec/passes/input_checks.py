"""Structural checks of the input model, as passes: one :class:`MixprecError` naming the
node or tensor for each fault mixprec's passes could not survive (see
:mod:`mixprec.passes.sanitize` for the repairs that run beside them, and
:mod:`mixprec.io.proto_checks` for the checks that run before ``onnx_ir`` parses a file).

* :class:`CheckInputPass`: no graph outputs, a tensor read but never defined, an
  attribute of the wrong type or of type UNDEFINED, ``Cast(to=999)``, an UNDEFINED element
  type, ``raw_data`` that does not match its dims, If/Loop bodies with the wrong number of
  outputs, an unsupported opset or IR version.
* :class:`CheckAxesPass`: an ``axis``/``axes`` attribute outside its input's rank, once
  shape inference has given the ranks.
"""

from __future__ import annotations

import logging

import onnx
import onnx.defs
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import DTYPE_ATTRS, is_onnx_domain, onnx_domain, onnx_opset
from mixprec.io.proto_checks import tensor_fault
from mixprec.passes.sanitize import (
    MIN_OPSET,
    SanitizeResult,
    declared_opsets,
    node_label,
    subgraph_bodies,
)

__all__ = ["CheckAxesPass", "CheckInputPass"]

logger = logging.getLogger(__name__)

#: The attributes of :data:`~mixprec.core.ops.DTYPE_ATTRS` whose int value must name an
#: element type (QuantizeLinear's ``output_dtype`` may be 0: "from the zero point").
_NAMED_DTYPE_ATTRS = frozenset(DTYPE_ATTRS) - {"output_dtype"}


# --- structural checks ------------------------------------------------------------------------


def _defined(value: ir.Value) -> bool:
    return (
        value.producer() is not None
        or value.is_graph_input()
        or value.is_initializer()
        or value.const_value is not None
    )


def _attr_tensors(attr: ir.Attr) -> list[ir.TensorProtocol]:
    # ``attr.value``, not ``as_tensor()``: the latter's runtime Protocol check costs more
    # than the whole check of a model with many Constant nodes.
    if attr.type == ir.AttributeType.TENSOR:
        return [attr.value]
    if attr.type == ir.AttributeType.TENSORS:
        return list(attr.value)
    return []


def _inputs_fault(node: ir.Node, schema: onnx.defs.OpSchema) -> str | None:
    """An input the schema requires that the node leaves empty (``""``) or omits."""
    formal = schema.inputs
    for i, value in enumerate(node.inputs):
        if value is not None or not formal:
            continue
        param = formal[min(i, len(formal) - 1)]
        if param.option == onnx.defs.OpSchema.FormalParameterOption.Single:
            return f"input {i} ({param.name!r}) is required but its name is empty"
    if len(node.inputs) < schema.min_input:
        return (
            f"has {len(node.inputs)} input(s); {node.op_type}-{schema.since_version} needs "
            f"at least {schema.min_input}"
        )
    return None


class CheckInputPass(ir.passes.InPlacePass):
    """Refuse a malformed model with one error naming the node or tensor. Changes nothing.

    Odd but legal input (an output that is a graph input, zero nodes, NaN weights,
    unknown domains that the model imports) passes.
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        self._check_versions(model)
        graph = model.graph
        if not graph.outputs:
            raise MixprecError("the model has no graph outputs: there is nothing to compute")
        for value in graph.inputs:
            if isinstance(value.type, ir.TensorType) and value.dtype == ir.DataType.UNDEFINED:
                raise MixprecError(f"graph input {value.name!r} has no element type (UNDEFINED)")
        for value in graph.outputs:
            if isinstance(value.type, ir.TensorType) and value.dtype == ir.DataType.UNDEFINED:
                raise MixprecError(f"graph output {value.name!r} has no element type (UNDEFINED)")
        for body, where in subgraph_bodies(model):
            opsets = declared_opsets(body, model)
            if isinstance(body, ir.Graph):
                for value in body.initializers.values():
                    if value.const_value is not None:
                        fault = tensor_fault(value.const_value)
                        if fault:
                            raise MixprecError(f"initializer {value.name!r} {fault}")
            for node in body:
                self._check_node(node, opsets, model)
            for value in body.outputs:
                if not _defined(value):
                    raise MixprecError(
                        f"output {value.name!r} of {where} is not computed by any node "
                        "and is no input or initializer"
                    )
        return SanitizeResult(model, modified=False)

    def _check_versions(self, model: ir.Model) -> None:
        if model.ir_version > onnx.IR_VERSION:
            raise MixprecError(
                f"ir_version {model.ir_version} is newer than this onnx package knows "
                f"({onnx.IR_VERSION}); upgrade onnx"
            )
        opset = onnx_opset(model.opset_imports)
        latest = onnx.defs.onnx_opset_version()
        if opset is None:
            raise MixprecError("the model imports no ai.onnx opset")
        if not MIN_OPSET <= opset <= latest:
            raise MixprecError(
                f"ai.onnx opset {opset} is not supported (mixprec supports "
                f"{MIN_OPSET}..{latest}, the versions this onnx package knows)"
            )

    def _check_node(self, node: ir.Node, opsets: dict[str, int], model: ir.Model) -> None:
        label = node_label(node)
        for i, value in enumerate(node.inputs):
            if value is not None and not _defined(value):
                raise MixprecError(
                    f"{label} reads {value.name!r} (input {i}), which no node, graph input "
                    "or initializer defines"
                )
        domain = onnx_domain(node.domain)
        is_function = (node.domain, node.op_type, node.overload) in model.functions
        if domain not in opsets and node.domain not in opsets and not is_function:
            raise MixprecError(
                f"{label} is in domain {node.domain!r}, which the model does not import "
                "(no opset_import entry)"
            )
        schema = None
        if not is_function and domain in ("", "ai.onnx.ml", "ai.onnx.preview.training"):
            version = opsets.get(domain, opsets.get("ai.onnx", 0))
            try:
                schema = onnx.defs.get_schema(node.op_type, version, domain)
            except onnx.defs.SchemaError:
                if domain == "":
                    raise MixprecError(
                        f"{label}: ai.onnx has no operator {node.op_type!r} at opset {version}"
                    ) from None
        if schema is not None:
            fault = _inputs_fault(node, schema)
            if fault:
                raise MixprecError(f"{label}: {fault}")
        for name, attr in node.attributes.items():
            self._check_attr(label, node, name, attr, schema)
        self._check_bodies(label, node)

    def _check_attr(
        self,
        label: str,
        node: ir.Node,
        name: str,
        attr: ir.Attr,
        schema: onnx.defs.OpSchema | None,
    ) -> None:
        if attr.is_ref():
            return  # a function's attribute parameter: typed where the function is called
        if attr.type == ir.AttributeType.UNDEFINED:
            raise MixprecError(f"{label}: attribute {name!r} has no type (UNDEFINED)")
        if schema is not None:
            if name not in schema.attributes:
                raise MixprecError(
                    f"{label}: {node.op_type}-{schema.since_version} has no attribute {name!r}"
                )
            want = ir.AttributeType(int(schema.attributes[name].type))  # type: ignore[call-overload]
            if attr.type != want:
                raise MixprecError(
                    f"{label}: attribute {name!r} must be {want.name}, not {attr.type.name}"
                )
            if name in _NAMED_DTYPE_ATTRS and attr.type == ir.AttributeType.INT:
                code = attr.as_int()
                valid = code in {int(t) for t in ir.DataType} and code != 0
                if not valid:
                    raise MixprecError(
                        f"{label}: attribute {name!r} = {code} is not an ONNX element type"
                    )
        for tensor in _attr_tensors(attr):
            fault = tensor_fault(tensor)
            if fault:
                raise MixprecError(f"{label}: tensor of attribute {name!r} {fault}")

    def _check_bodies(self, label: str, node: ir.Node) -> None:
        if not is_onnx_domain(node.domain):
            return
        if node.op_type == "If":
            for branch in ("then_branch", "else_branch"):
                attr = node.attributes.get(branch)
                if attr is not None and not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
                    got = len(attr.as_graph().outputs)
                    if got != len(node.outputs):
                        raise MixprecError(
                            f"{label}: {branch} has {got} output(s), the node has "
                            f"{len(node.outputs)}"
                        )
        elif node.op_type == "Loop":
            attr = node.attributes.get("body")
            if attr is not None and not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
                body = attr.as_graph()
                if len(body.inputs) != len(node.inputs) or len(body.outputs) != 1 + len(
                    node.outputs
                ):
                    raise MixprecError(
                        f"{label}: body has {len(body.inputs)} input(s) and "
                        f"{len(body.outputs)} output(s); the node's {len(node.inputs)} "
                        f"input(s) and {len(node.outputs)} output(s) need "
                        f"{len(node.inputs)} and {1 + len(node.outputs)}"
                    )


# --- axis attributes against known ranks ------------------------------------------------------

#: Default-domain ops whose ``axis``/``axes`` attribute indexes input 0's dimensions:
#: op type -> (attribute, how far past the last dimension it may point). Flatten's axis may
#: equal the rank; the others must name an existing dimension.
_AXIS_ATTRS: dict[str, tuple[str, int]] = {
    **{
        op: ("axis", 0)
        for op in (
            "Softmax",
            "LogSoftmax",
            "Hardmax",
            "Concat",
            "Gather",
            "GatherElements",
            "Split",
            "ArgMax",
            "ArgMin",
            "LpNormalization",
            "LayerNormalization",
            "Compress",
            "QuantizeLinear",
            "DequantizeLinear",
            "OneHot",
            "ScatterElements",
        )
    },
    "Flatten": ("axis", 1),
    **{
        op: ("axes", 0)
        for op in (
            "Squeeze",
            "ReduceMax",
            "ReduceMin",
            "ReduceMean",
            "ReduceSum",
            "ReduceProd",
            "ReduceL1",
            "ReduceL2",
            "ReduceLogSum",
            "ReduceLogSumExp",
            "ReduceSumSquare",
        )
    },
}


class CheckAxesPass(ir.passes.InPlacePass):
    """Refuse an ``axis``/``axes`` attribute outside its input's known rank. Changes nothing.

    Runs after shape inference, where ranks are known. Some runtimes tolerate such an axis
    at one opset and reject it at another (ORT expands a bf16 Softmax into ReduceMax, which
    checks it), so a model that only ran by accident would come out broken.
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        for graph in model.graphs():
            for node in graph:
                self._check(node)
        return SanitizeResult(model, modified=False)

    @staticmethod
    def _check(node: ir.Node) -> None:
        spec = _AXIS_ATTRS.get(node.op_type)
        if spec is None or not is_onnx_domain(node.domain) or not node.inputs:
            return
        name, extra = spec
        attr = node.attributes.get(name)
        first = node.inputs[0]
        if attr is None or attr.is_ref() or first is None or first.shape is None:
            return
        if attr.type == ir.AttributeType.INT:
            values = [attr.as_int()]
        elif attr.type == ir.AttributeType.INTS:
            values = list(attr.as_ints())
        else:
            return
        rank = len(first.shape)
        low, high = -rank, rank - 1 + extra
        for value in values:
            if not low <= value <= high:
                raise MixprecError(
                    f"{node_label(node)}: {name} {value} is out of range for an input of "
                    f"rank {rank} (must be in [{low}, {high}])"
                )
