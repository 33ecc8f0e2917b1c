"""An OpenVINO winner's symbolic input dims are written static at the shape optimize
timed it at, so that OpenVINO compiling the written file as it stands compiles that
shape, as mixprec's engine (which reshapes first) did when it timed it. Before, the file
kept ``[N, 3, H, W]`` and a plain compile got generic dynamic kernels: PP-OCR cls v2 ran
1.31x ONNX Runtime compiled plainly against 0.91x reshaped, on this project's EPYC
(2026-12-02), where optimize had printed 0.74x."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from branch_models import rate_feeds, rate_model
from mixprec.optimize.served import agreed_shapes, folded_ifs, symbolic_dims, written_static

ov = pytest.importorskip("openvino")
TIMED = {"image": [1, 3, 12, 20]}


def _conv_model() -> onnx.ModelProto:
    """Conv -> Relu -> global pool over an ``[N, 3, H, W]`` input (N, H, W symbolic)."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["image", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, "H", None])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 1, 1])],
        [weight],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _plain_compile(model: onnx.ModelProto, path: Path) -> object:
    """The written file compiled as a user of OpenVINO compiles it, with the hint an
    fp32-openvino winner's metadata names (f32: a bf16 CPU would lower it otherwise),
    and no reshape."""
    onnx.save(model, path)
    return ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def _feed(shape: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    return {"image": np.random.default_rng(seed).random(shape, dtype=np.float32)}


def test_the_timed_shape_is_written_and_a_plain_compile_gets_it(tmp_path: Path) -> None:
    model = _conv_model()
    assert symbolic_dims(model, ["image"]) == {"image": [0, 2, 3]}
    before = _plain_compile(model, tmp_path / "before.onnx")
    assert before.inputs[0].partial_shape.is_dynamic  # the defect: generic kernels
    held = [_feed(TIMED["image"], seed) for seed in range(3)]
    written, clause = written_static(model, TIMED, held, named=False)
    assert clause == (
        "; input dims written static at image [1, 3, 12, 20], the shape it was timed at "
        "(OpenVINO compiles dims left dynamic into slower generic kernels; --shape names "
        "another)"
    )
    assert symbolic_dims(written, ["image"]) == {} and symbolic_dims(model, ["image"])
    compiled = _plain_compile(written, tmp_path / "after.onnx")
    shape = compiled.inputs[0].partial_shape
    assert shape.is_static and [d.get_length() for d in shape] == TIMED["image"]
    onnx.checker.check_model(written, full_check=True)
    # the same answers as the FP32 input in ONNX Runtime at that shape
    feed = held[0]
    want = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
    got = compiled.create_infer_request().infer({0: feed["image"]})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_samples_of_other_shapes_keep_the_dims_unless_named() -> None:
    model = _conv_model()
    held = [_feed(TIMED["image"]), _feed([1, 3, 12, 32])]  # a wider line than the timed one
    kept, clause = written_static(model, TIMED, held, named=False)
    assert kept is model and symbolic_dims(kept, ["image"]) == {"image": [0, 2, 3]}
    assert clause.startswith(
        "; its input dims stay dynamic (the samples differ from the timed image [1, 3, 12, 20])"
    ), clause
    assert clause.endswith("(--shape writes them static)")
    named, clause = written_static(model, TIMED, held, named=True)  # --shape: the user's
    assert symbolic_dims(named, ["image"]) == {} and "written static" in clause


def test_a_model_with_fixed_dims_is_left_as_it_is() -> None:
    model = _conv_model()
    fixed, _ = written_static(model, TIMED, [_feed(TIMED["image"])], named=False)
    again, clause = written_static(fixed, TIMED, [_feed([1, 3, 12, 32])], named=False)
    assert again is fixed and clause == ""


def test_a_model_openvino_cannot_read_is_folded_for_it_and_timed_there() -> None:
    """Silero VAD's Ifs on shapes: every OpenVINO candidate failed ("Conversion is failed
    for: Conv-16"). optimize now folds them at the one shape all samples share, and the
    OpenVINO candidates run, are checked and timed."""
    result = mixprec.optimize(
        rate_model(), rate_feeds(12), candidates=["fp32-ort", "fp32-openvino"], time_budget=20
    )
    row = next(r for r in result.table if r.name == "fp32-openvino")
    assert row.status not in ("failed", "skipped"), row.note
    assert row.timing is not None and row.accurate
    assert any("5 If(s) folded at audio [1, 2, 16]" in note for note in result.notes)
    if result.winner == "fp32-openvino":  # the last line says what the file holds
        assert "If(s) folded" in result.summary
        assert not any(n.op_type == "If" for n in result.model_proto.graph.node)


def test_the_folded_file_compiles_plainly_and_other_shapes_keep_the_ifs(tmp_path: Path) -> None:
    model, data = rate_model(), rate_feeds(4)
    shapes = agreed_shapes(data[0], data)
    assert shapes == {"audio": [1, 2, 16], "rate": []}
    folded, line = folded_ifs(model, shapes)
    assert folded is not None and "5 If(s) folded" in line
    compiled = _plain_compile(folded, tmp_path / "folded.onnx")
    want = ort.InferenceSession(model.SerializeToString()).run(None, data[0])[0]
    got = compiled.create_infer_request().infer({"audio": data[0]["audio"]})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    longer = {**data[1], "audio": np.zeros((1, 2, 24), np.float32)}
    assert agreed_shapes(data[0], [*data, longer]) == {}  # one shape for all, or no fold
    assert folded_ifs(model, {}) == (None, "")
