"""Issue 27, rule 1: a float path rounded into a count or a shape stays FP32.

The model is a TTS duration path (VITS: ``Exp -> Mul -> Ceil -> (ReduceSum, CumSum)``,
the sum a Range's limit): fp16 holds ``exp(2.303) = 10.0015`` as 10, Ceil gives 10 instead
of 11, and the number of frames changes. Outputs are compared with ONNX Runtime runs of
the FP32 model; the converted model runs with every low tensor rounded
(:func:`~mixprec.passes.emulate.emulate_low_precision`: ONNX Runtime's CPU provider
computes many fp16 ops in float32 and would hide the rounding).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort
from mixprec.cli.main import main
from mixprec.core.registry import register_op
from mixprec.core.rules import RULES
from mixprec.passes.emulate import emulate_low_precision
from mixprec.precision.paint import Precision, painted

T = 16  # phonemes
#: log-durations fp16 holds exactly whose exp lies just above an integer that fp16
#: rounds it to (exp(2.303) = 10.0015 -> 10.0): each Ceil loses one frame in fp16
EDGE = np.array([0.6934, 1.099, 1.387, 1.792, 2.197, 2.303, 0.3, 1.5], np.float16)
COUNT_PATH = ("dp_proj", "squeeze", "exp", "scale", "ceil")


def _duration_model() -> onnx.ModelProto:
    """x -> MatMul (the duration predictor's projection) -> Exp -> Mul(length scale) ->
    Ceil -> CumSum / ReduceSum -> Cast -> Range (the frames); beside it, x -> MatMul (the
    encoder), which must stay fp16."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array([[1.0], [0.0], [0.0], [0.0]], np.float32), "w_dp"),
        numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "w_h"),
        numpy_helper.from_array(np.array(1.0, np.float32), "length_scale"),
        numpy_helper.from_array(np.array([2], np.int64), "axes"),
        numpy_helper.from_array(np.array(1, np.int64), "axis"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_dp"], ["logw3"], name="dp_proj"),
        helper.make_node("Squeeze", ["logw3", "axes"], ["logw"], name="squeeze"),
        helper.make_node("Exp", ["logw"], ["w"], name="exp"),
        helper.make_node("Mul", ["w", "length_scale"], ["ws"], name="scale"),
        helper.make_node("Ceil", ["ws"], ["durations"], name="ceil"),
        helper.make_node("CumSum", ["durations", "axis"], ["ends"], name="cumsum"),
        helper.make_node("ReduceSum", ["durations"], ["total_f"], name="total", keepdims=0),
        helper.make_node("Cast", ["total_f"], ["total"], name="to_int", to=TensorProto.INT64),
        helper.make_node("Range", ["zero", "total", "one"], ["frames"], name="frames"),
        helper.make_node("MatMul", ["x", "w_h"], ["hidden"], name="encoder"),
    ]
    graph = helper.make_graph(
        nodes,
        "durations",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T, 4])],
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, T, 8]),
            helper.make_tensor_value_info("durations", TensorProto.FLOAT, [1, T]),
            helper.make_tensor_value_info("ends", TensorProto.FLOAT, [1, T]),
            helper.make_tensor_value_info("frames", TensorProto.INT64, [None]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds() -> dict[str, np.ndarray]:
    x = np.random.default_rng(1).standard_normal((1, T, 4)).astype(np.float32)
    x[0, :, 0] = np.resize(EDGE, T)
    return {"x": x}


def _low_run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return run_ort(emulate_low_precision(proto), feeds)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_duration_path_keeps_its_lengths_and_values(dtype: str) -> None:
    model, feeds = _duration_model(), _feeds()
    ref = run_ort(model, feeds)
    assert ref["frames"].shape == (94,)
    result = mixprec.convert(model, dtype, calibration_data=[feeds])
    out = _low_run(result.model_proto, feeds)
    for name, value in ref.items():
        assert out[name].shape == value.shape, name
        assert_close(value, out[name], "fp16", name=name)  # 1e-2 for bf16 too
    np.testing.assert_array_equal(out["durations"], ref["durations"])
    decisions = {node.name: d for node, d in painted(result.model)}
    assert decisions["encoder"].precision is Precision.LOW
    for name in COUNT_PATH:
        d = decisions[name]
        assert d.precision is Precision.FP32 and "decides a count" in d.reason, (name, d)
    assert "rounded into" in decisions["ceil"].reason
    assert "feeds only Ceil 'ceil'" in decisions["exp"].reason


def test_without_the_rule_fp16_changes_the_length() -> None:
    """What the rule prevents, shown by the documented override: the rule removed,
    the default fp16 conversion loses frames."""
    model, feeds = _duration_model(), _feeds()
    saved = {op: RULES[("", op)] for op in ("Ceil", "Floor", "Round", "Cast")}
    try:
        for op in saved:
            mixprec.register_rule(op, mixprec.OpRule())
        result = mixprec.convert(model, "fp16", calibration_data=[feeds])
    finally:
        for op, rule in saved.items():
            mixprec.register_rule(op, rule)
    out = _low_run(result.model_proto, feeds)
    assert out["frames"].shape[0] < run_ort(model, feeds)["frames"].shape[0]


def test_force_all_overrides_the_rule() -> None:
    result = mixprec.convert(_duration_model(), "fp16", calibration_data=[_feeds()], force_all=True)
    assert all(d.precision is Precision.LOW for _, d in painted(result.model))


def test_shape_arithmetic_rounded_into_resize_sizes_stays_fp32() -> None:
    """Cast(Shape) -> Mul(scale) -> Floor -> Cast -> Concat -> Resize sizes: the
    Mul is a count; the Resize itself (data movement on low values) follows its input."""
    inits = [
        numpy_helper.from_array(np.array([1.7], np.float32), "ratio"),
        numpy_helper.from_array(np.array([1, 4], np.int64), "lead"),
        numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Shape", ["x"], ["shape"], name="shape", start=3),
        helper.make_node("Cast", ["shape"], ["width"], name="width", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["width", "ratio"], ["scaled"], name="scaled"),
        helper.make_node("Floor", ["scaled"], ["floored"], name="floor"),
        helper.make_node("Cast", ["floored"], ["w_int"], name="w_int", to=TensorProto.INT64),
        helper.make_node("Concat", ["lead", "w_int", "w_int"], ["sizes"], name="sizes", axis=0),
        helper.make_node("Resize", ["c", "", "", "sizes"], ["y"], name="resize", mode="nearest"),
    ]
    graph = helper.make_graph(
        nodes,
        "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 4, 5, 5)).astype(np.float32)}
    result = mixprec.convert(model, "fp16", calibration_data=[feeds])
    decisions = {node.name: d for node, d in painted(result.model)}
    assert decisions["conv"].precision is Precision.LOW
    for name in ("width", "scaled", "floor", "w_int"):
        assert "decides a count" in decisions[name].reason, (name, decisions[name])
    ref = run_ort(model, feeds)["y"]
    assert_close(ref, _low_run(result.model_proto, feeds)["y"], "fp16")


def test_the_reason_is_shown_by_inspect_and_lists(tmp_path, capsys) -> None:
    path = tmp_path / "durations.onnx"
    onnx.save(_duration_model(), path)
    np.savez(tmp_path / "x.npz", x=_feeds()["x"][None])
    status = main(["inspect", str(path), "--calibration-data", str(tmp_path / "x.npz")])
    shown = capsys.readouterr().out
    assert status == 0
    assert "decides a count" in shown and "rounded into" in shown, shown
    assert main(["lists", "--dtype", "fp16"]) == 0
    listed = capsys.readouterr().out
    assert "ai.onnx::Ceil" in listed and "decides a count" in listed, listed


def test_the_new_facts_are_checked() -> None:
    with pytest.raises(TypeError, match="count_inputs"):
        register_op("Foo", count_inputs=[1])
    with pytest.raises(TypeError, match="fp32_upstream"):
        mixprec.register_rule("Floor", mixprec.OpRule(fp32_upstream="yes"))  # type: ignore[arg-type]
    assert RULES[("", "Floor")].fp32_upstream
