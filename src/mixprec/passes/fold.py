"""Fold inference-mode BatchNormalization into the Conv/ConvTranspose/Gemm before it.

Done in float32 before painting: the folded weights absorb the running statistics, so
variances of 1e8 (which overflow float16) disappear instead of pinning nodes to FP32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import UniqueNames, iter_nodes
from mixprec.core.layers import takes_bias
from mixprec.core.ops import is_onnx_domain, weight_out_axis

__all__ = ["BN_STATS", "FoldBatchNormPass", "FoldBatchNormResult"]

#: ``node.meta`` key on a Conv/ConvTranspose/Gemm a BatchNormalization was folded into: the
#: per-channel mean and standard deviation of its output as the BN's own parameters give
#: them (beta, |gamma|), for data-free high-bias absorption (:mod:`mixprec.int8.equalize`).
BN_STATS = "mixprec.bn_stats"


@dataclasses.dataclass
class FoldBatchNormResult(ir.passes.PassResult):
    folded: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = const_tensor(value)
    if tensor is None or tensor.dtype != ir.DataType.FLOAT:
        return None
    try:
        return tensor.numpy().astype(np.float64)
    except ValueError:  # data that does not fit its dims: CheckInputPass names it
        return None


def _attr_number(node: ir.Node, name: str, default: float) -> float | None:
    """A FLOAT or INT attribute's value, ``default`` when absent, None when of another type."""
    attr = node.attributes.get(name)
    if attr is None:
        return default
    if attr.type == ir.AttributeType.FLOAT:
        return attr.as_float()
    if attr.type == ir.AttributeType.INT:
        return float(attr.as_int())
    return None


class FoldBatchNormPass(ir.passes.InPlacePass):
    """``Conv -> BatchNormalization`` becomes one Conv with scaled weights and a bias.

    Applies when the BN is in inference mode (one output, ``training_mode`` 0), all its
    parameters and the producer's weights are float32 constants, the producer's output
    feeds only the BN and is not a graph output. ConvTranspose is folded for group 1.
    Gemm is folded when BN normalises its columns (2-D output).
    """

    def call(self, model: ir.Model) -> FoldBatchNormResult:
        result = FoldBatchNormResult(model, modified=False)
        self._names = UniqueNames(model)
        for bn in list(iter_nodes(model.graph)):
            if bn.op_type != "BatchNormalization" or not is_onnx_domain(bn.domain):
                continue
            why = self._try_fold(bn)
            if why is None:
                result.folded.append(bn.name or "")
                result.modified = True
            elif why:
                result.skipped[bn.name or ""] = why
        return result

    def _try_fold(self, bn: ir.Node) -> str | None:
        training = _attr_number(bn, "training_mode", 0)
        if training is None or training:
            return "training mode"
        if len([o for o in bn.outputs if o is not None and o.name]) > 1 and any(
            o.uses() or o.is_graph_output() for o in bn.outputs[1:]
        ):
            return "uses running statistics outputs"
        x = bn.inputs[0]
        producer = x.producer() if x is not None else None
        if producer is None or not takes_bias(producer):
            return ""  # nothing to fold into: not worth reporting
        if producer.graph is not bn.graph:
            return "producer in another graph"
        assert x is not None
        if len(x.uses()) != 1 or x.is_graph_output():
            return f"{producer.op_type} output has other consumers"
        params = [_const(v) for v in bn.inputs[1:5]]
        scale, bias, mean, var = params
        if scale is None or bias is None or mean is None or var is None:
            return "BatchNormalization parameters are not float32 constants"
        eps = _attr_number(bn, "epsilon", 1e-5)
        if eps is None:
            return "epsilon is not a number"
        factor = scale / np.sqrt(var + eps)
        shift = bias - mean * factor
        weight = _const(producer.inputs[1] if len(producer.inputs) > 1 else None)
        if weight is None:
            return f"{producer.op_type} weight is not a float32 constant"
        old_bias = None
        if len(producer.inputs) > 2 and producer.inputs[2] is not None:
            old_bias = _const(producer.inputs[2])
            if old_bias is None:
                return f"{producer.op_type} bias is not a float32 constant"
        channels = factor.shape[0]
        if producer.op_type == "ConvTranspose" and _attr_number(producer, "group", 1) != 1:
            return "ConvTranspose with group > 1"
        transposed = producer.attributes.get("transB")
        if producer.op_type == "Gemm" and transposed and transposed.type != ir.AttributeType.INT:
            return "Gemm transB is not an int"
        # The weight axis that holds the output channels the BatchNormalization scales.
        axis = weight_out_axis(producer, weight.ndim)
        if (
            axis is None
            or factor.ndim != 1
            or weight.ndim <= axis
            or weight.shape[axis] != channels
        ):
            return "channel count mismatch"
        per_axis = [1] * weight.ndim
        per_axis[axis] = -1
        if old_bias is None:
            b = np.zeros(channels)
        elif producer.op_type == "Gemm":
            if old_bias.ndim > 1:
                return "Gemm bias is not per-column"
            beta = _attr_number(producer, "beta", 1.0)
            if beta is None:
                return "Gemm beta is not a number"
            b = np.broadcast_to(old_bias * beta, (channels,)).astype(np.float64)
        else:
            b = old_bias
        self._rewire(bn, producer, weight * factor.reshape(per_axis), b * factor + shift)
        producer.meta[BN_STATS] = (bias.copy(), np.abs(scale))
        return None

    def _rewire(self, bn: ir.Node, producer: ir.Node, new_w: np.ndarray, new_b: np.ndarray) -> None:
        """Give ``producer`` the folded weight and bias and drop ``bn``."""
        if producer.op_type == "Gemm":
            producer.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        graph = producer.graph
        assert graph is not None
        base = producer.name or "folded"
        w_val = _add_initializer(graph, self._names.fresh(f"{base}_W_bnfold"), new_w)
        b_val = _add_initializer(graph, self._names.fresh(f"{base}_B_bnfold"), new_b)
        producer.replace_input_with(1, w_val)
        if len(producer.inputs) < 3:
            producer.resize_inputs(3)
        producer.replace_input_with(2, b_val)
        x, y = bn.inputs[0], bn.outputs[0]
        assert x is not None
        if y.is_graph_output():
            # Keep the output's name: hand it to the producer's output.
            name = y.name
            y.replace_all_uses_with(x, replace_graph_outputs=True)
            y.name = None
            x.name = name
        else:
            y.replace_all_uses_with(x)
        x.type = y.type or x.type
        if y.shape is not None:
            x.shape = y.shape
        graph.remove(bn, safe=True)


