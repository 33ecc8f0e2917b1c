"""The Q/DQ layout for a FakeQuantize runtime (OpenVINO): pairs moved above data movement
exactly, pairs after layers read float dropped, and quantize lays a model out so only
where its runtime asks for it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.core.metrics import rel_l2_error
from mixprec.int8.layout import FakeQuantizeLayoutPass
from mixprec.int8.speed import candidate_placements
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import engine_for


def _init(rng: np.random.Generator, name: str, *shape: int, scale: float = 0.3) -> TensorProto:
    return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)


def _prelu_cnn() -> onnx.ModelProto:
    """MTCNN's shape in small: Conv-PRelu-MaxPool-Conv-PRelu-Flatten-Gemm, 1x3x12x12,
    the Gemm's output a graph output."""
    rng = np.random.default_rng(3)
    slope = numpy_helper.from_array(np.full((8, 1, 1), 0.25, np.float32), "slope")
    slope2 = numpy_helper.from_array(np.full((16, 1, 1), 0.1, np.float32), "slope2")
    inits = [
        _init(rng, "w1", 8, 3, 3, 3), _init(rng, "b1", 8, scale=0.1), slope,
        _init(rng, "w2", 16, 8, 3, 3, scale=0.2), _init(rng, "b2", 16, scale=0.1), slope2,
        _init(rng, "wf", 4, 16 * 4 * 4), _init(rng, "bf", 4, scale=0.1),
    ]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["c1", "slope"], ["r1"], name="prelu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2", pads=[0, 0, 0, 0]),
        helper.make_node("PRelu", ["c2", "slope2"], ["r2"], name="prelu2"),
        helper.make_node("Flatten", ["r2"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "wf", "bf"], ["boxes"], name="fc", transB=1),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "prelu_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _samples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(n)]


