"""The api layer's hand-overs (issue 16's seam bugs): quantize -> tune with an INT8 mode,
quantize's log dir, and the speed plan's and the fallback's time in the timings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.cli.main import main
from mixprec.core.metrics import rel_l2_error


def _mlp() -> onnx.ModelProto:
    """MatMul+Add -> Relu -> Gemm on [batch, 16]: two weighted MatMul-like nodes."""
    rng = np.random.default_rng(2)
    w1 = numpy_helper.from_array((0.3 * rng.standard_normal((16, 24))).astype(np.float32), "w1")
    b1 = numpy_helper.from_array((0.1 * rng.standard_normal(24)).astype(np.float32), "b1")
    w2 = numpy_helper.from_array((0.3 * rng.standard_normal((24, 8))).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="proj"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [w1, b1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _data(n: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.standard_normal((2, 16)).astype(np.float32)} for _ in range(n)]


def test_tune_int8_takes_the_int8_mode_as_a_quantize_option():
    """Before: ``mode must be 'emulated' or 'ort', not 'dynamic'`` (tune's keyword)."""
    model = _mlp()
    result = mixprec.tune(model, "int8", _data(), budget=0.5, mode="dynamic")
    assert isinstance(result, mixprec.TuneResult) and result.passed, result.message
    ops = [n.op_type for n in result.model_proto.graph.node]
    assert "DynamicQuantizeLinear" in ops and "QuantizeLinear" not in ops, ops
    assert result.report.quantization["mode"] == "dynamic", result.report.quantization
    x = _data(1)[0]
    ref, got = run_ort(model, x)["y"], run_ort(result.model_proto, x)["y"]
    rel = rel_l2_error(ref, got)
    assert rel <= 0.5 and rel > 0, rel  # quantized, within the budget it was given
    static = mixprec.tune(model, "int8", _data(), budget=0.5, mode="static")
    ops = [n.op_type for n in static.model_proto.graph.node]
    assert "QuantizeLinear" in ops and "DynamicQuantizeLinear" not in ops, ops


def test_max_drop_means_the_guards_drop_in_the_api_as_on_the_cli(tmp_path: Path, capsys):
    """Before: quantize(max_drop=) switched to the tuner and returned a TuneResult, while
    --max-drop was the guard's top-1 drop; and a bad --max-drop named ``guard_drop``."""
    result = mixprec.quantize(_mlp(), _data(6), max_drop=0.2, max_rel_l2=0.3)
    assert isinstance(result, mixprec.ConversionResult), type(result)
    assert not isinstance(result, mixprec.TuneResult)
    config = result.report.policy["quantize"]
    assert (config["guard_drop"], config["guard_rel_l2"]) == (0.2, 0.3), config
    try:
        mixprec.quantize(_mlp(), _data(6), max_drop=0.2, guard_drop=0.1)
    except mixprec.MixprecError as exc:
        assert "max_drop= or guard_drop=" in str(exc), exc
    else:
        raise AssertionError("both spellings were accepted")
    src = tmp_path / "m.onnx"
    onnx.save(_mlp(), src)
    code = main(["quantize", str(src), "-o", str(tmp_path / "q.onnx"), "--max-drop", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-drop must lie in (0, 1), got 2" in err and "guard_drop" not in err


def test_tune_refuses_an_unknown_mode_naming_both_kinds():
    try:
        mixprec.tune(_mlp(), "int8", _data(), budget=0.5, mode="fast")
    except mixprec.MixprecError as exc:
        assert "'emulated', 'ort' or 'openvino'" in str(exc) and "dynamic" in str(exc), exc
    else:
        raise AssertionError("mode='fast' was accepted")


def test_quantize_log_dir_holds_the_graphs_and_the_report(tmp_path: Path):
    """Before: quantize(log_dir=...) wrote nothing (only convert wrote its log dir)."""
    log = tmp_path / "log"
    result = mixprec.quantize(_mlp(), _data(), mode="static", speed="off", log_dir=log)
    names = sorted(p.name for p in log.iterdir())
    for name in ("before.onnx", "after.onnx", "report.json", "paint_buckets.json"):
        assert name in names, names
    after = onnx.load(log / "after.onnx")
    assert [n.op_type for n in after.graph.node] == [
        n.op_type for n in result.model_proto.graph.node
    ]
    report = json.loads((log / "report.json").read_text())
    assert report["target"] == "int8" and report["quantization"]["mode"] == "static", report


def test_speed_plan_and_fallback_time_are_in_the_timings():
    """Before: the timings stopped at the pipeline's stages; the fallback's time was lost."""
    result = mixprec.quantize(_mlp(), _data(), mode="static", fallback="fp16")
    timings = result.report.timings
    for stage in ("load", "prepare", "calibrate", "annotate", "apply", "speed", "fallback"):
        assert stage in timings and timings[stage] >= 0, (stage, timings)
    plain = mixprec.quantize(_mlp(), _data(), mode="static", speed="off")
    assert "speed" not in plain.report.timings and "fallback" not in plain.report.timings


def _padded_conv() -> onnx.ModelProto:
    """An int64 -> int64 Cast of the pads (what exporters write) before Pad -> Conv:
    removing such identity Casts can move ORT off a faster path (CREPE, issue 17)."""
    rng = np.random.default_rng(4)
    w = numpy_helper.from_array((0.2 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32), "w")
    pads = numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")
    nodes = [
        helper.make_node("Cast", ["pads"], ["pads64"], to=TensorProto.INT64, name="cast"),
        helper.make_node("Pad", ["x", "pads64"], ["p"], name="pad"),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv"),
    ]
    graph = helper.make_graph(
        nodes,
        "padded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w, pads],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _same_computation(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """Same nodes, initializers, inputs, outputs and opsets (value_info annotations of the
    initializers, which every onnx_ir round trip writes, aside)."""
    return (
        list(a.graph.node) == list(b.graph.node)
        and list(a.graph.initializer) == list(b.graph.initializer)
        and list(a.graph.input) == list(b.graph.input)
        and list(a.graph.output) == list(b.graph.output)
        and list(a.opset_import) == list(b.opset_import)
    )


def test_a_model_kept_float_is_the_input_unchanged(tmp_path: Path) -> None:
    """Issue 17: when no node ends up INT8 the input is written as given (before: the
    prepared copy, without the identity Cast)."""
    model = _padded_conv()
    data = [{"x": np.random.default_rng(k).random((1, 3, 8, 8), np.float32)} for k in range(2)]
    result = mixprec.quantize(model, data, exclude_nodes=(".*",), speed="off")
    assert [n.op_type for n in result.model_proto.graph.node] == ["Cast", "Pad", "Conv"]
    assert _same_computation(result.model_proto, model)
    assert any("written unchanged" in n for n in result.report.notes), result.report.notes
    out = tmp_path / "kept.onnx"
    result.save(out)
    assert _same_computation(onnx.load(out), model)
    quantized = mixprec.quantize(model, data, speed="off")
    ops = [n.op_type for n in quantized.model_proto.graph.node]
    assert "QuantizeLinear" in ops and ops.count("Cast") == 1, ops


def test_a_file_kept_float_is_written_byte_for_byte(tmp_path: Path) -> None:
    """A model quantize decides not to change is the input file's bytes, not a
    re-serialization of it (which would add value_info and drop empty domain fields)."""
    source = tmp_path / "in.onnx"
    onnx.save(_padded_conv(), source)
    data = [{"x": np.random.default_rng(k).random((1, 3, 8, 8), np.float32)} for k in range(2)]
    result = mixprec.quantize(source, data, exclude_nodes=(".*",), speed="off")
    assert result.report.unchanged
    out = tmp_path / "out.onnx"
    result.save(out)
    assert out.read_bytes() == source.read_bytes()
    with pytest.raises(mixprec.MixprecError, match="overwrite the input"):
        result.save(source)
    quantized = mixprec.quantize(source, data, speed="off")  # changed: written from the graph
    assert not quantized.report.unchanged and quantized.source_file is None


def test_prepare_keeps_integer_identity_casts_and_drops_float_ones() -> None:
    """Issue 17: prepare must not change what ORT fuses: an int64 -> int64 Cast before a
    Pad stays (in convert and quantize alike); a float32 -> float32 Cast still goes, as it
    would pin a painted region to float32."""
    model = _padded_conv()
    converted = mixprec.convert(model, "fp16")
    ops = [n.op_type for n in converted.model_proto.graph.node]
    pad_input = next(n for n in converted.model_proto.graph.node if n.op_type == "Pad").input[1]
    cast = next(n for n in converted.model_proto.graph.node if n.output[0] == pad_input)
    assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.INT64, ops
    floaty = onnx.helper.make_node("Cast", ["y0"], ["y"], to=TensorProto.FLOAT, name="same")
    model.graph.node[-1].output[0] = "y0"
    model.graph.node.append(floaty)
    model.graph.output[0].name = "z"
    model.graph.node.append(onnx.helper.make_node("Relu", ["y"], ["z"], name="relu"))
    converted = mixprec.convert(model, "fp16", keep_io_types=True)
    assert not any(n.name == "same" for n in converted.model_proto.graph.node)
    x = {"x": np.random.default_rng(0).random((1, 3, 8, 8), np.float32)}
    ref, got = run_ort(model, x)["z"], run_ort(converted.model_proto, x)["z"]
    assert rel_l2_error(ref, got) < 1e-2
