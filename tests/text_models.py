"""Tiny models written in ONNX text, shared by the pass and composition tests."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir


def filled_model(
    text: str, *, seed: int = 0, scale: float = 0.1, **arrays: np.ndarray
) -> onnx.ModelProto:
    """Parse ``text`` and fill its declared initializers (seeded normal * scale, or given)."""
    proto = onnx.parser.parse_model(text)
    rng = np.random.default_rng(seed)
    produced = {o for n in proto.graph.node for o in n.output}
    declared = [vi for vi in proto.graph.value_info if vi.name not in produced]
    for vi in declared:
        dims = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        arr = arrays.get(vi.name)
        if arr is None:
            arr = rng.standard_normal(dims) * scale
        proto.graph.initializer.append(
            onnx.numpy_helper.from_array(np.asarray(arr, np.float32), vi.name)
        )
    keep = [vi for vi in proto.graph.value_info if vi.name in produced]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(keep)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def ir_model(text: str | onnx.ModelProto) -> ir.Model:
    proto = filled_model(text) if isinstance(text, str) else text
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    ir.passes.common.NameFixPass()(model)
    return model


def op_list(model: ir.Model | onnx.ModelProto) -> list[str]:
    graph = model.graph
    return (
        [n.op_type for n in graph.node]
        if isinstance(model, onnx.ModelProto)
        else [n.op_type for n in graph]
    )


def report_row(result, name: str):
    return next(n for n in result.report.nodes if n.name == name)


def full_check(proto: onnx.ModelProto) -> None:
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)


CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,4,8,8] y) <float[4,4,3,3] w1, float[4,4,3,3] w2> {
    c1 = Conv <pads = [1,1,1,1]> (x, w1)
    e = Exp (c1)
    a = Add (e, c1)
    r = Relu (a)
    y = Conv <pads = [1,1,1,1]> (r, w2)
}
"""


def chain_model() -> onnx.ModelProto:
    return filled_model(CHAIN)