def _qdq_after_mover(mover: str, per_channel: bool = False) -> onnx.ModelProto:
    """x -> Relu -> mover -> Q -> DQ -> Conv (y, a graph output): ONNX Runtime's layout
    of a layer input behind data movement."""
    rng = np.random.default_rng(5)
    scale = np.array([0.02] * 4 if per_channel else 0.02, np.float32)
    zero = np.zeros(scale.shape, np.uint8)
    inits = [
        numpy_helper.from_array(scale, "s"),
        numpy_helper.from_array(zero, "z"),
        _init(rng, "w", 2, 4, 1, 1),
        numpy_helper.from_array(np.array([1, 4, 4, 4], np.int64), "shape"),
    ]
    move = (
        helper.make_node("MaxPool", ["r"], ["m"], kernel_shape=[2, 2], strides=[2, 2])
        if mover == "MaxPool"
        else helper.make_node("Reshape", ["r", "shape"], ["m"])
    )
    axis = {"axis": 1} if per_channel else {}
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        move,
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["q"], **axis),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], **axis),
        helper.make_node("Conv", ["dq", "w"], ["y"]),
    ]
    shape = [1, 4, 8, 8] if mover == "MaxPool" else [1, 16, 2, 2]
    graph = helper.make_graph(
        nodes,
        "mover",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("mover", ["MaxPool", "Reshape"])
def test_a_pair_moves_above_data_movement_and_every_output_bit_stays(mover: str) -> None:
    proto = _qdq_after_mover(mover)
    shape = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": np.random.default_rng(7).uniform(-1, 6, shape).astype(np.float32)}
    model = ir.from_proto(proto)
    result = FakeQuantizeLayoutPass()(model)
    assert result.modified and result.hoisted == 1 and result.dropped == 0
    moved = next(n for n in model.graph if n.op_type == mover)
    assert moved.inputs[0].producer().op_type == "DequantizeLinear"  # type: ignore[union-attr]
    quantize = next(n for n in model.graph if n.op_type == "QuantizeLinear")
    assert quantize.inputs[0].producer().op_type == "Relu"  # type: ignore[union-attr]
    got = run_ort(ir.to_proto(model), feeds)["y"]
    want = run_ort(proto, feeds)["y"]
    np.testing.assert_array_equal(got, want, err_msg=f"a pair moved above {mover} changed bits")


def test_a_per_channel_pair_stays_behind_a_reshape() -> None:
    model = ir.from_proto(_qdq_after_mover("Reshape", per_channel=True))
    result = FakeQuantizeLayoutPass()(model)
    assert not result.modified, "a per-axis scale does not follow the axis through a Reshape"


def test_quantize_for_openvino_keeps_pairs_on_layer_inputs_only() -> None:
    """runtime="openvino": no pair after a Conv/Gemm whose readers run float (PRelu, the
    graph output), MaxPool and Flatten read INT8 data; ONNX Runtime's layout keeps both."""
    model, samples = _prelu_cnn(), _samples(8)
    ov = mixprec.quantize(model, samples, speed="off", guard=False, runtime="openvino")
    ort = mixprec.quantize(model, samples, speed="off", guard=False, runtime="ort")
    assert ort.report.quantization is not None and "layout" not in ort.report.quantization
    assert ov.report.quantization is not None
    assert ov.report.quantization["layout"] == {"kind": "fake-quantize", "hoisted": 2, "dropped": 3}
    assert any("laid out for a FakeQuantize runtime" in n for n in ov.report.notes)

    def layer_output_pairs(m: ir.Model) -> list[str]:
        return [
            n.name or ""
            for n in m.graph
            if n.op_type == "QuantizeLinear"
            and (p := n.inputs[0].producer()) is not None  # type: ignore[union-attr]
            and p.op_type in ("Conv", "Gemm")
        ]

    def mover_inputs(m: ir.Model) -> set[str]:
        return {
            n.inputs[0].producer().op_type  # type: ignore[union-attr]
            for n in m.graph
            if n.op_type in ("MaxPool", "Flatten")
        }

    assert layer_output_pairs(ov.model) == [], "pairs left after layers read float"
    assert mover_inputs(ov.model) == {"DequantizeLinear"}
    assert len(layer_output_pairs(ort.model)) == 3  # QLinearConv/QGemm need their outputs
    assert mover_inputs(ort.model) == {"PRelu"}
    assert [o.name for o in ov.model.graph.outputs] == ["boxes"]
    held = _samples(16, seed=9)
    want = np.concatenate([run_ort(model, f)["boxes"] for f in held])
    errors = {
        name: rel_l2_error(want, np.concatenate([run_ort(r.model_proto, f)["boxes"] for f in held]))
        for name, r in (("openvino", ov), ("ort", ort))
    }
    # the same ranges, fewer roundings: the layer outputs read float are not quantized
    assert errors["openvino"] < 0.05 and errors["openvino"] < errors["ort"], errors


def test_the_openvino_layout_runs_in_openvino_near_fp32() -> None:
    pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")
    model = _prelu_cnn()
    result = mixprec.quantize(model, _samples(8), speed="off", guard=False, runtime="openvino")
    options = RuntimeOptions("openvino")
    session = engine_for("openvino").session(result.model_proto, options)
    held = _samples(16, seed=11)
    want = np.concatenate([run_ort(model, f)["boxes"] for f in held])
    got = np.concatenate([session.run(f)["boxes"] for f in held])
    error = rel_l2_error(want, got)
    assert error < 0.05, f"OpenVINO's INT8 boxes against ORT FP32: rel L2 {error:.4f}"


def _affine_cnn() -> onnx.ModelProto:
    """Conv -> Mul(const) -> Add(const) -> Conv: a scale and shift between layers, as
    PP-OCRv4 det's HardSwish blocks have them."""
    rng = np.random.default_rng(4)
    inits = [
        _init(rng, "w1", 8, 3, 3, 3), _init(rng, "w2", 4, 8, 1, 1),
        numpy_helper.from_array(np.full((8, 1, 1), 1.5, np.float32), "gain"),
        numpy_helper.from_array(np.full((8, 1, 1), 0.2, np.float32), "shift"),
    ]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c1", "gain"], ["m"], name="scale"),
        helper.make_node("Add", ["m", "shift"], ["a"], name="shift_add"),
        helper.make_node("Conv", ["a", "w2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "affine_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 12, 12])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_openvino_placements_quantize_layer_inputs_only() -> None:
    """The speed plan offers a FakeQuantize runtime no placement that quantizes ops
    without weights ('chains' put pairs inside PP-OCRv4 det's HardSwish blocks: 1.91x the
    bf16 hint in OpenVINO, layer inputs only 0.95x)."""
    model = ir.from_proto(_affine_cnn())
    ort = candidate_placements(model, ())
    ov = candidate_placements(model, (), "weighted")
    assert any(p.ops == "every" for p in ort.values())
    assert ov and {p.ops for p in ov.values()} == {"weighted"}, ov
    result = mixprec.quantize(
        _affine_cnn(),
        _samples(6),
        speed="off",
        guard=False,
        runtime="openvino",
        placement="weighted",
    )
    quantized = sorted(
        n.inputs[0].producer().op_type  # type: ignore[union-attr]
        for n in result.model.graph
        if n.op_type == "QuantizeLinear" and n.inputs[0].producer() is not None  # type: ignore[union-attr]
    )
    assert quantized == ["Add"], f"pairs on {quantized}: only conv2's input (x is an input)"
