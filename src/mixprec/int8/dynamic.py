"""Dynamic INT8: MatMul weights quantized offline, activations at run time.

For each MatMul (or Gemm without transA/alpha/beta) with a constant 2-D float weight that
the plan marks INT8, the node becomes the pattern ONNX Runtime's CPU provider fuses into
one ``DynamicQuantizeMatMul`` kernel:

    DynamicQuantizeLinear(x) -> (x_q uint8, x_scale, x_zp)
    MatMulInteger(x_q, W_q int8, x_zp, W_zp) -> int32
    Cast(float) * Mul(x_scale, W_scale) [+ bias]

The activation range is measured per call, from the actual input, so no calibration is
needed and outliers cost only that call's resolution. Suited to MatMul-heavy transformers;
convolutions stay float.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import UniqueNames, add_initializer
from mixprec.core.ops import trans_b
from mixprec.int8.params import quantize_weight
from mixprec.int8.plan import INT8, dynamic_candidate, int8_decision, weight_spec

__all__ = ["QuantizeDynamicPass", "QuantizeDynamicResult"]


@dataclasses.dataclass
class QuantizeDynamicResult(ir.passes.PassResult):
    """Weights quantized, per node their qparams, and nodes left float with reasons."""

    tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    weights: int = 0
    left_float: dict[str, str] = dataclasses.field(default_factory=dict)
    outputs: dict[str, str] = dataclasses.field(default_factory=dict)  # output -> node name


class QuantizeDynamicPass(ir.passes.InPlacePass):
    """Rewrite the MatMul/Gemm nodes annotated INT8 into dynamic INT8 (see module doc),
    each weight as its node's spec says (per output column or per weight, reduced range)."""

    def call(self, model: ir.Model) -> QuantizeDynamicResult:
        result = QuantizeDynamicResult(model, modified=False)
        self._graph = model.graph
        self._names = UniqueNames(model)
        for node in list(model.graph):
            decision = int8_decision(node)
            if decision is None or not decision.int8:
                continue
            why = dynamic_candidate(node)
            if why is None:
                why = self._rewrite(node, result)
            if why is not None:
                node.meta[INT8] = decision.as_float(why)
                result.left_float[node.name or node.op_type] = why
        result.modified = result.weights > 0
        return result

    def _rewrite(self, node: ir.Node, result: QuantizeDynamicResult) -> str | None:
        w_value = node.inputs[1]
        assert w_value is not None
        tensor = const_tensor(w_value)
        assert tensor is not None
        weight = tensor.numpy()
        if node.op_type == "Gemm" and trans_b(node):
            weight = weight.T
        spec = weight_spec(node)
        quantized = quantize_weight(weight, 1 if spec.per_channel else None, qmax=spec.qmax)
        if isinstance(quantized, str):
            return quantized
        data, params = quantized
        base = node.name or w_value.name or "matmul"
        x = node.inputs[0]
        assert x is not None
        x_q, x_scale, x_zp = (
            self._value(f"{base}_x_quantized", ir.DataType.UINT8),
            self._value(f"{base}_x_scale", ir.DataType.FLOAT),
            self._value(f"{base}_x_zero_point", ir.DataType.UINT8),
        )
        w_q = self._initializer(f"{w_value.name or base}_int8", data)
        w_scale = self._initializer(f"{w_value.name or base}_scale", params.scale)
        w_zp = self._initializer(f"{w_value.name or base}_zero_point", params.zero_point)
        product = self._value(f"{base}_int32", ir.DataType.INT32)
        as_float = self._value(f"{base}_float", ir.DataType.FLOAT)
        multiplier = self._value(f"{base}_multiplier", ir.DataType.FLOAT)
        scaled = self._value(f"{base}_scaled", ir.DataType.FLOAT)
        to_float = [ir.AttrInt64("to", ir.DataType.FLOAT)]
        nodes = [
            self._node("DynamicQuantizeLinear", [x], [x_q, x_scale, x_zp], base),
            self._node("MatMulInteger", [x_q, w_q, x_zp, w_zp], [product], base),
            self._node("Mul", [x_scale, w_scale], [multiplier], f"{base}_scales"),
            self._node("Cast", [product], [as_float], base, to_float),
            self._node("Mul", [as_float, multiplier], [scaled], base),
        ]
        final = scaled
        bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
        if bias is not None:
            final = self._value(f"{base}_biased", ir.DataType.FLOAT)
            nodes.append(self._node("Add", [scaled, bias], [final], base))
        # MatMulInteger takes the node's name, decision and MACs (the report's row); the
        # last value takes the old output's name, type and readers (graph outputs too).
        matmul = nodes[1]
        name = node.name
        matmul.meta.update(node.meta)
        ir.convenience.replace_nodes_and_values(
            self._graph, node, [node], nodes, [node.outputs[0]], [final]
        )
        matmul.name = name
        result.outputs[final.name or ""] = name or ""
        result.weights += 1
        result.tensors[w_value.name or base] = params.describe()
        return None

    def _value(self, base: str, dtype: ir.DataType) -> ir.Value:
        return ir.Value(name=self._names.fresh(base), type=ir.TensorType(dtype))

    def _node(
        self,
        op: str,
        inputs: list[ir.Value | None],
        outputs: list[ir.Value],
        base: str,
        attributes: list[ir.Attr] | None = None,
    ) -> ir.Node:
        return ir.Node(
            "",
            op,
            inputs,
            attributes=attributes or [],
            outputs=outputs,
            name=self._names.fresh(f"{base}_{op}"),
        )

    def _initializer(self, base: str, array: np.ndarray) -> ir.Value:
        return add_initializer(self._graph, self._names, base, array)
