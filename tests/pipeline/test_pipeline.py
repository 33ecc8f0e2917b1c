"""The staged pipeline, its config, the meta it leaves on the graph, and the failure
classes found on unseen models (each reproduced by a small synthetic model)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, make_model, run_ort
from mixprec.calibrate.measure import CALIBRATION, MACS, Calibration
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import InternalError, MixprecError
from mixprec.core.policy import default_policy
from mixprec.passes.opset import BF16_OPSET, UpgradeOpsetPass
from mixprec.passes.shapes import InferShapesPass, ReconcileDeclaredShapesPass
from mixprec.pipeline.stages import STAGES, Pipeline, Stage
from mixprec.precision.paint import DECISION, PaintPass, Precision, decision_of


def _scalar_output_model() -> onnx.ModelProto:
    """Class 1: the single output is declared a scalar; the graph computes [1, 3]."""
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32), "W"
    )
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "declared_scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _hidden_reshape_model() -> onnx.ModelProto:
    """Class 2: a CTC-style output declared [1, seq] while the Reshape makes rank 3. The
    shape input is Cast(Constant), which inference sees only once the Cast is folded."""
    shape = numpy_helper.from_array(np.array([1, 2, 2], np.float32))
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["shape_f"], value=shape),
            helper.make_node("Cast", ["shape_f"], ["shape"], to=TensorProto.INT64),
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Relu", ["r"], ["y"]),
        ],
        "hidden_reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    model.ir_version = 7
    return model


def _random_like_model() -> onnx.ModelProto:
    """Class 3: ONNX Runtime CPU has no opset-22 RandomNormalLike kernel."""
    w = numpy_helper.from_array(
        np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32), "W"
    )
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("RandomNormalLike", ["c"], ["r"], seed=1.0, scale=1e-3),
            helper.make_node("Add", ["c", "r"], ["y"]),
        ],
        "random_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


# --- failure class 1: declared shapes that contradict the graph -------------------------


def test_class1_input_fails_the_full_check():
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.checker.check_model(_scalar_output_model(), full_check=True)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_class1_wrong_output_declaration_is_corrected_and_reported(dtype):
    model = _scalar_output_model()
    result = mixprec.convert(model, dtype)
    out = result.model_proto
    onnx.checker.check_model(out, full_check=True)
    notes = [n for n in result.report.notes if "'y' declared []" in n]
    assert notes == [
        "shape 'y' declared [] but the graph computes [1, 3]: declaration "
        "corrected (in the input model)"
    ], result.report.notes
    dims = [d.dim_value for d in out.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 3]
    if dtype == "fp16":
        x = {"x": np.random.default_rng(2).standard_normal((1, 4)).astype(np.float32)}
        assert_close(run_ort(model, x)["y"], run_ort(out, x)["y"], "float16", name="y")


# --- failure class 2: the contradiction appears only after folding ---------------------


def test_class2_input_passes_the_full_check():
    onnx.checker.check_model(_hidden_reshape_model(), full_check=True)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_class2_hidden_contradiction_is_corrected(dtype):
    model = _hidden_reshape_model()
    result = mixprec.convert(model, dtype)
    out = result.model_proto
    onnx.checker.check_model(out, full_check=True)
    assert any(
        "'y' declared [1, seq] but the graph computes [1, 2, 2]" in n for n in result.report.notes
    ), result.report.notes
    x = {"x": np.arange(4, dtype=np.float32).reshape(1, 4)}
    ref = run_ort(model, x)["y"]
    assert ref.shape == (1, 2, 2)
    if dtype == "fp16":
        assert_close(ref, run_ort(out, x)["y"], "float16", name="y")


# --- failure class 3: the bf16 opset upgrade must not cost the calibration ---------------


def test_class3_calibration_runs_before_the_opset_upgrade():
    import onnxruntime as ort
    from onnx import version_converter

    model = _random_like_model()
    upgraded = version_converter.convert_version(model, BF16_OPSET)
    with pytest.raises(Exception, match="RandomNormalLike"):
        ort.InferenceSession(upgraded.SerializeToString(), providers=["CPUExecutionProvider"])
    result = mixprec.convert(model, "bf16")
    assert result.report.calibrated
    # the upgrade would move RandomNormalLike to a version ORT lacks: the opset stays, and
    # Conv (bf16 only from opset 22) stays FP32, with the reason (issue 25)
    notes = " ".join(result.report.notes)
    assert "opset kept at" in notes and "RandomNormalLike-22" in notes, notes
    assert {o.domain: o.version for o in result.model_proto.opset_import}[""] < BF16_OPSET
    conv = next(n for n in result.report.nodes if n.op_type == "Conv")
    assert conv.precision == "fp32"
    ort.InferenceSession(result.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])


# --- the stages --------------------------------------------------------------------------

_TEXT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,8] x) => (float[1,4] y)
<float[8,4] w = {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,
                 0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8}>
{
    m = MatMul(x, w)
    e = Exp(m)
    y = Relu(e)
}
"""


