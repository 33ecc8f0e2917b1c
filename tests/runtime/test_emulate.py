"""Tests of EmulateLowPrecisionPass: FP32 emulation of float16/bfloat16 models."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mixprec.core.metrics import rel_l2_error
from mixprec.passes.emulate import emulate_low_precision
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import run_model
from proto_builders import (
    BF16,
    F16,
    F32,
    _assert_bits_equal,
    _const,
    _fp16_mlp,
    _low_tensor_types,
    _model,
    _tensor,
    _vi,
)

#: ONNX Runtime with its basic graph optimizations, as the tests' references run.
BASIC = RuntimeOptions("ort", optimization="basic")


def test_emulated_fp16_model_matches_real_fp16_run() -> None:
    _, converted = _fp16_mlp()
    before = converted.SerializeToString()
    emulated = emulate_low_precision(converted)
    assert converted.SerializeToString() == before, "the input model was mutated"
    onnx.checker.check_model(emulated, full_check=True)
    assert not _low_tensor_types(emulated), _low_tensor_types(emulated)

    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    real = run_model(converted, {"x": x}, BASIC)["y"]
    emu = run_model(emulated, {"x": x}, BASIC)["y"]
    fp32 = np.maximum(
        x @ numpy_helper.to_array(converted.graph.initializer[0]).astype(np.float32), 0
    )
    assert rel_l2_error(emu, real) <= 1e-3, f"emulated vs fp16 rel L2 {rel_l2_error(emu, real)}"
    assert rel_l2_error(emu, fp32) > 0, "emulation should differ from pure fp32"
    # every value the emulated model outputs is representable in float16
    _assert_bits_equal(emu, emu.astype(np.float16).astype(np.float32))


def test_emulated_low_precision_graph_inputs_and_outputs() -> None:
    _, converted = _fp16_mlp(low_io=True)
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert emulated.graph.input[0].type.tensor_type.elem_type == F32
    assert emulated.graph.output[0].type.tensor_type.elem_type == F32
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    real = run_model(converted, {"x": x.astype(np.float16)}, BASIC)["y"]
    emu = run_model(emulated, {"x": x}, BASIC)["y"]  # fed as float32: rounded inside
    assert rel_l2_error(emu, real) <= 1e-3, f"emulated vs fp16 rel L2 {rel_l2_error(emu, real)}"


def test_emulated_bfloat16_rounding_is_exact() -> None:
    three = _tensor("three", np.array(3.0, ml_dtypes.bfloat16))
    converted = _model(
        [
            helper.make_node("Mul", ["x", "one"], ["xs"]),
            helper.make_node("Cast", ["xs"], ["xb"], to=BF16),
            helper.make_node("Mul", ["xb", "three"], ["pb"]),
            helper.make_node("Cast", ["xb"], ["y_round"], to=F32),
            helper.make_node("Cast", ["pb"], ["y_prod"], to=F32),
        ],
        [_vi("x", F32, [None])],
        [_vi("y_round", F32, [None]), _vi("y_prod", F32, [None])],
        [_tensor("one", np.array(1.0, np.float32)), three],
    )
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    rng = np.random.default_rng(4)
    special = [np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -0.0, 1.00390625, 1.01171875]
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000), special])
    x = x.astype(np.float32)
    out = run_model(emulated, {"x": x}, BASIC)
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    _assert_bits_equal(out["y_round"], rounded)
    # a product of two bfloat16 values is exact in float32, so this is correctly rounded
    with np.errstate(over="ignore", invalid="ignore"):
        want_prod = (rounded * np.float32(3.0)).astype(ml_dtypes.bfloat16).astype(np.float32)
    _assert_bits_equal(out["y_prod"], want_prod)


def _if_low_model() -> onnx.ModelProto:
    then_branch = helper.make_graph(
        [
            _const("k", np.array([1.1, -2.3, 0.7], np.float16)),
            helper.make_node("Mul", ["xh", "k"], ["prod"]),
            helper.make_node("Add", ["prod", "prod"], ["then_out"]),
        ],
        "then",
        [],
        [_vi("then_out", F16, [3])],
    )
    else_branch = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xh2"], to=F16),
            helper.make_node("Sqrt", ["xh2"], ["else_out"]),
        ],
        "else",
        [],
        [_vi("else_out", F16, [3])],
    )
    return _model(
        [
            helper.make_node("Cast", ["x"], ["xh"], to=F16),
            helper.make_node("If", ["c"], ["r"], then_branch=then_branch, else_branch=else_branch),
            helper.make_node("Cast", ["r"], ["y"], to=F32),
        ],
        [_vi("x", F32, [3]), _vi("c", TensorProto.BOOL, [])],
        [_vi("y", F32, [3])],
    )


def test_emulated_if_subgraph_model() -> None:
    converted = _if_low_model()
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert not _low_tensor_types(emulated), _low_tensor_types(emulated)
    x = np.array([0.3, 1.7, 2.9], np.float32)
    for cond in (True, False):
        feeds = {"x": x, "c": np.array(cond)}
        real = run_model(converted, feeds, BASIC)["y"]
        emu = run_model(emulated, feeds, BASIC)["y"]
        _assert_bits_equal(emu, real)  # fp16 Mul/Add/Sqrt are correctly rounded both ways


def test_emulated_loop_body_with_low_carried_value() -> None:
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Mul", ["v_in", "step"], ["v_out"]),
        ],
        "body",
        [
            _vi("i", TensorProto.INT64, []),
            _vi("cond_in", TensorProto.BOOL, []),
            _vi("v_in", F16, [3]),
        ],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("v_out", F16, [3])],
    )
    converted = _model(
        [
            helper.make_node("Cast", ["x"], ["xh"], to=F16),
            helper.make_node("Loop", ["n", "", "xh"], ["vh"], body=body),
            helper.make_node("Cast", ["vh"], ["y"], to=F32),
        ],
        [_vi("x", F32, [3])],
        [_vi("y", F32, [3])],
        [_tensor("n", np.array(5, np.int64)), _tensor("step", np.array(1.1, np.float16))],
    )
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert not _low_tensor_types(emulated), _low_tensor_types(emulated)
    feeds = {"x": np.array([0.3, 1.7, -2.9], np.float32)}
    _assert_bits_equal(
        run_model(emulated, feeds, BASIC)["y"], run_model(converted, feeds, BASIC)["y"]
    )


# --------------------------------------------------------------------------- the pass on onnx_ir

_MIXED = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[4] x) => (float[4] y) <float[4] w = {0.5, -1.25, 2.0, 3.1}> {
    xh = Cast <to = LOW> (x)
    m = Mul (xh, w)
    r = Relu (m)
    y = Cast <to = 1> (r)
}
"""


