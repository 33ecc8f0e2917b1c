"""Bad input around ``mixprec optimize`` and the models it writes, each one error line
and a non-zero exit, never a traceback, never a file: a model whose metadata names a
runtime that is not installed here, a time budget too small for this model (the line
names the minimum), and the input no candidate beats (written unchanged, and said)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from guard_models import separable_classifier, separable_samples
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.optimize.metadata import stamp
from mixprec.optimize.timing import minimum_seconds
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import ENGINES, run_model

pytest.importorskip("openvino")


def _slow(matmuls: int = 200, size: int = 192) -> onnx.ModelProto:
    """x[size,size] through ``matmuls`` MatMuls with Tanh: milliseconds per run (on a
    2-core Xeon with AMX, 192: 11-12 ms; 512: about 140 ms)."""
    w = (np.random.default_rng(0).standard_normal((size, size)) / size**0.5).astype(np.float32)
    nodes, last = [], "x"
    for k in range(matmuls):
        nodes.append(helper.make_node("MatMul", [last, "w"], [f"m{k}"]))
        nodes.append(helper.make_node("Tanh", [f"m{k}"], [f"t{k}"]))
        last = f"t{k}"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size, size])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def stamped(tmp_path: Path) -> tuple[Path, Path]:
    """(the FP32 model, the same model stamped to run in OpenVINO)."""
    original, fast = tmp_path / "m.onnx", tmp_path / "fast.onnx"
    onnx.save(separable_classifier(), original)
    onnx.save(stamp(separable_classifier(), RuntimeOptions("openvino", precision="f32")), fast)
    return original, fast


def test_metadata_naming_a_missing_runtime_is_one_line(stamped, capsys, monkeypatch) -> None:
    original, fast = stamped
    engine = ENGINES["openvino"]
    monkeypatch.setattr(engine, "missing", lambda options=None: "openvino is not installed")
    assert main(["validate", str(original), str(fast)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mixprec: error: the model's metadata mixprec.runtime='openvino'")
    assert "(openvino is not installed)" in err[0] and "--runtime ort" in err[0]
    feeds = separable_samples(1, rows=2)[0]
    with pytest.raises(MixprecError, match="names a runtime that cannot run here"):
        run_model(fast, feeds)
    # naming a runtime runs it anyway, as the line says
    assert main(["validate", str(original), str(fast), "--runtime", "ort", "-q"]) == 0
    assert run_model(fast, feeds, RuntimeOptions())["probs"].shape == (2, 4)


def test_cli_a_budget_too_small_names_the_minimum(tmp_path: Path, capsys) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(separable_classifier(), model)
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.stack([s["x"] for s in separable_samples(6, rows=4)]))
    out = tmp_path / "out.onnx"
    argv = ["optimize", str(model), "-o", str(out), "--calibration-data", str(calib)]
    assert main([*argv, "--time-budget", "0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    least = math.ceil(minimum_seconds(0.0) * 10) / 10
    assert err == [
        "mixprec: error: time budget 0.01 s is too small to time any candidate on this "
        f"model: give at least {least:g} s"
    ]
    assert not out.exists()


def test_the_minimum_grows_with_the_model(tmp_path: Path) -> None:
    """A budget above the least for any model, below this slow model's: refused once the
    input's run time is known, before any candidate is built, with this model's least.
    The model runs about 14x the least run the budget assumes (10 ms), so that no CPU this
    suite runs on makes it fast enough to pass (192x192 ran at 11-12 ms: 1.1x or less)."""
    model = _slow(size=512)
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal((512, 512)).astype(np.float32)} for _ in range(4)]
    budget = minimum_seconds(0.0) * 1.1
    with pytest.raises(MixprecError, match="give at least") as caught:
        mixprec.optimize(model, samples, candidates=["fp32-ort", "fp32-openvino"],
                         time_budget=budget)  # fmt: skip
    least = float(str(caught.value).split("give at least ")[1].split(" s")[0])
    assert least > budget


def test_cli_no_candidate_beats_the_input_is_written_unchanged_and_said(
    tmp_path: Path, capsys
) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(separable_classifier(), model)
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.stack([s["x"] for s in separable_samples(6, rows=4)]))
    out = tmp_path / "out.onnx"
    argv = ["optimize", str(model), "-o", str(out), "--calibration-data", str(calib)]
    assert main([*argv, "--candidates", "fp32-ort"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        "mixprec: no candidate beats the input in ONNX Runtime (fp32-ort): the input is "
        "written unchanged"
    )
    assert out.read_bytes() == model.read_bytes()
