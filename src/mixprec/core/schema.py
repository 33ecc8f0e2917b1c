"""Which float tensors of a node may change dtype, according to the ONNX schema.

For each node the schema (at the model's opset for the node's domain) binds inputs and
outputs to type variables. A float32 slot may move to the target dtype only if its type
variable admits the target; every float32 slot bound to the same variable moves together.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx.defs
import onnx_ir as ir

from mixprec.core.ops import onnx_domain

__all__ = ["SlotInfo", "slot_info"]

_TYPE_STR = {
    ir.DataType.FLOAT16: "tensor(float16)",
    ir.DataType.BFLOAT16: "tensor(bfloat16)",
}


@dataclass(frozen=True)
class SlotInfo:
    """Float32 slots of one node that move to the target dtype when it runs in low precision.

    Attributes:
        inputs: input indices that become low precision.
        outputs: output indices that become low precision.
        fixed_inputs: float32 input indices that must stay float32.
        fixed_outputs: float32 output indices that must stay float32.
        reason: why nothing can move, when ``inputs`` and ``outputs`` are both empty.
    """

    inputs: frozenset[int]
    outputs: frozenset[int]
    fixed_inputs: frozenset[int]
    fixed_outputs: frozenset[int]
    reason: str = ""

    @property
    def convertible(self) -> bool:
        return bool(self.inputs or self.outputs)


def _get_schema(op_type: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


def _formal(params, index: int):
    if index < len(params):
        return params[index]
    if params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return params[-1]
    return None


def _is_f32(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == ir.DataType.FLOAT


def slot_info(
    node: ir.Node, opset: int, target: ir.DataType, keep_inputs: frozenset[int] = frozenset()
) -> SlotInfo:
    """Return which float32 slots of ``node`` can become ``target``.

    Args:
        node: the node.
        opset: the opset version imported by the model for the node's domain.
        target: FLOAT16 or BFLOAT16.
        keep_inputs: input indices a rule wants kept in float32; their whole type
            variable then stays float32.
    """
    f32_in = {i for i, v in enumerate(node.inputs) if _is_f32(v)}
    f32_out = {i for i, v in enumerate(node.outputs) if _is_f32(v)}
    empty: frozenset[int] = frozenset()
    if not f32_in and not f32_out:
        return SlotInfo(empty, empty, empty, empty, "no float32 tensors")
    domain = onnx_domain(node.domain)
    if node.op_type == "Cast" and domain == "":
        # Cast's output type is its `to` attribute, which the rewriter retargets.
        return SlotInfo(frozenset(f32_in), frozenset(f32_out), empty, empty)
    schema = _get_schema(node.op_type, domain, opset)
    if schema is None:
        return SlotInfo(
            empty,
            empty,
            frozenset(f32_in),
            frozenset(f32_out),
            f"no ONNX schema for {domain or 'ai.onnx'}::{node.op_type} at opset {opset}",
        )
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    target_str = _TYPE_STR[target]

    def var_of(params, index: int) -> str | None:
        formal = _formal(params, index)
        return None if formal is None else formal.type_str

    blocked_vars = {var_of(schema.inputs, i) for i in keep_inputs}
    ok_in: set[int] = set()
    ok_out: set[int] = set()
    for indices, params, ok in ((f32_in, schema.inputs, ok_in), (f32_out, schema.outputs, ok_out)):
        for i in indices:
            var = var_of(params, i)
            if var is None or var not in allowed or var in blocked_vars:
                continue  # fixed type such as tensor(float), or kept by a rule
            if target_str in allowed[var]:
                ok.add(i)
    reason = ""
    if not ok_in and not ok_out:
        reason = (
            f"schema {node.op_type}-{schema.since_version} admits no {target_str[7:-1]} "
            f"for its float inputs/outputs at opset {opset}"
        )
    return SlotInfo(
        frozenset(ok_in),
        frozenset(ok_out),
        frozenset(f32_in - ok_in),
        frozenset(f32_out - ok_out),
        reason,
    )
