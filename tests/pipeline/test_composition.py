"""The stages composed (``mixprec.convert`` end to end on tiny graphs): what no single pass
decides alone: the interface, the input left untouched, calibration-driven decisions,
inlining, annotations, saving, external data, the public surface."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

import mixprec
from helpers import assert_close, run_ort
from text_models import chain_model, filled_model, full_check, op_list


def test_keep_io_types_false_changes_interface():
    result = mixprec.convert(chain_model(), "fp16", calibrate=False, keep_io_types=False)
    proto = result.model_proto
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    full_check(proto)


def test_convert_does_not_mutate_inputs():
    model = chain_model()
    before = model.SerializeToString()
    mixprec.convert(model, "fp16", calibrate=False)
    assert model.SerializeToString() == before
    ir_model = ir.from_proto(model)
    text_before = str(ir_model)
    result = mixprec.convert(ir_model, "fp16", calibrate=False)
    assert str(ir_model) == text_before
    assert isinstance(result.converted, ir.Model)


def test_chain_numeric_and_valid():
    model = chain_model()
    x = np.random.default_rng(3).random((1, 4, 8, 8), dtype=np.float32)
    # Without calibration the DENY op (Exp) and what it feeds stay FP32.
    plain = mixprec.convert(model, "fp16", calibrate=False).model_proto
    full_check(plain)
    assert_close(run_ort(model, {"x": x})["y"], run_ort(plain, {"x": x})["y"], "float16")
    ops = op_list(plain)
    assert ops.count("Cast") == 4  # x->fp16, c1->fp32, r->fp16, y->fp32
    assert ops.index("Exp") > ops.index("Cast")
    # With calibration, Exp's measured range is safe: it runs in fp16 and casts drop to 2.
    result = mixprec.convert(model, "fp16", calibration_data={"x": x})
    calibrated = result.model_proto
    full_check(calibrated)
    assert op_list(calibrated).count("Cast") == 2
    exp = next(n for n in result.report.nodes if n.op_type == "Exp")
    assert exp.precision == "low" and "calibrated safe range" in exp.reason
    assert_close(run_ort(model, {"x": x})["y"], run_ort(calibrated, {"x": x})["y"], "float16")


def test_range_checked_deny_op_stays_fp32_when_its_range_is_unsafe():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) <float[8,8] w> {
        m = MatMul (x, w)
        e = Exp (m)
        y = MatMul (e, w)
    }
    """
    model = filled_model(text, w=np.full((8, 8), 1.5))
    x = np.full((2, 8), 1.0, np.float32)  # m = 12 -> exp(12) = 1.6e5 > fp16 max
    result = mixprec.convert(model, "fp16", calibration_data={"x": x})
    exp = next(n for n in result.report.nodes if n.op_type == "Exp")
    assert exp.precision == "fp32" and exp.step == "range", exp
    assert np.isfinite(run_ort(result.model_proto, {"x": x})["y"]).all()


