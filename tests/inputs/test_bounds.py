"""io.bounds: the least lengths the ops reading an input need (folded constants too)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from mixprec.inputs.bounds import length_bounds, next_step


def _ir(nodes, inputs, inits, opset: int = 18) -> ir.Model:
    out = [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, [])]
    del out[0].type.tensor_type.shape.dim[:]  # rank 0 would be wrong: leave it unknown
    out[0].type.tensor_type.ClearField("shape")
    graph = helper.make_graph(nodes, "g", inputs, out, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return ir.from_proto(model)


def test_a_reflect_pad_whose_widths_are_computed_from_constants() -> None:
    """PyTorch writes pads as Concat/Reshape/Cast of constants: they are folded."""
    tail = numpy_helper.from_array(np.array([0, 48], np.int32), "tail")
    head = numpy_helper.from_array(np.array([0, 0], np.int32), "head")
    model = _ir(
        [
            helper.make_node("Concat", ["head", "tail"], ["p32"], axis=0),
            helper.make_node("Cast", ["p32"], ["pads"], to=TensorProto.INT64),
            helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T"])],
        [head, tail],
    )
    assert length_bounds(model) == {("x", 1): (49, "the reflect Pad '' pads 48")}


def test_windows_and_frames() -> None:
    w = numpy_helper.from_array(np.ones((2, 1, 5, 9), np.float32), "w")
    conv = _ir(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 1, 0, 1])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "H", "W"])],
        [w],
    )
    found = length_bounds(conv)
    assert {k: v[0] for k, v in found.items()} == {("x", 2): 5, ("x", 3): 7}, found
    step = numpy_helper.from_array(np.array(64, np.int64), "step")
    frame = numpy_helper.from_array(np.array(400, np.int64), "frame")
    stft = _ir(
        [helper.make_node("STFT", ["x", "step", "", "frame"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 1])],
        [step, frame],
        opset=17,
    )
    assert length_bounds(stft) == {("x", 1): (400, "the STFT '' takes frames of 400")}
    assert [next_step(n) for n in (1, 64, 65, 400, 5000)] == [64, 64, 256, 512, 5000]


def test_edge_pads_and_inputs_read_through_other_ops_give_no_bound() -> None:
    pads = numpy_helper.from_array(np.array([0, 99, 0, 99], np.int64), "pads")
    model = _ir(
        [
            helper.make_node("Pad", ["x", "pads"], ["e"], mode="edge"),
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Pad", ["r", "pads"], ["y"], mode="reflect"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T"])],
        [pads],
    )
    assert length_bounds(model) == {}
