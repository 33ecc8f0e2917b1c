"""The runtime seam: CPU features, runtime options, ONNX Runtime and OpenVINO (for real).

OpenVINO is the ``[openvino]`` extra, installed by ``make test``; its CPU plugin runs on
any x86 machine. Whether it computes bf16 depends on the CPU (avx512_bf16 / AMX): the
tests that need real bf16 kernels check both branches, each on the machine it runs on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from mixprec.checks.validate import validate_models
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.inputs.feeds import make_inputs
from mixprec.runtime.cpu import cpu_features, parse_cpuinfo
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions
from mixprec.runtime.engines import ENGINES, check_plan, engine_for, run_model
from proto_builders import BF16, F16, F32, _fp16_mlp, _model, _vi

#: ONNX Runtime with its basic graph optimizations, as the tests' references run.
BASIC = RuntimeOptions("ort", optimization="basic")

openvino = pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")

XEON_SPR = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16
processor\t: 1
model name\t: ignored
flags\t\t: fpu
"""
EPYC_ZEN2 = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_cpu_features_read_from_cpuinfo() -> None:
    spr = parse_cpuinfo(XEON_SPR)
    assert spr.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert (spr.bf16, spr.amx, spr.vnni, spr.fp16, spr.avx512) == (True, True, True, True, True)
    assert spr.describe().endswith("bf16 (AMX), fp16, INT8 VNNI, AVX-512"), spr.describe()
    zen2 = parse_cpuinfo(EPYC_ZEN2)
    assert (zen2.bf16, zen2.amx, zen2.vnni, zen2.fp16, zen2.avx2) == (
        False,
        False,
        False,
        False,
        True,
    )
    assert zen2.describe() == "AMD EPYC 7B12: AVX2", zen2.describe()
    assert set(cpu_features().summary()) == {"bf16", "fp16", "int8_vnni", "amx", "avx512", "avx2"}


def test_runtime_options_are_validated() -> None:
    assert RuntimeOptions() == RuntimeOptions("ort", 2, None, "latency")
    for kwargs, message in [
        ({"name": "tensorrt"}, r"unknown runtime 'tensorrt': use one of ort, openvino"),
        ({"threads": -1}, r"threads must be >= 0"),
        ({"threads": True}, r"threads must be an int"),
        ({"name": "openvino", "precision": "fp8"}, r"unknown inference precision 'fp8'"),
        ({"precision": "bf16"}, r"onnxruntime has no inference precision hint"),
        ({"performance": "fast"}, r"unknown performance hint 'fast'"),
    ]:
        with pytest.raises(MixprecError, match=message):
            RuntimeOptions(**kwargs)  # type: ignore[arg-type]


def test_both_engines_run_an_fp32_model_like_each_other() -> None:
    original, _ = _fp16_mlp()
    feeds, _ = make_inputs(original)
    want = run_model(original, feeds, BASIC)["y"]
    for name in ("ort", "openvino"):
        engine = engine_for(name)
        session = engine.session(
            original, RuntimeOptions(name, precision="f32" if name != "ort" else None)
        )
        got = session.run(feeds)["y"]
        assert session.output_names == ("y",)
        assert got.dtype == np.float32 and rel_l2_error(want, got) < 1e-5, (
            name,
            rel_l2_error(want, got),
        )
        described = engine.describe(RuntimeOptions(name))
        assert described["runtime"] == name and described["version"], described


def test_bf16_model_validated_in_openvino_against_ort_fp32() -> None:
    """The bf16 layers run on real bf16 kernels where the CPU has them (the runtime model
    says bf16), and the check says which engine and precision ran; elsewhere the model is
    emulated and the report says why."""
    original, converted = _fp16_mlp(low=BF16)
    feeds, _ = make_inputs(original)
    report = validate_models(original, converted, feeds, runtime=RuntimeOptions("openvino"))
    (out,) = report.outputs
    assert report.passed and 0 < out.rel_l2_error < 2e-2, report.format_table()
    if ENGINES["openvino"].computes_bf16():
        assert report.kind == "openvino" and report.fallback_reason == "", report
        assert report.runtime["runtime"] == "openvino", report.runtime
        assert "OpenVINO" in report.format_table(), report.format_table()
        # the default choice for a bf16 model on this CPU is OpenVINO too
        assert validate_models(original, converted, feeds).kind == "openvino"
    else:
        assert report.kind == "emulated", report
        assert "computes bf16 layers in f32 on this CPU" in report.fallback_reason, report


