"""INT8 conversion: QuantizeLinear/DequantizeLinear pairs where the plan says INT8.

Mechanism only: :mod:`mixprec.int8.plan` decides (with each INT8 node's quantization
specs, :mod:`mixprec.int8.spec`), the calibration (``model.meta``) gives the ranges,
:mod:`mixprec.int8.params` the numbers. The placement follows what ONNX Runtime's
CPU provider fuses into integer kernels (its QDQ selectors):

- ``DQ(x), DQ(w int8, per channel), DQ(b int32) -> Conv/Gemm -> Q`` becomes QLinearConv /
  QGemm; ``DQ(a), DQ(b) -> MatMul -> Q`` becomes QLinearMatMul;
- a Relu/Clip right after such a node is absorbed: only its output is quantized, with a
  range starting at 0;
- data movement (Reshape, Transpose, MaxPool...) keeps its input's scale and zero point,
  so ONNX Runtime drops its Q/DQ pair;
- Add/Mul, pooling, Concat, Sigmoid/LeakyRelu get their QLinear kernels.

One Q/DQ pair per tensor, right after its producer; every reader shares it. Graph outputs
keep their names and float32 type (the DQ output takes the name).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mixprec.calibrate.measure import calibration_of
from mixprec.calibrate.observers import TensorStats
from mixprec.core.constants import const_tensor
from mixprec.core.graphs import UniqueNames, add_initializer
from mixprec.core.layers import takes_bias
from mixprec.core.ops import trans_b, weight_out_axis
from mixprec.int8.adaround import ROUNDING, LearnedCodes
from mixprec.int8.bias import output_shift
from mixprec.int8.params import QParams, activation_qparams, quantize_bias, quantize_weight
from mixprec.int8.plan import (
    INT8,
    activation_spec,
    int8_decision,
    int8_spec_decision,
    runs_int8,
    weight_index,
    weight_spec,
)
from mixprec.int8.spec import QuantSpec

__all__ = ["QuantizeQDQPass", "QuantizeQDQResult"]

_NP_TO_IR = {
    np.dtype(np.uint8): ir.DataType.UINT8,
    np.dtype(np.int8): ir.DataType.INT8,
    np.dtype(np.int32): ir.DataType.INT32,
}


@dataclasses.dataclass
class QuantizeQDQResult(ir.passes.PassResult):
    """What was quantized: tensors with their qparams, weights, biases, and nodes that the
    conversion had to leave float (with reasons)."""

    tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    weights: int = 0
    biases: int = 0
    float_biases: list[str] = dataclasses.field(default_factory=list)
    left_float: dict[str, str] = dataclasses.field(default_factory=dict)
    corrected_biases: int = 0
    learned_weights: int = 0  # weights written with learned rounding codes


def _activation_inputs(node: ir.Node, role: str | None) -> list[int]:
    """Input indices that carry activations to quantize, by INT8 role."""
    if role == "binary":
        return [0, 1]
    if role == "concat":
        return list(range(len(node.inputs)))
    if role == "absorbed":
        return []  # its input is its integer producer's output: only its output is quantized
    return [0]


class QuantizeQDQPass(ir.passes.InPlacePass):
    """Insert Q/DQ pairs and INT8 weights for the nodes annotated INT8, each value as its
    node's specs say (range method, uint8 or int8, per channel, reduced range).

    Args:
        bias_correction: fold the mean output shift of weight rounding into the bias of
            Conv/Gemm (:mod:`mixprec.int8.bias`; needs the calibration's channel means).
    """

    def __init__(self, *, bias_correction: bool = False) -> None:
        super().__init__()
        self.bias_correction = bias_correction

    def call(self, model: ir.Model) -> QuantizeQDQResult:
        result = QuantizeQDQResult(model, modified=False)
        self._graph = model.graph
        self._names = UniqueNames(model)
        self._stats = calibration_of(model).stats
        self._means = getattr(calibration_of(model), "channel_means", {}) or {}
        self._first = next(iter(model.graph), None)
        while True:  # a tensor left float demotes its nodes, and what they fed: plan again
            nodes = [n for n in model.graph if runs_int8(n)]
            demoted = len(result.left_float)
            qparams = self._plan_tensors(nodes, result)
            if len(result.left_float) == demoted:
                break
            _demote_unfed(model.graph, result)
        for node in nodes:
            if not runs_int8(node):
                continue
            if node_role(node) == "weighted" and weight_index(node) is not None:
                self._quantize_weight(node, qparams, result)
            self._quantize_constants(node)
        for value, params in qparams.items():
            self._insert_qdq(value, params)
            result.tensors[value.name or ""] = params.describe()
        result.modified = bool(result.tensors) or result.weights > 0
        return result

    # -- which tensors, at which scale ---------------------------------------------------

    def _plan_tensors(
        self, nodes: list[ir.Node], result: QuantizeQDQResult
    ) -> dict[ir.Value, QParams]:
        wanted: dict[ir.Value, QuantSpec] = {}  # the first INT8 node's spec, in topological order
        for node in nodes:
            role = node_role(node)
            spec = activation_spec(node)
            for i in _activation_inputs(node, role):
                value = node.inputs[i] if i < len(node.inputs) else None
                if value is not None and value.dtype == ir.DataType.FLOAT and not _is_const(value):
                    wanted.setdefault(value, spec)
            for value in node.outputs:
                if value.dtype != ir.DataType.FLOAT or _absorbed_by_next(value):
                    continue
                if _float_output(node, value):
                    continue
                wanted.setdefault(value, spec)
        qparams: dict[ir.Value, QParams] = {}
        for value, spec in wanted.items():
            shared = self._shared_source(value, qparams)
            if shared is not None:
                qparams[value] = shared
                continue
            found = self._stats.get(value.name or "")
            params = (
                activation_qparams(found, spec.method, spec.unsigned)
                if found is not None
                else "no calibrated range"
            )
            if isinstance(params, str):
                self._leave_float(value, params, result)
                continue
            qparams[value] = params
        return qparams

    def _shared_source(self, value: ir.Value, qparams: dict[ir.Value, QParams]) -> QParams | None:
        """Data movement keeps its input's qparams (ONNX Runtime then drops the pair)."""
        producer = value.producer()
        if producer is None or node_role(producer) != "shared" or not runs_int8(producer):
            return None
        source = producer.inputs[0] if producer.inputs else None
        return qparams.get(source) if source is not None else None

    def _leave_float(self, value: ir.Value, why: str, result: QuantizeQDQResult) -> None:
        reason = f"tensor {value.name!r}: {why}"
        touched = [u.node for u in value.uses()]
        if value.producer() is not None:
            touched.append(value.producer())  # type: ignore[arg-type]
        for node in touched:
            decision = int8_decision(node)
            if decision is not None and decision.int8:
                node.meta[INT8] = decision.as_float(reason)
                result.left_float[node.name or node.op_type] = reason

    # -- rewriting -----------------------------------------------------------------------

    def _initializer(self, base: str, array: np.ndarray) -> ir.Value:
        return add_initializer(self._graph, self._names, base, array)

    def _dq(self, data: ir.Value, params: QParams, base: str, *, at_top: bool) -> ir.Value:
        scale = self._initializer(f"{base}_scale", params.scale)
        zero = self._initializer(f"{base}_zero_point", params.zero_point)
        out = ir.Value(
            name=self._names.fresh(f"{base}_dq"),
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=data.shape.copy() if data.shape is not None else None,
        )
        attrs = [ir.AttrInt64("axis", params.axis)] if params.axis is not None else []
        node = ir.Node(
            "",
            "DequantizeLinear",
            [data, scale, zero],
            attributes=attrs,
            outputs=[out],
            name=self._names.fresh(f"{base}_DequantizeLinear"),
        )
        if at_top and self._first is not None:
            self._graph.insert_before(self._first, node)
        else:
            self._graph.append(node)
        return out

    def _insert_qdq(self, value: ir.Value, params: QParams) -> None:
        base = value.name or "tensor"
        scale = self._initializer(f"{base}_scale", params.scale)
        zero = self._initializer(f"{base}_zero_point", params.zero_point)
        q_out = ir.Value(
            name=self._names.fresh(f"{base}_quantized"),
            type=ir.TensorType(_NP_TO_IR[params.dtype]),
            shape=value.shape.copy() if value.shape is not None else None,
        )
        dq_out = ir.Value(
            name=self._names.fresh(f"{base}_dequantized"),
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=value.shape.copy() if value.shape is not None else None,
        )
        q = ir.Node(
            "",
            "QuantizeLinear",
            [value, scale, zero],
            outputs=[q_out],
            name=self._names.fresh(f"{base}_QuantizeLinear"),
        )
        dq = ir.Node(
            "",
            "DequantizeLinear",
            [q_out, scale, zero],
            outputs=[dq_out],
            name=self._names.fresh(f"{base}_DequantizeLinear"),
        )
        producer = value.producer()
        if producer is not None:
            self._graph.insert_after(producer, [q, dq])
        elif self._first is not None:
            self._graph.insert_before(self._first, [q, dq])
        else:
            self._graph.extend([q, dq])
        for use in list(value.uses()):
            if use.node is not q:
                use.node.replace_input_with(use.idx, dq_out)
        if value.is_graph_output():
            # The graph output keeps its name and float32 type: the DQ output takes it.
            name = value.name
            for k, out in enumerate(self._graph.outputs):
                if out is value:
                    self._graph.outputs[k] = dq_out
            value.name = self._names.fresh(f"{name}_float")
            dq_out.name = name

    def _quantize_weight(
        self, node: ir.Node, qparams: dict[ir.Value, QParams], result: QuantizeQDQResult
    ) -> None:
        weight = node.inputs[1]
        assert weight is not None
        tensor = const_tensor(weight)
        assert tensor is not None
        array = tensor.numpy()
        spec = weight_spec(node)
        axis = weight_out_axis(node, array.ndim) if spec.per_channel else None
        quantized = quantize_weight(array, axis, qmax=spec.qmax)
        if isinstance(quantized, str):
            node.meta[INT8] = int8_spec_decision(node).as_float(quantized)
            result.left_float[node.name or node.op_type] = quantized
            return
        data, params = quantized
        learned = node.meta.get(ROUNDING)
        if isinstance(learned, LearnedCodes) and learned.fits(data, params.scale):
            data = learned.codes  # AdaRound's choice (mixprec.int8.rounding)
            result.learned_weights += 1
        base = weight.name or f"{node.name}_weight"
        data_value = self._initializer(f"{base}_int8", data)
        node.replace_input_with(1, self._dq(data_value, params, base, at_top=True))
        result.weights += 1
        x = node.inputs[0]
        x_params = qparams.get(x) if x is not None else None
        if self.bias_correction and x is not None and (x.name or "") in self._means:
            self._correct_bias(node, array, data, params, self._means[x.name or ""], result)
        if takes_bias(node) and len(node.inputs) > 2 and node.inputs[2] is not None:
            self._quantize_bias(node, x_params, params, result)

    def _correct_bias(
        self,
        node: ir.Node,
        weight: np.ndarray,
        data: np.ndarray,
        params: QParams,
        mean: np.ndarray,
        result: QuantizeQDQResult,
    ) -> None:
        """``bias -= dW @ E[x]`` (a bias is added when the node has none)."""
        shape = [1] * data.ndim
        if params.axis is not None:
            shape[params.axis] = -1
        dequantized = data.astype(np.float32) * params.scale.reshape(shape)
        attrs = node.attributes
        if node.op_type == "Gemm" and any(
            attrs.get(k) is not None and attrs[k].as_float() != 1.0 for k in ("alpha", "beta")
        ):
            return
        group = attrs.get("group")
        shift = output_shift(
            node.op_type,
            weight,
            dequantized,
            mean,
            group=group.as_int() if group is not None else 1,
            trans_b=trans_b(node),
        )
        if shift is None or not np.all(np.isfinite(shift)):
            return
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        current = const_tensor(bias) if bias is not None else None
        if bias is not None and current is None:
            return  # a computed bias: nothing to fold into
        old = (
            np.zeros(len(shift), np.float32)
            if current is None
            else np.asarray(current.numpy(), np.float32)
        )
        if old.size != len(shift):
            return  # a broadcast Gemm C of another shape
        corrected = (old.reshape(-1) - shift).astype(np.float32).reshape(old.shape)
        base = (bias.name if bias is not None else None) or f"{node.name}_bias"
        value = self._initializer(f"{base}_corrected", corrected)
        if bias is None:
            node.resize_inputs(3)
        node.replace_input_with(2, value)
        result.corrected_biases += 1

    def _quantize_bias(
        self,
        node: ir.Node,
        x_params: QParams | None,
        w_params: QParams,
        result: QuantizeQDQResult,
    ) -> None:
        bias = node.inputs[2]
        assert bias is not None
        tensor = const_tensor(bias)
        if tensor is None or x_params is None:
            result.float_biases.append(node.name or node.op_type)
            return
        quantized = quantize_bias(tensor.numpy(), float(x_params.scale), w_params)
        if isinstance(quantized, str):
            result.float_biases.append(node.name or node.op_type)
            return
        data, params = quantized
        if params.scale.ndim == 0 or w_params.axis is None:
            params = QParams(params.scale, params.zero_point, None)
        base = bias.name or f"{node.name}_bias"
        data_value = self._initializer(f"{base}_int32", data)
        node.replace_input_with(2, self._dq(data_value, params, base, at_top=True))
        result.biases += 1

    def _quantize_constants(self, node: ir.Node) -> None:
        """Constant float inputs of Add/Mul/Concat: uint8/int8 data with their own range."""
        role = node_role(node)
        if role not in ("binary", "concat"):
            return
        for i, value in enumerate(node.inputs):
            if value is None or value.dtype != ir.DataType.FLOAT or not _is_const(value):
                continue
            tensor = const_tensor(value)
            assert tensor is not None
            array = tensor.numpy().astype(np.float32)
            if array.size == 0 or not np.all(np.isfinite(array)):
                continue
            lo, hi = float(array.min()), float(array.max())
            unsigned = activation_spec(node).unsigned
            params = activation_qparams(TensorStats(max(-lo, hi, 0.0), lo, hi), "minmax", unsigned)
            assert not isinstance(params, str)  # a finite, non-empty range always has some
            qmin, qmax = (0, 255) if unsigned else (-127, 127)
            levels = np.round(array / params.scale) + params.zero_point.astype(np.float32)
            data = np.clip(levels, qmin, qmax).astype(params.dtype)
            base = value.name or f"{node.name}_const{i}"
            data_value = self._initializer(f"{base}_q", data)
            node.replace_input_with(i, self._dq(data_value, params, base, at_top=True))


def _demote_unfed(graph: ir.Graph, result: QuantizeQDQResult) -> None:
    """INT8 nodes (other than weighted ones) no longer fed by an INT8 node go float."""
    for node in graph:
        decision = int8_decision(node)
        if decision is None or not decision.int8 or decision.role == "weighted":
            continue
        fed = any(
            v is not None and (p := v.producer()) is not None and runs_int8(p) for v in node.inputs
        )
        if not fed:
            reason = "not fed by an INT8 node once its producer stayed float"
            node.meta[INT8] = decision.as_float(reason)
            result.left_float[node.name or node.op_type] = reason


def node_role(node: ir.Node) -> str | None:
    decision = int8_decision(node)
    return decision.role if decision is not None else None


def _is_const(value: ir.Value) -> bool:
    return const_tensor(value) is not None


def _float_output(node: ir.Node, value: ir.Value) -> bool:
    """A MatMul output that no INT8 node reads stays float: ONNX Runtime runs
    ``DQ(x), DQ(w) -> MatMul`` as MatMulIntegerToFloat, and a Q/DQ pair there would only
    add rounding (on MiniLM, all-INT8 MatMuls with float outputs keep the sentence
    embedding at cosine 0.990 to FP32; quantized outputs, 0.947). Not where ONNX Runtime
    would fuse the MatMul and a bias Add into a float Gemm first (:func:`_gemm_fusion`)."""
    if node.op_type != "MatMul" or node_role(node) != "weighted":
        return False
    if any(runs_int8(use.node) for use in value.uses()):
        return False
    return not _gemm_fusion(node, value)


def _gemm_fusion(node: ir.Node, value: ir.Value) -> bool:
    """Whether ONNX Runtime's MatMulAddFusion (a basic optimization, run before its QDQ
    fusions) would turn ``node`` and the constant Add reading ``value`` into a Gemm: it
    does when the input's shape is static, and the Gemm then runs in float on
    dequantized weights."""
    uses = list(value.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Add" or value.is_graph_output():
        return False
    if not any(v is not value and v is not None and _is_const(v) for v in uses[0].node.inputs):
        return False
    shape = node.inputs[0].shape if node.inputs[0] is not None else None
    return shape is not None and all(isinstance(d, int) for d in shape)


def _absorbed_by_next(value: ir.Value) -> bool:
    """The value's only reader is an INT8 Relu/Clip (which then carries the range)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return False
    reader = uses[0].node
    return node_role(reader) == "absorbed" and runs_int8(reader) and uses[0].idx == 0
