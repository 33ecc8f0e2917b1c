"""Ifs decided by shapes, folded at a static input shape (``FoldStaticIfsPass``).

Silero VAD, as exported, tests shapes with Ifs whose branches differ in rank, and
OpenVINO's ONNX reader refused it ("Conversion is failed for: Conv-16"). The pass folds
those Ifs at one static shape, and an If whose one branch cannot run there; the result
answers as the original does in ONNX Runtime, and OpenVINO reads it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from branch_models import STATIC, rate_feeds, rate_model
from mixprec.passes.branches import FoldStaticIfsPass


def _ifs(model: onnx.ModelProto) -> int:
    folded = ir.from_proto(model)
    return sum(n.op_type == "If" for n in ir.traversal.RecursiveGraphIterator(folded.graph))


def _folded(
    model: onnx.ModelProto, shapes: dict[str, list[int]]
) -> tuple[onnx.ModelProto, list[str]]:
    work = ir.from_proto(model)
    for value in work.graph.inputs:
        if value.name in shapes:
            value.shape = ir.Shape(shapes[value.name])
    result = FoldStaticIfsPass()(work)
    assert result.modified or not result.folded  # a fold is a modification
    return ir.to_proto(work), result.folded


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]


def test_shape_tests_and_a_branch_that_cannot_run_fold_to_the_same_answers() -> None:
    model = rate_model()
    assert _ifs(model) == 5
    folded, lines = _folded(model, STATIC)
    onnx.checker.check_model(folded, full_check=True)
    assert _ifs(folded) == 0
    assert sum("shapes fix its condition" in line for line in lines) == 4
    assert len(lines) == 5 and "else branch cannot run at this shape" in lines[-1]
    assert "Incompatible dimensions" in lines[-1]  # why, from shape inference
    for feeds in rate_feeds(3):
        np.testing.assert_array_equal(_run(folded, feeds), _run(model, feeds))


def test_openvino_reads_the_folded_model_and_not_the_original() -> None:
    ov = pytest.importorskip("openvino")
    model, feeds = rate_model(), rate_feeds(1)[0]
    core = ov.Core()
    with pytest.raises(RuntimeError, match="Conversion is failed"):
        core.read_model(model.SerializeToString(), b"")
    folded, _ = _folded(model, STATIC)
    compiled = core.compile_model(
        core.read_model(folded.SerializeToString(), b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    got = compiled({"audio": feeds["audio"]})[0]  # the rate input no branch reads is gone
    np.testing.assert_allclose(got, _run(model, feeds), rtol=1e-5, atol=1e-6)


def test_dims_left_dynamic_leave_the_model_as_it_is() -> None:
    folded, lines = _folded(rate_model(), {"rate": []})  # audio keeps [N, 2, T]
    assert lines == [] and _ifs(folded) == 5


def test_at_8_samples_the_8khz_branch_is_the_one_kept() -> None:
    """At 8 samples (6 frames) the 16 kHz branch's MatMul (14 frames) cannot run."""
    model = rate_model()
    folded, lines = _folded(model, {"audio": [1, 2, 8], "rate": []})
    assert _ifs(folded) == 0 and "then branch cannot run" in lines[-1]
    feeds = {"audio": rate_feeds(1)[0]["audio"][:, :, :8], "rate": np.array(8000, np.int64)}
    np.testing.assert_array_equal(_run(folded, feeds), _run(model, feeds))


def test_an_if_both_of_whose_branches_run_stays() -> None:
    model = rate_model(else_frames=14)  # both rates run 16 samples
    folded, lines = _folded(model, STATIC)
    assert len(lines) == 4 and _ifs(folded) == 1  # the shape tests fold, the rate test stays
    for rate in (16000, 8000):
        feeds = {**rate_feeds(1)[0], "rate": np.array(rate, np.int64)}
        np.testing.assert_array_equal(_run(folded, feeds), _run(model, feeds))