def test_openvino_hint_f32_keeps_fp32_layers_fp32_and_bf16_hint_lowers_them() -> None:
    """What the FP32 model gives under each hint: f32 is FP32 to float rounding, and on a
    bf16 CPU the bf16 hint lowers the MatMul (an error of bf16's size)."""
    original, _ = _fp16_mlp()
    feeds, _ = make_inputs(original)
    want = run_model(original, feeds, BASIC)["y"]
    engine = engine_for("openvino")
    f32 = engine.session(original, RuntimeOptions("openvino", precision="f32")).run(feeds)["y"]
    assert rel_l2_error(want, f32) < 1e-5
    if engine.computes_bf16():
        bf16 = engine.session(original, RuntimeOptions("openvino", precision="bf16")).run(feeds)
        assert 1e-4 < rel_l2_error(want, bf16["y"]) < 2e-2, rel_l2_error(want, bf16["y"])


def test_bf16_inputs_and_outputs_cross_the_openvino_boundary() -> None:
    original, converted = _fp16_mlp(low=BF16, low_io=True)
    feeds, _ = make_inputs(original)
    x = feeds["x"].astype(ml_dtypes.bfloat16)
    got = engine_for("openvino").session(converted, RuntimeOptions("openvino")).run({"x": x})
    assert got["y"].dtype == np.dtype(ml_dtypes.bfloat16)
    want = run_model(original, {"x": x.astype(np.float32)}, BASIC)["y"]
    assert rel_l2_error(want, got["y"].astype(np.float32)) < 2e-2


def _det_model() -> onnx.ModelProto:
    """A model ONNX Runtime runs and OpenVINO's ONNX front end cannot convert (Det)."""
    nodes = [
        helper.make_node("Cast", ["x"], ["xl"], to=F16),
        helper.make_node("Cast", ["xl"], ["xf"], to=F32),
        helper.make_node("Det", ["xf"], ["y"]),
    ]
    return _model(nodes, [_vi("x", F32, [3, 3])], [_vi("y", F32, [])])


def test_a_model_openvino_cannot_read_is_one_line_and_ort_still_validates() -> None:
    model = _det_model()
    with pytest.raises(RuntimeLoadError) as info:
        engine_for("openvino").session(model, RuntimeOptions("openvino"))
    message = str(info.value)
    assert message.startswith("openvino cannot load the model: ") and "\n" not in message
    assert "Det" in message, message
    feeds = {"x": (np.eye(3) * 2 + 0.1).astype(np.float32)}
    report = validate_models(model, model, feeds, runtime=RuntimeOptions("openvino"))
    assert report.kind == "onnxruntime" and report.passed, report
    assert "Det" in report.fallback_reason and "checked in onnxruntime" in report.fallback_reason


def test_check_plan_by_dtype_engine_and_cpu() -> None:
    assert check_plan("float16", None, "auto").options.name == "ort"
    assert check_plan("bfloat16", None, "emulated").emulated
    ort_plan = check_plan("bfloat16", RuntimeOptions("ort"), "auto")
    assert ort_plan.options.name == "ort" and not ort_plan.emulated  # tried, then emulated
    default = check_plan("bfloat16", None, "auto")
    ov_plan = check_plan("bfloat16", RuntimeOptions("openvino"), "auto")
    if ENGINES["openvino"].computes_bf16():
        assert default.options.name == "openvino" and not default.emulated
        assert not ov_plan.emulated
    else:
        assert default.options.name == "ort"
        assert ov_plan.emulated and "f32 on this CPU" in ov_plan.why


def test_runtime_openvino_without_the_extra_is_one_line(tmp_path) -> None:
    """Without openvino importable, ``--runtime openvino`` is one error line, exit 2."""
    original, converted = _fp16_mlp(low=BF16)
    onnx.save(original, tmp_path / "a.onnx")
    onnx.save(converted, tmp_path / "b.onnx")
    code = (
        "import sys; sys.modules['openvino'] = None\n"
        "from mixprec.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    args = ["validate", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx"), "--runtime", "openvino"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "mixprec: error: --runtime openvino needs the openvino package: "
        "pip install 'mixprec[openvino]'"
    ], done.stderr


def test_a_child_forked_after_openvino_ran_says_so_and_emulates() -> None:
    """OpenVINO is not fork-safe (a Core, new or inherited, hangs in a child forked after
    it ran): such a child gets one clear error for ``--runtime openvino``, and the default
    bf16 check emulates instead of hanging (the fuzz driver forks)."""
    original, converted = _fp16_mlp(low=BF16)
    feeds, _ = make_inputs(original)
    engine_for("openvino").session(converted, RuntimeOptions("openvino")).run(feeds)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(60)
        try:
            engine_for("openvino")
            os._exit(3)
        except MixprecError as e:
            if "forked after it ran" not in str(e):
                os._exit(4)
        report = validate_models(original, converted, feeds)
        os._exit(0 if report.kind == "emulated" and report.passed else 5)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
