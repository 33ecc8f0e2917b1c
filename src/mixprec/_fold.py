"""Fold inference-mode BatchNormalization into the Conv/ConvTranspose/Gemm before it.

Done in float32 before painting: the folded weights absorb the running statistics, so
variances of 1e8 (which overflow float16) disappear instead of pinning nodes to FP32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mixprec._constants import const_tensor
from mixprec._paint import iter_nodes

__all__ = ["FoldBatchNormPass", "FoldBatchNormResult"]


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
    return tensor.numpy().astype(np.float64)


class FoldBatchNormPass(ir.passes.InPlacePass):
    """``Conv -> BatchNormalization`` becomes one Conv with scaled weights and a bias.

    Applies when the BN is in inference mode (one output, ``training_mode`` 0), all its
    parameters and the producer's weights are float32 constants, the producer's output
    feeds only the BN and is not a graph output. ConvTranspose is folded for group 1.
    Gemm is folded when BN normalises its columns (2-D output).
    """

    def call(self, model: ir.Model) -> FoldBatchNormResult:
        result = FoldBatchNormResult(model, modified=False)
        for bn in list(iter_nodes(model.graph)):
            if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx"):
                continue
            why = self._try_fold(bn)
            if why is None:
                result.folded.append(bn.name or "")
                result.modified = True
            elif why:
                result.skipped[bn.name or ""] = why
        return result

    def _try_fold(self, bn: ir.Node) -> str | None:
        training = bn.attributes.get("training_mode")
        if training is not None and training.as_int():
            return "training mode"
        if len([o for o in bn.outputs if o is not None and o.name]) > 1 and any(
            o.uses() or o.is_graph_output() for o in bn.outputs[1:]
        ):
            return "uses running statistics outputs"
        x = bn.inputs[0]
        producer = x.producer() if x is not None else None
        if producer is None or producer.op_type not in ("Conv", "ConvTranspose", "Gemm"):
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
        eps_attr = bn.attributes.get("epsilon")
        eps = eps_attr.as_float() if eps_attr is not None else 1e-5
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
        if producer.op_type == "Conv":
            if weight.shape[0] != channels:
                return "channel count mismatch"
            new_w = weight * factor.reshape((-1,) + (1,) * (weight.ndim - 1))
            b = old_bias if old_bias is not None else np.zeros(channels)
            new_b = b * factor + shift
        elif producer.op_type == "ConvTranspose":
            group = producer.attributes.get("group")
            if group is not None and group.as_int() != 1:
                return "ConvTranspose with group > 1"
            if weight.shape[1] != channels:
                return "channel count mismatch"
            new_w = weight * factor.reshape((1, -1) + (1,) * (weight.ndim - 2))
            b = old_bias if old_bias is not None else np.zeros(channels)
            new_b = b * factor + shift
        else:  # Gemm
            trans_b = producer.attributes.get("transB")
            tb = trans_b.as_int() if trans_b is not None else 0
            beta_attr = producer.attributes.get("beta")
            beta = beta_attr.as_float() if beta_attr is not None else 1.0
            if tb:
                if weight.shape[0] != channels:
                    return "channel count mismatch"
                new_w = weight * factor.reshape(-1, 1)
            else:
                if weight.shape[1] != channels:
                    return "channel count mismatch"
                new_w = weight * factor.reshape(1, -1)
            if old_bias is not None and old_bias.ndim > 1:
                return "Gemm bias is not per-column"
            b = (
                np.broadcast_to(old_bias * beta, (channels,)).astype(np.float64)
                if old_bias is not None
                else np.zeros(channels)
            )
            new_b = b * factor + shift
            producer.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
        graph = producer.graph
        assert graph is not None
        base = producer.name or "folded"
        w_val = ir.Value(
            name=_fresh(graph, f"{base}_W_bnfold"),
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=ir.Shape(list(new_w.shape)),
            const_value=ir.tensor(new_w.astype(np.float32)),
        )
        b_val = ir.Value(
            name=_fresh(graph, f"{base}_B_bnfold"),
            type=ir.TensorType(ir.DataType.FLOAT),
            shape=ir.Shape([channels]),
            const_value=ir.tensor(new_b.astype(np.float32)),
        )
        assert w_val.const_value is not None and b_val.const_value is not None
        w_val.const_value.name = w_val.name
        b_val.const_value.name = b_val.name
        graph.register_initializer(w_val)
        graph.register_initializer(b_val)
        producer.replace_input_with(1, w_val)
        if len(producer.inputs) > 2:
            producer.replace_input_with(2, b_val)
        else:
            producer.resize_inputs(3)
            producer.replace_input_with(2, b_val)
        y = bn.outputs[0]
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
        return None


def _fresh(graph: ir.Graph, base: str) -> str:
    name = base
    k = 1
    while name in graph.initializers:
        name = f"{base}_{k}"
        k += 1
    return name


@dataclasses.dataclass
class FoldCastsResult(ir.passes.PassResult):
    folded: int = 0  # Casts of constants replaced by constants
    identities: int = 0  # Casts to the dtype their input already has


class FoldCastsPass(ir.passes.InPlacePass):
    """Fold ``Cast(constant)`` into a constant and drop ``Cast`` to the input's own dtype.

    Exporters leave many of both in shape arithmetic (int32 <-> int64). A Cast whose
    output is a graph output is kept: its name is part of the interface.
    """

    def call(self, model: ir.Model) -> FoldCastsResult:
        result = FoldCastsResult(model, modified=False)
        for node in list(iter_nodes(model.graph)):
            if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
                continue
            src, out = node.inputs[0], node.outputs[0]
            to = node.attributes.get("to")
            if src is None or to is None or out.is_graph_output() or node.graph is None:
                continue
            target = ir.DataType(to.as_int())
            if src.dtype == target:
                out.replace_all_uses_with(src)
                node.graph.remove(node, safe=True)
                result.identities += 1
                result.modified = True
                continue
            tensor = const_tensor(src)
            if tensor is None or src.is_graph_input() or tensor.size > 4096:
                continue  # only small constants: large weights are the rewriter's job
            if ir.DataType.STRING in (tensor.dtype, target):
                continue
            folded = ir.tensor(tensor.numpy().astype(target.numpy()), dtype=target)
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
