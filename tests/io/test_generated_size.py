"""A model whose declared inputs make a generated sample too large is refused at once
(issue 35, from the fuzz): one line, exit 2, before any allocation or long loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import assert_close, run_ort
from mixprec.cli.main import main

#: The fuzz's declared length of the ``bytes`` input: 2^40 elements.
HUGE = 1_099_511_627_776


def _file_type_classifier(length: int) -> onnx.ModelProto:
    """``bytes`` uint8 [length] -> Cast -> mean -> [1, 1] x [1, 4] -> Softmax."""
    w = numpy_helper.from_array(np.linspace(-1, 1, 4, dtype=np.float32)[None], "w")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    nodes = [
        helper.make_node("Cast", ["bytes"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["f"], ["mean"], keepdims=1),
        helper.make_node("Unsqueeze", ["mean", "axes"], ["row"]),
        helper.make_node("MatMul", ["row", "w"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "file_type",
        [helper.make_tensor_value_info("bytes", TensorProto.UINT8, [length])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 4])],
        [w, axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def test_a_huge_declared_input_is_refused_at_once(tmp_path: Path, capsys, monkeypatch) -> None:
    """Before: ONNX's shape inference (data propagation through the Cast) built one dim
    per declared element; ``convert -q`` ran past 110 s and was killed."""
    src, out = tmp_path / "file_type.onnx", tmp_path / "out.onnx"
    onnx.save(_file_type_classifier(HUGE), src)
    inferred: list[bool] = []  # "at once": no shape inference ran (it was what looped)
    infer = onnx.shape_inference.infer_shapes

    def counted(model: onnx.ModelProto, *args: object, **kwargs: object) -> onnx.ModelProto:
        inferred.append(bool(kwargs.get("data_prop")))
        return infer(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counted)
    code = main(["convert", str(src), "-o", str(out), "--dtype", "fp16", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and inferred == [], (code, inferred, err)
    assert len(err) == 1 and "over the 256 MiB limit on generated inputs" in err[0], err
    assert f"input 'bytes' dim 0 is declared {HUGE}" in err[0], err
    assert not out.exists()
    onnx.save(_file_type_classifier(64), src)  # the counter sees inference where it runs
    assert main(["convert", str(src), "-o", str(out), "--dtype", "fp16", "-q"]) == 0
    assert True in inferred, inferred


def test_a_small_declared_input_still_converts(tmp_path: Path) -> None:
    """The same model at 64 bytes converts, and its fp16 output follows ONNX Runtime's."""
    model = _file_type_classifier(64)
    src, out = tmp_path / "file_type.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    assert main(["convert", str(src), "-o", str(out), "--dtype", "fp16", "-q"]) == 0
    feeds = {"bytes": np.arange(64, dtype=np.uint8)}
    assert_close(run_ort(model, feeds)["probs"], run_ort(onnx.load(out), feeds)["probs"], "fp16")
