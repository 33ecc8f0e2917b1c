"""INT8 + FP16/BF16: the nodes an INT8 plan leaves float are painted low by the painter.

After ``quantize``'s apply stage, the FP16/BF16 pipeline's annotate, apply, cleanup and
check stages run on the quantized model with every INT8 node, and every node the INT8
conversion added (QuantizeLinear/DequantizeLinear, the dynamic MatMul pattern), excluded
by name: those keep float32 around their integer kernels, so ONNX Runtime still fuses
them, and Casts go where the painted parts meet them. The painter reads the INT8
calibration's ranges from ``model.meta`` (the tensors keep their names), so its range
checks work as in ``convert``.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import onnx_ir as ir

from mixprec.core.config import ConvertConfig
from mixprec.core.policy import default_policy
from mixprec.int8.plan import runs_int8
from mixprec.passes.shapes import InferShapesPass
from mixprec.pipeline.stages import Pipeline
from mixprec.precision.paint import Precision, painted

__all__ = ["paint_fallback"]


def paint_fallback(
    model: ir.Model, target: str, planned: Collection[ir.Node], *, check: bool = True
) -> tuple[ir.Model, dict[str, str]]:
    """Paint the float nodes of a quantized ``model`` in ``target`` (fp16 or bf16).

    ``planned`` are the nodes present before the INT8 conversion ran: any other node was
    added by it and stays float32. Returns the model and, by node name, the painted
    nodes' low-precision reason.
    """
    keep = [node.name or "" for node in model.graph if node not in planned or runs_int8(node)]
    policy = default_policy(target).with_changes(
        exclude_nodes=[re.escape(name) for name in keep if name]
    )
    config = ConvertConfig(policy=policy, fold_batchnorm=False, check=check)
    InferShapesPass(only_untyped=True)(model)  # the values the INT8 conversion added
    model = Pipeline(config).run(model, start="annotate")
    low = {
        node.name or "": decision.reason
        for node, decision in painted(model)
        if decision.precision is Precision.LOW
    }
    return model, low
