"""The bf16 defaults that hold on real bf16 kernels, and the check every bf16 conversion gets
(the opset upgrade that never moves an op to a version ONNX Runtime lacks: test_pipeline).

Each numeric check compares against ONNX Runtime's run of the FP32 model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.cli.main import main


def _conv_chain(scale: float, shift: float) -> onnx.ModelProto:
    """Conv -> Mul(scale) -> Add(shift) -> Relu -> Conv (a PP-OCR-like affine chain)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((4, 8, 3, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.full((1, 8, 1, 1), scale, np.float32), "s"),
        numpy_helper.from_array(np.full((1, 8, 1, 1), shift, np.float32), "b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c1", "s"], ["m"], name="scale"),
        helper.make_node("Add", ["m", "b"], ["a"], name="shift"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _precisions(result: mixprec.ConversionResult) -> dict[str, tuple[str, str]]:
    return {n.name: (n.precision, n.reason) for n in result.report.nodes}


def test_bf16_keeps_affine_ops_with_inexact_constants_fp32_and_says_why() -> None:
    inexact = mixprec.convert(_conv_chain(1 / 6, 0.1), "bf16")
    rows = _precisions(inexact)
    assert rows["conv1"][0] == "low" and rows["conv2"][0] == "low", rows
    assert rows["scale"][0] == "fp32", rows
    assert "constant bf16 cannot hold exactly (0.166667 -> 0.166992)" in rows["scale"][1]
    # FP32 spreads downstream of the seed to the next Conv, as every DENY does
    assert rows["shift"][0] == rows["relu"][0] == "fp32", rows
    exact = _precisions(mixprec.convert(_conv_chain(0.5, 3.0), "bf16"))
    assert exact["scale"][0] == exact["shift"][0] == "low", exact  # 0.5 and 3 are exact
    fp16 = _precisions(mixprec.convert(_conv_chain(1 / 6, 0.1), "fp16"))
    assert fp16["scale"][0] == "low", fp16  # a bf16 rule only
    # and the result is closer to FP32 than with the constants rounded (emulated bf16)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    report = mixprec.validate(_conv_chain(1 / 6, 0.1), inexact.model, inputs=feeds)
    assert report.passed, report.format_table()


def test_bf16_keeps_batchnorm_whole_and_fp32() -> None:
    model = _conv_chain(1.0, 0.0)
    rng = np.random.default_rng(2)
    graph = model.graph
    graph.node[1].CopyFrom(
        helper.make_node("BatchNormalization", ["c1", "g", "be", "mu", "var"], ["m"], name="bn")
    )
    for name, values in (
        ("g", rng.uniform(0.5, 1.5, 8)),
        ("be", rng.uniform(-1, 1, 8)),
        ("mu", rng.uniform(-1, 1, 8)),
        ("var", rng.uniform(0.5, 2, 8)),
    ):
        graph.initializer.append(numpy_helper.from_array(values.astype(np.float32), name))
    bf16 = _precisions(mixprec.convert(model, "bf16"))
    assert bf16["bn"][0] == "fp32" and "BatchNormalization by a constant" in bf16["bn"][1]
    fp16 = mixprec.convert(model, "fp16")
    assert "bn" not in _precisions(fp16)  # fp16 still folds it into the Conv


def test_bf16_convert_checks_itself_and_says_so_on_its_last_line(tmp_path: Path, capsys) -> None:
    src, out = tmp_path / "m.onnx", tmp_path / "m.bf16.onnx"
    onnx.save(_conv_chain(1 / 6, 0.1), src)
    assert main(["convert", str(src), "-o", str(out), "--dtype", "bf16", "-q"]) == 0
    first = capsys.readouterr()
    assert "(bf16 check passed, " in first.out, first
    assert (
        main(["convert", str(src), "-o", str(out), "--dtype", "bf16", "-q", "--rtol", "1e-6"]) == 0
    )
    second = capsys.readouterr()
    assert out.is_file() and "(bf16 check FAILED, " in second.out, second
    last = second.err.strip().splitlines()[-1]
    assert last.startswith("mixprec: warning: the bf16 model misses the tolerance"), last
    assert "rel L2" in last and ("checked in OpenVINO" in last or "emulated in FP32" in last)
    assert main(["convert", str(src), "-o", str(out), "--dtype", "bf16", "-q", "--no-check"]) == 0
    assert "bf16 check" not in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["fp16"])
def test_fp16_convert_has_no_implicit_check(tmp_path: Path, capsys, dtype: str) -> None:
    src, out = tmp_path / "m.onnx", tmp_path / "m.low.onnx"
    onnx.save(_conv_chain(1 / 6, 0.1), src)
    assert main(["convert", str(src), "-o", str(out), "--dtype", dtype, "-q"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"


def test_tune_runs_bf16_candidates_in_openvino() -> None:
    """tune(mode="openvino"): every candidate runs as is in OpenVINO (real bf16 kernels
    where the CPU has them) and the result meets the budget against ORT's FP32."""
    pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")
    model = _conv_chain(0.5, 3.0)
    rng = np.random.default_rng(3)
    data = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(3)]
    result = mixprec.tune(model, "bf16", data, budget=5e-2, mode="openvino")
    assert result.passed and result.low_mac_share == 1.0, result.report.notes
    report = mixprec.validate(model, result.model, inputs=data, runtime="openvino")
    assert report.passed, report.format_table()
