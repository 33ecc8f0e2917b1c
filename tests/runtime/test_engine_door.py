"""The runtime door: every model run goes through a registered engine.

A third engine registered from outside (here one that wraps ONNX Runtime and records
every session and run) is used by validate, quantize (its default accuracy guard) and
tune without any caller knowing its name, and gives ONNX Runtime's results. Capability
questions, the provider option, I/O binding and the kernel probe are checked too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from guard_models import wide_range_classifier, wide_range_samples
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.runtime.engine import LoadHints, ModelSource, RuntimeOptions, runtime_names
from mixprec.runtime.engines import (
    ENGINES,
    check_plan,
    engine_for,
    register_engine,
    runtime_taking,
    unregister_engine,
)
from mixprec.runtime.kernels import missing_kernels

ORT = ENGINES["ort"]


class _RecordingSession:
    """ONNX Runtime's session, counting runs."""

    def __init__(self, inner, engine: RecordingEngine) -> None:
        self.inner = inner
        self.engine = engine
        self.output_names = inner.output_names
        self.binds_on_device = inner.binds_on_device
        self.notes = inner.notes

    def run(self, feeds, output_names=None):
        self.engine.runs += 1
        return self.inner.run(feeds, output_names)

    def bind(self, feeds):
        self.engine.runs += 1
        return self.inner.bind(feeds)


class RecordingEngine:
    """A third engine: ONNX Runtime underneath, every session and run recorded; it can
    be told to refuse bf16 models or to compute them silently in f32."""

    name = "recording"
    label = "Recording"
    qdq_layout = "selectors"  # ONNX Runtime underneath

    def __init__(self, refuses_bf16: bool = True) -> None:
        self.sessions = 0
        self.runs = 0
        self.optimizations: list[str] = []  # each session's graph optimization level
        self._refuses_bf16 = refuses_bf16

    def missing(self, options: RuntimeOptions | None = None) -> str | None:
        return ORT.missing(options)

    def version(self) -> str:
        return ORT.version()

    def check_options(self, options: RuntimeOptions) -> None:
        ORT.check_options(options)

    def computes_bf16(self) -> bool:
        return False

    def refuses_bf16(self) -> bool:
        return self._refuses_bf16

    def runs_contrib_ops(self) -> bool:
        return True

    def saturates_int8(self) -> bool:
        return ORT.saturates_int8()

    def nbits_accuracy_level(self, bits: int, cpu=None) -> tuple[int, str]:
        return ORT.nbits_accuracy_level(bits, cpu)

    def has_kernel(self, node: ir.Node, opsets: Mapping[str, int]) -> bool:
        return ORT.has_kernel(node, opsets)

    def kernel_graph(self, model: onnx.ModelProto) -> onnx.ModelProto | None:
        return None

    def session(
        self,
        model: ModelSource,
        options: RuntimeOptions,
        *,
        timing: bool = False,
        hints: LoadHints | None = None,
    ) -> _RecordingSession:
        self.sessions += 1
        self.optimizations.append(options.optimization)
        inner = ORT.session(model, options, timing=timing, hints=hints)
        return _RecordingSession(inner, self)

    def describe(self, options: RuntimeOptions) -> dict[str, object]:
        return {**ORT.describe(options), "runtime": self.name, "label": self.label}


@pytest.fixture
def recording() -> Iterator[RecordingEngine]:
    engine = RecordingEngine()
    register_engine(engine)
    try:
        yield engine
    finally:
        unregister_engine(engine.name)