def test_inspect_stops_after_annotate_with_decisions_on_the_graph():
    model = ir.from_proto(make_model(_TEXT))
    pipeline = Pipeline(ConvertConfig.resolve("fp16", calibrate=False))
    out = pipeline.run(model, until="annotate")
    assert list(pipeline.stages) == ["prepare", "calibrate", "annotate"]
    assert [n.op_type for n in out.graph] == ["MatMul", "Exp", "Relu"]  # nothing rewritten
    decisions = {n.op_type: decision_of(n) for n in out.graph}
    assert decisions["MatMul"] is not None and decisions["MatMul"].precision is Precision.LOW
    assert decisions["Exp"] is not None and decisions["Exp"].precision is Precision.FP32
    assert decisions["Exp"].step == "deny" and "DENY list" in decisions["Exp"].reason
    assert next(iter(out.graph)).meta[MACS] == 1 * 8 * 4
    report = mixprec.inspect(make_model(_TEXT), "fp16", calibrate=False)
    assert report.casts_inserted == 0 and len(report.nodes) == 3


def test_annotate_and_apply_rerun_on_a_calibrated_model_without_recalibrating(monkeypatch):
    from mixprec.calibrate import measure

    calls = []
    real = measure.calibrate

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "calibrate", counting)  # what CalibratePass calls
    base = ConvertConfig.resolve("fp16")
    calibrated = Pipeline(base).run(ir.from_proto(make_model(_TEXT)), until="calibrate")
    assert len(calls) == 1
    assert isinstance(calibrated.meta[CALIBRATION], Calibration)
    proto = ir.to_proto(calibrated)
    lows = []
    for deny_add in ([], ["MatMul"]):
        config = ConvertConfig.resolve("fp16", deny_add=deny_add)
        copy = ir.from_proto(proto)
        copy.meta[CALIBRATION] = calibrated.meta[CALIBRATION]
        out = Pipeline(config).run(copy, start="annotate")
        lows.append(
            sum(1 for n in out.graph if (d := decision_of(n)) and d.precision.value == "low")
        )
    assert len(calls) == 1, "annotate/apply must not calibrate again"
    assert lows[0] > lows[1] == 0


class _Boom(ir.passes.InPlacePass):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def call(self, model):
        raise self.error


def test_a_failing_pass_is_named_with_its_stage():
    model = ir.from_proto(make_model(_TEXT))
    with pytest.raises(InternalError, match="ZeroDivisionError: boom") as info:
        Stage("annotate", _Boom(ZeroDivisionError("boom")))(model)
    assert info.value.stage == "annotate/_Boom"
    with pytest.raises(MixprecError) as user:
        Stage("calibrate", _Boom(MixprecError("bad feed")))(model)
    assert user.value.stage == "calibrate/_Boom"
    assert isinstance(user.value, ValueError)


def test_unknown_stage_is_a_user_error():
    with pytest.raises(MixprecError, match="unknown stage 'paint'"):
        Pipeline(ConvertConfig.resolve("fp16")).run(ir.from_proto(make_model(_TEXT)), until="paint")
    assert STAGES == ("prepare", "calibrate", "annotate", "apply", "cleanup", "check")


# --- the config ----------------------------------------------------------------------------


