"""The weighted layer: one matcher for every pass that reads a layer's weight.

A weighted layer is an op the registry marks with a ``layer`` kind
(:attr:`~mixprec.core.registry.OpInfo.layer`: Conv, ConvTranspose, Gemm, MatMul): it
multiplies its input 0 by a constant weight, input 1, whose output channels lie along
:func:`~mixprec.core.ops.weight_out_axis`, and may add a bias, input 2. BatchNormalization
folding, SmoothQuant, cross-layer equalization, calibration's layer inputs, bias
correction and the INT8 plan all ask :func:`match_layer`, which returns the layer or the
reason the node is not one (as the onnxscript rewriter's ``check`` does), so that a
difference in membership is a fact of the registry (ConvTranspose: a layer, no INT8
role), not of a list written in each pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.ops import is_onnx_domain, weight_out_axis
from mixprec.core.registry import node_info, op_info

__all__ = ["BIASED_KINDS", "WeightedLayer", "is_layer", "match_layer", "takes_bias"]

#: The layer kinds with a bias input (2): a bias folds or corrects into it.
BIASED_KINDS = frozenset({"conv", "dense"})


@dataclass(frozen=True)
class WeightedLayer:
    """A node that :func:`match_layer` matched.

    Attributes:
        node: the layer.
        kind: its registry kind: "conv", "dense" or "matmul".
        x: its activation input (input 0).
        weight: its weight value (input 1), a constant.
        tensor: the weight's constant tensor.
        bias: its bias value (input 2), or None (a MatMul, or none given).
        out_axis: the weight's output-channel axis.
    """

    node: ir.Node
    kind: str
    x: ir.Value
    weight: ir.Value
    tensor: ir.TensorProtocol
    bias: ir.Value | None
    out_axis: int

    @property
    def int8(self) -> bool:
        """Whether INT8 quantizes it (its registry ``int8`` role is "weighted")."""
        return node_info(self.node).int8 == "weighted"


def is_layer(node: ir.Node | onnx.NodeProto) -> bool:
    """Whether ``node`` (an IR node, or a node of a model proto: its op and domain are
    all this reads) is an op of the default domain the registry calls a layer (its
    weight not looked at)."""
    return op_info(node.op_type, node.domain).layer is not None and is_onnx_domain(node.domain)


def takes_bias(node: ir.Node) -> bool:
    """Whether ``node`` is a layer with a bias input (Conv, ConvTranspose, Gemm): what
    BatchNormalization folds into and bias correction corrects."""
    return is_layer(node) and node_info(node).layer in BIASED_KINDS


def match_layer(node: ir.Node) -> WeightedLayer | str:
    """``node`` as a weighted layer with a constant weight, or why it is not one."""
    kind = node_info(node).layer
    if kind is None or not is_onnx_domain(node.domain):
        return f"{node.op_type} is not a weighted layer"
    inputs = node.inputs
    if len(inputs) < 2 or inputs[0] is None or inputs[1] is None:
        return "no activation or weight input"
    tensor = const_tensor(inputs[1])
    if tensor is None:
        return "its weight is not a constant"
    out_axis = weight_out_axis(node, len(tensor.shape))
    if out_axis is None:
        return "its weight has no output-channel axis"
    bias = inputs[2] if kind in BIASED_KINDS and len(inputs) > 2 else None
    return WeightedLayer(node, kind, inputs[0], inputs[1], tensor, bias, out_axis)
