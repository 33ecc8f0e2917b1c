"""Inputs a model accepts without the user's help (issue 20): convert, validate and the
CLI on models whose first guess ONNX Runtime refuses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.cli.main import main


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _stft_like() -> onnx.ModelProto:
    """Audio [1, T] reflect-padded by 100 on both sides, then a MatMul over 8 frames of
    the padded signal's head: T = 64 is refused by the pad."""
    pads = helper.make_tensor("pads", TensorProto.INT64, [4], [0, 100, 0, 100])
    starts = helper.make_tensor("starts", TensorProto.INT64, [1], [0])
    ends = helper.make_tensor("ends", TensorProto.INT64, [1], [8])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    w = numpy_helper.from_array(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4), "w")
    return _model(
        [
            helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect"),
            helper.make_node("Slice", ["p", "starts", "ends", "axes"], ["head"]),
            helper.make_node("MatMul", ["head", "w"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [pads, starts, ends, axes, w],
    )


def test_convert_without_inputs_reads_the_length_the_pad_needs() -> None:
    result = mixprec.convert(_stft_like(), "fp16")
    assert result.report.input_shapes == {"x": [1, 256]}, result.report.input_shapes
    notes = "\n".join(result.report.notes)
    assert "dim 1 (?) is symbolic: used 256 (at least 101: the reflect Pad" in notes, notes
    assert "try" not in notes, notes  # the first guess ran
    x = np.sin(np.arange(300, dtype=np.float32) / 7)[None]
    ref, got = run_ort(_stft_like(), {"x": x})["y"], run_ort(result.model_proto, {"x": x})["y"]
    assert np.abs(got - ref).max() < 1e-2 * np.abs(ref).max()
    report = mixprec.validate(_stft_like(), result.model)
    assert report.passed and report.input_shapes == {"x": [1, 256]}, report


def test_convert_without_inputs_learns_a_length_from_the_refusal() -> None:
    """A Gather of sample 200: nothing in the graph bounds the length, ORT refuses 64."""
    index = helper.make_tensor("index", TensorProto.INT64, [1], [200])
    w = numpy_helper.from_array(np.ones((1, 3), np.float32), "w")
    model = _model(
        [
            helper.make_node("Gather", ["x", "index"], ["g"], axis=1),
            helper.make_node("MatMul", ["g", "w"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        [index, w],
    )
    result = mixprec.convert(model, "fp16")
    assert result.report.input_shapes == {"x": [1, 256]}, result.report.input_shapes
    notes = "\n".join(result.report.notes)
    assert "input 'x' dim 1 (T): 256 (64 was refused: " in notes, notes
    assert "generated inputs ran on try 2 of 5: x [1, 256]" in notes, notes
    report = mixprec.validate(model, result.model)
    assert report.passed and any("try 2 of 5" in n for n in report.notes), report.notes


def test_a_state_behind_a_fixed_dim_takes_the_batch_of_one() -> None:
    """state [2, ?, 16] beside x [N, 16]: the symbolic dim between fixed ones is a batch
    (1), so the Concat of the two runs at once; 64 there is refused."""
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    model = _model(
        [
            helper.make_node("Unsqueeze", ["x", "axes"], ["x3"]),
            helper.make_node("Concat", ["x3", "state"], ["y"], axis=0),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, None, 16]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, None, 16])],
        [axes],
    )
    result = mixprec.convert(model, "fp16")
    assert result.report.input_shapes == {"x": [1, 16], "state": [2, 1, 16]}
    assert not any("try" in n for n in result.report.notes), result.report.notes


def test_the_cli_names_the_dim_and_a_shape_when_nothing_runs(tmp_path: Path, capsys) -> None:
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1, 100])
    model = _model(
        [helper.make_node("Reshape", ["audio", "shape"], ["y"])],
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 100])],
        [shape],
    )
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    rc = main(["convert", str(src), "-o", str(tmp_path / "out.onnx")])
    err = capsys.readouterr().err.strip().splitlines()
    # a Reshape names no length: not retried (issue 27), one run, then the --shape line
    assert rc == 2 and len(err) == 1, err
    assert "after 1 run(s) (input 'audio' dim 1 last tried 64)" in err[0], err
    assert "--shape audio=1,N" in err[0], err
    assert not (tmp_path / "out.onnx").exists()
    rc = main(["convert", str(src), "-o", str(tmp_path / "out.onnx"), "--shape", "audio=1,100"])
    assert rc == 0 and (tmp_path / "out.onnx").is_file()


def test_tune_without_data_generates_a_sample_the_model_runs_on() -> None:
    result = mixprec.tune(_stft_like(), "fp16", None, budget=1e-2)
    assert result.passed and result.report.target == "float16", result.message
    assert result.evaluations["full"] >= 1