def _mixed(low: np.dtype, to: int):
    """Cast x to ``low`` -> Mul by a ``low`` initializer -> Relu -> Cast back to float."""
    import onnx_ir as ir

    model = ir.from_onnx_text(_MIXED.replace("LOW", str(to)))
    w = model.graph.initializers["w"]
    w.const_value = ir.tensor(w.const_value.numpy().astype(low), name="w")
    w.dtype = w.const_value.dtype
    return model


def test_pass_op_sequence_and_modified_flag() -> None:
    import onnx_ir as ir

    import mixprec

    model = _mixed(np.dtype(np.float16), F16)
    result = mixprec.EmulateLowPrecisionPass()(model)
    assert result.modified is True
    assert isinstance(result, mixprec.EmulateLowPrecisionResult)
    ops = [
        (n.op_type, n.attributes["to"].as_int() if "to" in n.attributes else None)
        for n in model.graph
    ]
    assert ops == [
        ("Cast", 1),  # was Cast(to=float16)
        ("Cast", 10),
        ("Cast", 1),
        ("Mul", None),
        ("Cast", 10),
        ("Cast", 1),
        ("Relu", None),
        ("Cast", 10),
        ("Cast", 1),
        ("Cast", 1),
    ], ops
    assert result.round_trips == 3 and result.upcast_tensors == 2, result
    assert model.graph.initializers["w"].const_value.dtype == ir.DataType.FLOAT
    # consumers read the rounded value, which kept the original name
    mul = model.graph.node(3)
    assert mul.inputs[0] is model.graph.node(2).outputs[0]
    assert mul.inputs[0].name == "xh"


def test_pass_on_fp32_model_is_not_modified() -> None:
    import onnx_ir as ir

    import mixprec

    model = ir.from_onnx_text(
        """
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[2] x) => (float[2] y) { y = Relu (x) }
        """
    )
    result = mixprec.EmulateLowPrecisionPass()(model)
    assert result.modified is False and result.round_trips == 0
    assert [n.op_type for n in model.graph] == ["Relu"]


def test_pass_matches_ml_dtypes_rounding_in_ort() -> None:
    """ORT outputs of the emulated model equal numpy rounding through ml_dtypes, bit for bit."""
    import onnx_ir as ir

    from helpers import run_ort

    model = _mixed(np.dtype(ml_dtypes.bfloat16), BF16)
    w = model.graph.initializers["w"].const_value.numpy().astype(np.float32)
    emulated = emulate_low_precision(model)
    x = np.array([0.3, 1.7, -2.9, 1.0e3], np.float32)
    out = run_ort(ir.to_proto(emulated), {"x": x})["y"]

    def bf16(a: np.ndarray) -> np.ndarray:
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)

    want = bf16(np.maximum(bf16(bf16(x) * w), 0))
    _assert_bits_equal(out, want)
