"""Protobuf model builders shared by the runtime-side tests (feeds, ORT, calibration...)."""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
BF16 = TensorProto.BFLOAT16
OPSET = 21


def _model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _vi(name: str, elem: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(values, name=name)


def _const(output: str, values: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [output], value=numpy_helper.from_array(values))


def _low_tensor_types(model: onnx.ModelProto) -> set[int]:
    """Low element types of any value, initializer or constant, subgraphs included.

    Also checks that every Cast to a low type only feeds Casts back to float32 (the
    rounding round trip of the emulation).
    """
    low = {F16, BF16}
    found: set[int] = set()

    def graphs(g: onnx.GraphProto) -> list[onnx.GraphProto]:
        out = [g]
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    out += graphs(a.g)
        return out

    for g in graphs(model.graph):
        found.update(t.data_type for t in g.initializer)
        for vi in [*g.input, *g.output, *g.value_info]:
            found.add(vi.type.tensor_type.elem_type)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    found.add(a.t.data_type)
            to = {a.name: a.i for a in n.attribute}.get("to")
            if n.op_type == "Cast" and to in low:
                users = [u for u in g.node if n.output[0] in u.input]
                assert users and all(
                    u.op_type == "Cast" and u.attribute[0].i == F32 for u in users
                ), f"Cast {n.name} to {to} is not a rounding round trip: {users}"
    return found & low


def _assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (
        f"{bad.size} values differ, first at {bad[:5].tolist()}: "
        f"got {got.ravel()[bad[:5]].tolist()}, want {want.ravel()[bad[:5]].tolist()}"
    )


def _fp16_mlp(low: int = F16, low_io: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(fp32 original, low-precision version): y = Relu(x @ W + B)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    original = _model(
        [
            helper.make_node("MatMul", ["x", "W"], ["mm"]),
            helper.make_node("Add", ["mm", "B"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        [_vi("x", F32, [4, 16])],
        [_vi("y", F32, [4, 32])],
        [_tensor("W", w), _tensor("B", b)],
    )
    np_low = np.float16 if low == F16 else ml_dtypes.bfloat16
    body = [
        helper.make_node("MatMul", ["xl", "Wl"], ["mm"]),
        helper.make_node("Add", ["mm", "Bl"], ["z"]),
        helper.make_node("Relu", ["z"], ["yl"]),
    ]
    inits = [_tensor("Wl", w.astype(np_low)), _tensor("Bl", b.astype(np_low))]
    if low_io:
        body[0].input[0] = "x"
        body[2].output[0] = "y"
        converted = _model(body, [_vi("x", low, [4, 16])], [_vi("y", low, [4, 32])], inits)
    else:
        nodes = [helper.make_node("Cast", ["x"], ["xl"], to=low), *body]
        nodes.append(helper.make_node("Cast", ["yl"], ["y"], to=F32))
        converted = _model(nodes, [_vi("x", F32, [4, 16])], [_vi("y", F32, [4, 32])], inits)
    return original, converted