def _add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register ``array`` (as float32) as a new initializer of ``graph``."""
    tensor = ir.tensor(array.astype(np.float32), name=name)
    value = ir.Value(
        name=name,
        type=ir.TensorType(ir.DataType.FLOAT),
        shape=ir.Shape(list(array.shape)),
        const_value=tensor,
    )
    graph.register_initializer(value)
    return value


_DTYPE_CODES = frozenset(int(t) for t in ir.DataType)


@dataclasses.dataclass
class FoldCastsResult(ir.passes.PassResult):
    folded: int = 0  # Casts of constants replaced by constants
    identities: int = 0  # Casts to the dtype their input already has


class FoldCastsPass(ir.passes.InPlacePass):
    """Fold ``Cast(constant)`` into a constant and drop ``Cast`` to the input's own dtype.

    Exporters leave many of both in shape arithmetic (int32 <-> int64). A Cast whose
    output is a graph output is kept: its name is part of the interface. Only float
    identity Casts go (they would pin a painted region to float32); integer ones stay,
    since dropping them buys nothing and can change ONNX Runtime's fusions for the worse
    (CREPE: int64 Casts before six Pads kept ORT on its faster NCHWc path; without them
    it fused the Pads into the Convs and ran 1.9x slower).
    """

    def call(self, model: ir.Model) -> FoldCastsResult:
        result = FoldCastsResult(model, modified=False)
        for node in list(iter_nodes(model.graph)):
            if node.op_type != "Cast" or not is_onnx_domain(node.domain):
                continue
            src, out = node.inputs[0], node.outputs[0]
            to = node.attributes.get("to")
            if src is None or to is None or out.is_graph_output() or node.graph is None:
                continue
            if to.type != ir.AttributeType.INT or to.as_int() not in _DTYPE_CODES:
                continue  # malformed: CheckInputPass reports it
            target = ir.DataType(to.as_int())
            if src.dtype == target and not target.is_floating_point():
                continue
            if src.dtype == target:
                out.replace_all_uses_with(src)
                node.graph.remove(node, safe=True)
                result.identities += 1
                result.modified = True
                continue
            tensor = const_tensor(src)
            if tensor is None or src.is_graph_input() or tensor.size > 4096:
                continue  # only small constants: large weights are the rewriter's job
            if ir.DataType.STRING in (tensor.dtype, target) or ir.DataType.UNDEFINED in (
                tensor.dtype,
                target,
            ):
                continue
            try:
                array = tensor.numpy()
            except ValueError:  # data that does not fit its dims: CheckInputPass names it
                continue
            folded = ir.tensor(array.astype(target.numpy()), dtype=target)
            value = ir.Value(name=out.name, type=ir.TensorType(target), shape=out.shape)
            const = ir.Node(
                "",
                "Constant",
                inputs=[],
                attributes=[ir.AttrTensor("value", folded)],
                outputs=[value],
                name=node.name,
            )
            out.name = None
            node.graph.insert_before(node, const)
            out.replace_all_uses_with(value)
            node.graph.remove(node, safe=True)
            result.folded += 1
            result.modified = True
        return result