def test_embedding_region_fed_by_constants_goes_low():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[2,5] ids) => (float[2,5,8] y) <float[50,8] table, float[8,8] w, float[8] s,
                                            float[8] b> {
        e = Gather (table, ids)
        n = LayerNormalization <axis = -1> (e, s, b)
        y = MatMul (n, w)
    }
    """
    model = filled_model(text, s=np.ones(8), b=np.zeros(8))
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    result = mixprec.convert(model, "fp16", calibration_data={"ids": ids})
    proto = result.model_proto
    full_check(proto)
    precisions = {n.op_type: (n.precision, n.step) for n in result.report.nodes}
    assert precisions["Gather"] == ("low", "weights"), precisions
    assert precisions["LayerNormalization"] == ("low", "weights"), precisions
    # The table is stored in fp16 and the only cast is the output one.
    table = next(t for t in proto.graph.initializer if t.name == "table")
    assert table.data_type == onnx.TensorProto.FLOAT16
    assert op_list(proto).count("Cast") == 1
    assert_close(run_ort(model, {"ids": ids})["y"], run_ort(proto, {"ids": ids})["y"], "float16")


def test_model_local_function_is_inlined_and_converted():
    text = """
    <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y) {
        y = local.Dense (x, w)
    }
    <domain: "local", opset_import: ["" : 17]>
    Dense (a, b) => (c) {
        m = MatMul (a, b)
        c = Relu (m)
    }
    """
    model = filled_model(text)
    result = mixprec.convert(model, "fp16", calibrate=False)
    assert any("inlined 1 model-local function" in note for note in result.report.notes)
    assert {n.op_type: n.precision for n in result.report.nodes} == {"MatMul": "low", "Relu": "low"}
    full_check(result.model_proto)


def test_public_surface_is_pinned():
    assert sorted(mixprec.__all__) == sorted(
        [
            "DEFAULT_LISTS",
            "RULES",
            "STAGES",
            "BatchResult",
            "ConversionResult",
            "ConvertConfig",
            "EmulateLowPrecisionPass",
            "EmulateLowPrecisionResult",
            "InternalError",
            "MixprecError",
            "NodeReport",
            "OpClass",
            "OpRule",
            "OptimizeResult",
            "Pipeline",
            "Policy",
            "QuantizeConfig",
            "Report",
            "TuneResult",
            "ValidationReport",
            "WeightsConfig",
            "batch",
            "convert",
            "default_policy",
            "inspect",
            "optimize",
            "quantize",
            "register_rule",
            "tune",
            "validate",
        ]
    )


def test_streamed_save_writes_the_same_model(tmp_path):
    """Large initializers are written one at a time; the file is the same model."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,256] x) => (float[4,256] y) <float[256,256] w1, float[256,256] w2, float[256] b> {
        h = MatMul (x, w1)
        a = Add (h, b)
        y = MatMul (a, w2)
    }
    """
    model = filled_model(text)
    result = mixprec.convert(model, "fp16", calibrate=False)
    path = tmp_path / "out.onnx"
    from mixprec.io.models import _write_streaming

    _write_streaming(result.model, str(path), min_bytes=1024)  # w1, w2 streamed; b inline
    written = onnx.load(path)
    expected = result.model_proto
    onnx.checker.check_model(written, full_check=True)
    assert [n.SerializeToString() for n in written.graph.node] == [
        n.SerializeToString() for n in expected.graph.node
    ]
    inits = {t.name: t.SerializeToString() for t in written.graph.initializer}
    assert inits == {t.name: t.SerializeToString() for t in expected.graph.initializer}
    assert list(result.model.graph.initializers) == [t.name for t in expected.graph.initializer]
    x = np.random.default_rng(9).random((4, 256), dtype=np.float32)
    np.testing.assert_array_equal(run_ort(written, {"x": x})["y"], run_ort(expected, {"x": x})["y"])


def test_no_value_info_added_and_existing_annotations_retyped():
    model = chain_model()
    assert not model.graph.value_info
    out = mixprec.convert(model, "fp16", calibrate=False).model_proto
    assert [v.name for v in out.graph.value_info] == []
    annotated = onnx.shape_inference.infer_shapes(model)  # every intermediate annotated
    out = mixprec.convert(annotated, "fp16", calibrate=False).model_proto
    types = {v.name: v.type.tensor_type.elem_type for v in out.graph.value_info}
    assert types["c1"] == onnx.TensorProto.FLOAT16  # Conv output, now low precision
    assert types["e"] == onnx.TensorProto.FLOAT  # Exp stays FP32 without calibration
    full_check(out)


def test_model_with_external_data_converts_with_calibration(tmp_path):
    model = chain_model()
    path = tmp_path / "chain.onnx"
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)  # onnx.save moves the tensors of the proto it saves
    onnx.save(
        on_disk,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="chain.data",
        size_threshold=0,
    )
    x = np.random.default_rng(12).random((1, 4, 8, 8), dtype=np.float32)
    result = mixprec.convert(path, "fp16", calibration_data={"x": x})
    out = tmp_path / "out.onnx"
    result.save(out, external_data=True)
    assert (tmp_path / "out.onnx.data").exists()
    onnx.checker.check_model(str(out), full_check=True)
    assert_close(run_ort(model, {"x": x})["y"], run_ort(str(out), {"x": x})["y"], "float16")
    again = mixprec.convert(out, "fp16", calibration_data={"x": x})  # already fp16: left alone
    assert any("already holds float16" in n for n in again.report.notes)