def test_config_is_frozen_and_validated():
    config = ConvertConfig.resolve("bf16", shapes={"x": [1, 8]}, keep_io_types=["y"])
    assert config.target == "bfloat16"
    assert dict(config.shapes) == {"x": (1, 8)}
    assert config.keep_io_types == frozenset({"y"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.calibrate = False  # type: ignore[misc]
    with pytest.raises(MixprecError, match="unknown observer"):
        config.replace(observer="kl")
    with pytest.raises(MixprecError, match="range_threshold must be > 0"):
        config.replace(range_threshold=-1.0)
    with pytest.raises(MixprecError, match="must be positive"):
        config.replace(shapes={"x": [0, 8]})
    with pytest.raises(MixprecError, match="unknown option"):
        ConvertConfig.resolve("fp16", calibrat=False)
    with pytest.raises(MixprecError, match="not both"):
        ConvertConfig.resolve(policy=default_policy("fp16"), deny_add=["Relu"])


def test_config_priority_api_over_env_over_defaults():
    env = {"MIXPREC_DTYPE": "bf16", "MIXPREC_DENYLIST_ADD": "Relu"}
    from_env = ConvertConfig.resolve(env=env)
    assert from_env.target == "bfloat16" and "Relu" in from_env.policy.lists[mixprec.OpClass.DENY]
    explicit = ConvertConfig.resolve("fp16", infer_add=["Relu"], env=env)
    assert explicit.target == "float16"
    assert "Relu" in explicit.policy.lists[mixprec.OpClass.INFER]


def test_convert_with_a_config_and_overrides():
    config = ConvertConfig.resolve("fp16", calibrate=False)
    result = mixprec.convert(make_model(_TEXT), config=config, keep_io_types=False)
    assert result.model_proto.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    with pytest.raises(MixprecError, match="contradicts config"):
        mixprec.convert(make_model(_TEXT), "bf16", config=config)


# --- single passes ---------------------------------------------------------------------------


def test_reconcile_pass_modified_is_exact_and_inputs_stay():
    consistent = ir.from_proto(make_model(_TEXT))
    assert ReconcileDeclaredShapesPass()(consistent).modified is False
    model = ir.from_proto(_scalar_output_model())
    x = model.graph.inputs[0]
    x_shape = x.shape
    y = model.graph.outputs[0]
    result = ReconcileDeclaredShapesPass()(model)
    assert result.modified is True
    assert model.graph.outputs[0] is y and list(y.shape) == [1, 3]
    assert x.shape is x_shape
    assert ReconcileDeclaredShapesPass()(model).modified is False


def test_upgrade_pass_is_functional_and_keeps_weights_and_meta():
    model = ir.from_proto(_random_like_model())
    model.meta[CALIBRATION] = Calibration(samples=3)
    weight = model.graph.initializers["W"].const_value
    result = UpgradeOpsetPass(default_policy("bf16"))(model)
    assert result.modified is True and result.model is not model
    assert result.model.opset_imports[""] == BF16_OPSET
    assert model.opset_imports[""] == 13, "the input model must stay as it was"
    assert result.model.graph.initializers["W"].const_value is weight
    assert result.model.meta[CALIBRATION].samples == 3
    again = UpgradeOpsetPass(default_policy("fp16"))(model)
    assert again.modified is False and again.model is not model


def test_paint_records_on_the_graph_and_a_rerun_replaces_records():
    model = ir.from_proto(make_model(_TEXT))
    InferShapesPass()(model)  # intermediate types are needed to paint
    PaintPass(default_policy("fp16"), absmax={})(model)
    exp = next(n for n in model.graph if n.op_type == "Exp")
    assert decision_of(exp) is not None and decision_of(exp).precision is Precision.FP32
    changed = default_policy("fp16").with_changes({mixprec.OpClass.INFER: ["Exp"]})
    result = PaintPass(changed, absmax={})(model)
    assert result.modified is False
    assert exp.meta[DECISION].precision is Precision.LOW
    assert result.decisions[exp] is exp.meta[DECISION]


def test_convert_streams_calibration_samples_and_takes_the_max_over_them():
    """A generator of samples is consumed lazily; |x| max is the max over all samples, so
    one sample out of range keeps the range-checked Exp in FP32."""
    pulled = []

    def samples(scales):
        for k, scale in enumerate(scales):
            pulled.append(k)
            yield {"x": np.full((1, 8), scale, np.float32)}

    calm = mixprec.convert(make_model(_TEXT), "fp16", calibration_data=samples([0.1] * 4))
    assert pulled == [0, 1, 2, 3]
    assert "calibrated on 4 sample(s) of the given inputs (x)" in calm.report.notes
    exp = next(n for n in calm.report.nodes if n.op_type == "Exp")
    assert exp.precision == "low", exp
    pulled.clear()
    wild = mixprec.convert(make_model(_TEXT), "fp16", calibration_data=samples([0.1, 0.1, 9.0]))
    assert pulled == [0, 1, 2]
    exp = next(n for n in wild.report.nodes if n.op_type == "Exp")
    assert exp.precision == "fp32" and exp.step == "range", exp


def test_check_pass_corrects_a_declaration_that_only_the_final_check_sees():
    from mixprec.passes.cleanup import CheckModelPass

    model = ir.from_proto(_scalar_output_model())
    result = CheckModelPass()(model)
    assert result.modified is True
    assert [f.describe() for f in result.fixes] == [
        "'y' declared [] but the graph computes [1, 3]: declaration corrected"
    ]
    assert CheckModelPass()(model).modified is False
    broken = ir.from_proto(make_model(_TEXT))
    broken.graph.outputs[0].dtype = ir.DataType.INT64  # a fault no declaration fix cures
    with pytest.raises(InternalError, match=r"fails onnx\.checker"):
        CheckModelPass()(broken)


def test_shape_inference_after_the_upgrade_runs_only_for_untyped_values():
    model = ir.from_proto(make_model(_TEXT))
    InferShapesPass()(model)
    assert InferShapesPass(only_untyped=True)(model).modified is False
    exp = next(n for n in model.graph if n.op_type == "Exp")
    exp.outputs[0].type = None  # as a node added by a rewrite would be
    exp.outputs[0].shape = None
    assert InferShapesPass(only_untyped=True)(model).modified is True
    assert exp.outputs[0].dtype == ir.DataType.FLOAT