def _cnn() -> onnx.ModelProto:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> Softmax, 1x3x8x8."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((0.3 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32), "w"),
        numpy_helper.from_array((0.1 * rng.standard_normal(8)).astype(np.float32), "b"),
        numpy_helper.from_array((0.3 * rng.standard_normal((5, 8))).astype(np.float32), "wf"),
        numpy_helper.from_array((0.1 * rng.standard_normal(5)).astype(np.float32), "bf"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["l"], name="fc", transB=1),
        helper.make_node("Softmax", ["l"], ["y"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.uniform(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(n)]


def test_a_registered_engine_is_a_runtime_name(recording: RecordingEngine) -> None:
    assert "recording" in runtime_names()
    assert RuntimeOptions("recording").name == "recording"
    assert engine_for("recording") is recording
    with pytest.raises(MixprecError, match="registered already"):
        register_engine(recording)


def test_an_unregistered_name_is_refused_again() -> None:
    engine = RecordingEngine()
    register_engine(engine)
    unregister_engine(engine.name)
    with pytest.raises(MixprecError, match=r"unknown runtime 'recording': use one of ort"):
        RuntimeOptions("recording")


def test_validate_runs_through_the_registered_engine(recording: RecordingEngine) -> None:
    model = _cnn()
    converted = mixprec.convert(model, "fp16").model_proto
    feeds = _samples(1)[0]
    theirs = mixprec.validate(model, converted, inputs=feeds, runtime=RuntimeOptions("recording"))
    ours = mixprec.validate(model, converted, inputs=feeds)
    assert recording.sessions > 0 and recording.runs > 0
    assert theirs.runtime["runtime"] == "recording" and theirs.kind == "recording"
    assert [o.to_dict() for o in theirs.outputs] == [o.to_dict() for o in ours.outputs]


def test_quantize_and_its_guard_run_through_the_registered_engine(
    recording: RecordingEngine,
) -> None:
    model = _cnn()
    data = _samples(16)
    options = {"speed": "off", "mode": "static"}
    theirs = mixprec.quantize(model, data, runtime=RuntimeOptions("recording"), **options)
    ours = mixprec.quantize(model, data, **options)
    assert recording.sessions > 0 and recording.runs > 0  # the accuracy guard's runs
    assert theirs.model_proto.SerializeToString() == ours.model_proto.SerializeToString()


def test_the_int8_guards_repair_searches_in_the_engine_it_is_graded_in(
    recording: RecordingEngine,
) -> None:
    """Before: the repair's search ran in ONNX Runtime's CPU provider at the basic level
    (Q/DQ as DQ -> float -> Q) whatever --runtime was, while the guard graded in the
    deployment's engine with its fusions. Now the tuner's candidates are sessions of the
    gate's engine, at the level it deploys at ("all")."""
    model, data = wide_range_classifier(), wide_range_samples(40)
    options = {"speed": "off", "smooth": None, "guard_drop": 0.03}
    theirs = mixprec.quantize(model, data, runtime=RuntimeOptions("recording"), **options)
    guard = theirs.report.guard
    assert guard["kept_float"] == ["fc1"] and guard["passed"], guard  # a repair ran
    # the guard's own sessions are a few (reference, first check, graded checks); the
    # tuner's candidates add one each, all at the deployed level
    assert recording.sessions >= 8, recording.optimizations
    assert recording.optimizations.count("all") >= 6, recording.optimizations
    ours = mixprec.quantize(model, data, **options)
    assert theirs.model_proto.SerializeToString() == ours.model_proto.SerializeToString()


def test_tune_runs_through_the_registered_engine(recording: RecordingEngine) -> None:
    model = _cnn()
    data = _samples(4)
    theirs = mixprec.tune(model, "fp16", data, budget=1e-2, runtime=RuntimeOptions("recording"))
    ours = mixprec.tune(model, "fp16", data, budget=1e-2)
    assert recording.sessions > 0 and recording.runs > 0
    assert theirs.passed == ours.passed and theirs.achieved == ours.achieved
    assert [s.name for s in theirs.kept_float] == [s.name for s in ours.kept_float]
    assert theirs.model_proto.SerializeToString() == ours.model_proto.SerializeToString()


def test_bf16_is_emulated_where_an_engine_would_compute_it_in_f32() -> None:
    """check_plan asks the engine (refuses_bf16, computes_bf16), not its name."""
    silent = RecordingEngine(refuses_bf16=False)
    register_engine(silent)
    try:
        plan = check_plan("bfloat16", RuntimeOptions("recording"), "auto")
        assert plan.emulated and "Recording" in plan.why, plan
        assert not check_plan("float16", RuntimeOptions("recording"), "auto").emulated
    finally:
        unregister_engine(silent.name)
    refusing = check_plan("bfloat16", RuntimeOptions("ort"), "auto")
    assert not refusing.emulated  # tried as is; the caller emulates when it refuses


def test_binding_on_the_cpu_gives_what_run_gives() -> None:
    model = _cnn()
    options = RuntimeOptions()
    session = engine_for(options).session(model, options)
    assert not session.binds_on_device
    feeds = _samples(1)[0]
    bound = session.bind(feeds)
    bound.run()
    bound.run()
    got, want = bound.outputs(), session.run(feeds)
    assert list(got) == list(want) == ["y"]
    np.testing.assert_array_equal(got["y"], want["y"])


def test_runtime_options_check_the_provider_with_the_engine() -> None:
    assert RuntimeOptions(provider="cpu").provider == "cpu"
    with pytest.raises(MixprecError, match=r"unknown onnxruntime provider 'gpu': use cpu, cuda"):
        RuntimeOptions(provider="gpu")
    with pytest.raises(MixprecError, match="upper-case"):
        RuntimeOptions("openvino", provider="gpu")
    with pytest.raises(MixprecError, match="unknown graph optimization"):
        RuntimeOptions(optimization="most")
    with pytest.raises(MixprecError, match="no inference precision hint"):
        RuntimeOptions(precision="bf16")
    # the CLI's default runtime for a precision hint: the first engine that takes it
    assert [runtime_taking(p) for p in (None, "f32", "bf16")] == ["ort", "ort", "openvino"]


def _without_cuda() -> None:
    if ORT.missing(RuntimeOptions(provider="cuda")) is None:
        pytest.skip("this onnxruntime has the CUDA provider")


def test_a_missing_provider_is_one_clear_error() -> None:
    _without_cuda()
    with pytest.raises(MixprecError) as caught:
        engine_for(RuntimeOptions(provider="cuda"))
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith("onnxruntime's CUDAExecutionProvider is not available here")
    assert "CPUExecutionProvider" in text and "install onnxruntime-gpu" in text


def test_cli_a_missing_provider_exits_2_with_one_line(tmp_path, capsys) -> None:
    _without_cuda()
    model = tmp_path / "m.onnx"
    onnx.save(_cnn(), model)
    code = main(["validate", str(model), str(model), "--provider", "cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "CUDAExecutionProvider is not available here" in err, err


def test_one_kernel_probe_answers_for_every_caller() -> None:
    """missing_kernels (the opset upgrade) asks the engine's has_kernel."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node("", "Relu", [x], num_outputs=1)
    node.outputs[0].name = "y"
    node.outputs[0].dtype = ir.DataType.FLOAT
    assert ORT.has_kernel(node, {"": 17})
    model = ir.Model(
        ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 17}), ir_version=8
    )
    assert missing_kernels(model, ["Relu"], 17) == []

    class NoKernels(RecordingEngine):
        def has_kernel(self, node: ir.Node, opsets: Mapping[str, int]) -> bool:
            return False

    assert missing_kernels(model, ["Relu"], 17, NoKernels()) == ["Relu-14"]


def test_torch_runs_in_place_or_through_host_arrays() -> None:
    """The torch runner binds tensors in place through the ORT session's run_buffers, and
    runs an engine session without it through host arrays: the same outputs."""
    torch = pytest.importorskip("torch")
    from mixprec.torch._runtime import OrtRunner

    runner = OrtRunner(ir.from_proto(_cnn()), ["CPUExecutionProvider"])
    assert runner.device == "cpu" and runner.kind == "onnxruntime"
    x = torch.from_numpy(_samples(1)[0]["x"])
    (in_place,) = runner.run({"x": x})
    runner.session = _RecordingSession(runner.session, RecordingEngine())
    (hosted,) = runner.run({"x": x})
    torch.testing.assert_close(in_place, hosted, rtol=0, atol=0)
    with pytest.raises(MixprecError, match="unknown execution provider 'GPU'"):
        OrtRunner(ir.from_proto(_cnn()), ["GPU"])
