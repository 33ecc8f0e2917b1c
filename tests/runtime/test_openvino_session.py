"""OpenVINO's session (issue 35), for real: a shape its CPU plugin cannot compile is a
failed run, not a failed load; shapes it cannot fix are said."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort
from mixprec.checks.validate import validate_models
from mixprec.core.errors import MixprecError
from mixprec.runtime.engine import RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import engine_for
from mixprec.runtime.openvino import KEPT_COMPILED

pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")

#: The width of the model's rows.
WIDTH = 64
#: Rows that make the untaken branch's outer product [WIDTH n, WIDTH n] 4 TiB: OpenVINO
#: allocates it when it compiles for this shape; ONNX Runtime never runs that branch.
HUGE_ROWS = (1 << 20) // WIDTH


def _untaken_outer_product() -> onnx.ModelProto:
    """``h = x @ w`` [n, WIDTH]; ``If(max(h) > -1e30)``: then ``h``, else the row sums of
    the outer product of ``h`` flattened (never run: the condition always holds)."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array((0.3 * rng.standard_normal((WIDTH, WIDTH))).astype(np.float32), "w")

    def vi(name: str, shape: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    then = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["t"])], "then", [], [vi("t", ["n", WIDTH])]
    )
    consts = [
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([0], np.int64), "ax0"),
        numpy_helper.from_array(np.array([-1, WIDTH], np.int64), "rows"),
    ]
    other = helper.make_graph(
        [
            helper.make_node("Reshape", ["h", "flat"], ["f"]),
            helper.make_node("Unsqueeze", ["f", "ax1"], ["col"]),
            helper.make_node("Unsqueeze", ["f", "ax0"], ["row"]),
            helper.make_node("MatMul", ["col", "row"], ["outer"]),
            helper.make_node("ReduceSum", ["outer", "ax1"], ["sums"], keepdims=0),
            helper.make_node("Reshape", ["sums", "rows"], ["e"]),
        ],
        "else",
        [],
        [vi("e", ["n", WIDTH])],
        consts,
    )
    low = numpy_helper.from_array(np.array(-1e30, np.float32), "low")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
            helper.make_node("ReduceMax", ["h"], ["top"], keepdims=0),
            helper.make_node("Greater", ["top", "low"], ["cond"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
        ],
        "untaken",
        [vi("x", ["n", WIDTH])],
        [vi("y", ["n", WIDTH])],
        [w, low],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _rows(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((n, WIDTH)).astype(np.float32)}


def test_a_shape_openvino_cannot_compile_is_a_failed_run():
    """Before: RuntimeLoadError from run(), which callers take for a model that never loaded."""
    model = _untaken_outer_product()
    options = RuntimeOptions("openvino")
    session = engine_for(options).session(model, options)
    small = _rows(4)
    assert_close(run_ort(model, small)["y"], session.run(small)["y"], "fp32")
    huge = _rows(HUGE_ROWS)
    assert run_ort(model, huge)["y"].shape == (HUGE_ROWS, WIDTH)  # ONNX Runtime runs it
    with pytest.raises(RuntimeRunError, match=r"cannot compile the model for input shapes x"):
        session.run(huge)
    assert_close(run_ort(model, small)["y"], session.run(small)["y"], "fp32")  # still runs


def test_a_shape_openvino_cannot_compile_for_the_fp32_model_is_one_error_line():
    """Before: the guard caught only RuntimeRunError, and quantize ended with an
    uncaught RuntimeLoadError. The guard's FP32 reference runs in the deployment's engine
    (as the INT8 model's check does), so a held-out shape OpenVINO cannot compile even
    for the FP32 model is one error line: no INT8 model can be judged against it."""
    model = _untaken_outer_product()
    calibration = [_rows(4, seed) for seed in range(4)]
    with pytest.raises(MixprecError, match="cannot run the FP32 model in openvino") as info:
        mixprec.quantize(
            model,
            calibration,
            eval_data=[_rows(HUGE_ROWS, 9)],
            runtime="openvino",
            mode="static",
            speed="off",
        )
    assert "cannot compile the model for input shapes x" in str(info.value)


def _untaken_pairs() -> onnx.ModelProto:
    """``If(max(x) > -1e30)``: then ``x`` [n, 8], else ``x`` reshaped to pairs of rows and
    back (never run). With n odd the else branch has no static shape, so OpenVINO refuses
    to fix the input shapes; with dynamic shapes it runs the then branch."""
    vi = helper.make_tensor_value_info
    then = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["t"])], "then", [], [vi("t", 1, ["n", 8])]
    )
    other = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "pairs"], ["p"]),
            helper.make_node("Reshape", ["p", "rows"], ["e"]),
        ],
        "else",
        [],
        [vi("e", 1, ["n", 8])],
        [
            numpy_helper.from_array(np.array([2, -1, 8], np.int64), "pairs"),
            numpy_helper.from_array(np.array([-1, 8], np.int64), "rows"),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
            helper.make_node("Greater", ["top", "low"], ["cond"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other),
        ],
        "pairs",
        [vi("x", 1, ["n", 8])],
        [vi("y", 1, ["n", 8])],
        [numpy_helper.from_array(np.array(-1e30, np.float32), "low")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def test_dynamic_shapes_after_a_refused_reshape_are_said(caplog):
    """Before: the session fell back to dynamic shapes without a word."""
    model = _untaken_pairs()
    options = RuntimeOptions("openvino")
    session = engine_for(options).session(model, options)
    even = {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}
    assert_close(run_ort(model, even)["y"], session.run(even)["y"], "fp32")
    assert session.notes == []  # 4 rows: fixed shapes
    odd = {"x": np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)}
    with caplog.at_level(logging.WARNING, logger="mixprec.runtime.openvino"):
        assert_close(run_ort(model, odd)["y"], session.run(odd)["y"], "fp32")
    assert len(session.notes) == 1 and "runs with dynamic shapes" in session.notes[0]
    assert "x [3, 8]" in session.notes[0], session.notes
    assert session.notes[0] in caplog.text
    report = validate_models(model, model, odd, runtime=options)
    assert report.passed and report.kind != "emulated", report.format_table()
    assert any("runs with dynamic shapes" in n for n in report.notes), report.notes
    assert "dynamic shapes" in report.format_table()


def test_the_session_keeps_a_few_compiled_models():
    """Before: one compiled model per distinct input shape, never dropped (text windows
    of many lengths piled up). Outputs still match ONNX Runtime, evicted shapes rerun."""
    model = _untaken_outer_product()
    options = RuntimeOptions("openvino")
    session = engine_for(options).session(model, options)
    lengths = [1, 2, 3, 5, 8, 13, 21, 2]
    for n in lengths:
        feeds = _rows(n, n)
        assert_close(run_ort(model, feeds)["y"], session.run(feeds)["y"], "fp32")
        assert len(session.compiled_shapes) <= KEPT_COMPILED
    kept = [shapes["x"][0] for shapes in session.compiled_shapes]
    assert kept == [8, 13, 21, 2], kept  # 2 ran again last: the most recent
    feeds = _rows(1, 1)  # dropped: compiled again
    assert_close(run_ort(model, feeds)["y"], session.run(feeds)["y"], "fp32")
    assert [shapes["x"][0] for shapes in session.compiled_shapes] == [13, 21, 2, 1]


def test_a_scalar_input_runs_as_a_scalar():
    """Silero VAD's sample rate is a 0-d int64 input. Before, the session handed it to
    OpenVINO through ``np.ascontiguousarray``, which makes a 0-d array 1-d: "the model
    input (shape=[]) and the tensor (shape=(1)) are incompatible"."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x, int64 rate) => (float[2,3] y) {
        r = Cast <to = 1> (rate)
        y = Mul(x, r)
    }
    """
    model = onnx.parser.parse_model(text)
    options = RuntimeOptions("openvino", precision="f32")
    session = engine_for(options).session(model, options)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "rate": np.array(3, np.int64)}
    assert_close(run_ort(model, feeds)["y"], session.run(feeds)["y"], "fp32")
