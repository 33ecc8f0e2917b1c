"""Every command reads ``--inputs`` the same way (issue 17): an ``.npz`` of one sample, an
``.npz`` with a leading sample axis, or a folder of ``.npz`` files. Before, ``convert
--inputs`` took one sample and ``tune --inputs`` a stack."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.cli.main import main


def _conv() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array((0.3 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def forms(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    xs = rng.random((3, 1, 3, 8, 8), np.float32)
    np.savez(tmp_path / "one.npz", x=xs[0])
    np.savez(tmp_path / "stack.npz", x=xs)
    folder = tmp_path / "folder"
    folder.mkdir()
    for k in range(3):
        np.savez(folder / f"{k}.npz", x=xs[k])
    onnx.save(_conv(), tmp_path / "m.onnx")
    return {"one": tmp_path / "one.npz", "stack": tmp_path / "stack.npz", "folder": folder}


@pytest.mark.parametrize("form", ["one", "stack", "folder"])
def test_convert_validate_and_quantize_take_every_form(forms, form, tmp_path, capsys):
    src, data = tmp_path / "m.onnx", str(forms[form])
    samples = 1 if form == "one" else 3
    out = tmp_path / f"{form}.fp16.onnx"
    assert main(["convert", str(src), "-o", str(out), "--inputs", data, "--validate"]) == 0
    assert f"calibrated on {samples} sample(s)" in capsys.readouterr().out
    assert main(["validate", str(src), str(out), "--inputs", data, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and f"given inputs ({samples} sample(s)" in report["notes"][0]
    q = tmp_path / f"{form}.int8.onnx"
    args = ["quantize", str(src), "-o", str(q), "--inputs", data, "--speed", "off", "--json"]
    assert main(args) == 0
    guard = json.loads(capsys.readouterr().out)["guard"]
    assert guard["eval"] == "in-sample" and guard["eval_samples"] == samples, guard


def test_tune_takes_one_sample_too(forms, tmp_path, capsys):
    out = tmp_path / "t.onnx"
    args = ["tune", str(tmp_path / "m.onnx"), "-o", str(out), "--inputs", str(forms["one"])]
    assert main([*args, "--budget", "0.05", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]
