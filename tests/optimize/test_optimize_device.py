"""``mixprec optimize --device cuda`` without a GPU: the choice logic is tested with a fake
engine. ONNX Runtime's engine is replaced in the registry (the one table every caller
reaches engines through) by one that says yes to the CUDA provider and runs every model
for real in ONNX Runtime on the CPU: an fp16 model as it is, a bf16 model through the FP32
emulation of its bf16 rounding (ONNX Runtime's CPU has no bf16 kernels), its feeds bound
through ORT's real ``io_binding``. Only its speed is made up: each run on the fake device
advances the timing clock (:mod:`mixprec.runtime.clock`, a virtual one here) by a fixed
time by the model's lowest float dtype, so every ratio is known exactly, on any machine
under any load. Accuracy is never made up: the candidates are :func:`mixprec.convert`'s real
fp16 and bf16 models, checked against the input in ONNX Runtime's CPU provider.

Where onnxruntime-gpu is missing (here), ``--device cuda`` is one error line, and a model
stamped for CUDA says it cannot run here."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import mixprec
from guard_models import separable_classifier
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.io.runtime_fields import HINTS_KEY, RUNTIME_KEY
from mixprec.optimize.candidates import Candidate
from mixprec.optimize.device import device_candidates
from mixprec.optimize.metadata import stamp
from mixprec.passes.emulate import emulate_low_precision
from mixprec.report.optimize_page import candidates_html
from mixprec.runtime import clock as timing_clock
from mixprec.runtime.engine import REGISTRY, RuntimeOptions
from mixprec.runtime.engines import ENGINES, options_from_metadata, options_of_model, run_model

OrtEngine = type(ENGINES["ort"])
#: Seconds each run on the fake device takes on the virtual clock, by the model's lowest
#: float dtype: a GPU's gain from fp16 and more from bf16, made certain.
WAIT = {"float": 0.004, "float16": 0.0015, "bfloat16": 0.0008}
CUDA = '{"provider": "cuda"}'


def _lowest(proto: onnx.ModelProto) -> str:
    """The lowest float dtype the model computes in: its weights' and its Casts'."""
    types = {t.data_type for t in proto.graph.initializer}
    for node in proto.graph.node:
        types |= {a.i for a in node.attribute if node.op_type == "Cast" and a.name == "to"}
    if TensorProto.BFLOAT16 in types:
        return "bfloat16"
    return "float16" if TensorProto.FLOAT16 in types else "float"


class _Clock:
    """The timing clock, moved only by runs on the fake device."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Bound:
    """ORT's real binding; each run takes the fake device's time on the virtual clock."""

    def __init__(self, bound, wait: float, clock: _Clock) -> None:
        self.bound, self.wait, self.clock = bound, wait, clock

    def run(self) -> None:
        self.clock.now += self.wait
        self.bound.run()

    def outputs(self) -> dict[str, np.ndarray]:
        return self.bound.outputs()


class _OnDevice:
    """A real ORT CPU session that binds "on the device" and waits as the device would."""

    binds_on_device = True

    def __init__(self, inner, dtype: str, engine: FakeCuda) -> None:
        self.inner, self.dtype, self.engine = inner, dtype, engine
        self.output_names, self.notes = inner.output_names, inner.notes

    def run(self, feeds: Mapping[str, np.ndarray], output_names=None) -> dict[str, np.ndarray]:
        self.engine.clock.now += WAIT[self.dtype]
        return self.inner.run(feeds, output_names)

    def bind(self, feeds: Mapping[str, np.ndarray]) -> _Bound:
        self.engine.bound.append(self.dtype)
        return _Bound(self.inner.bind(feeds), WAIT[self.dtype], self.engine.clock)


class FakeCuda(OrtEngine):
    """ONNX Runtime, saying yes to ``provider="cuda"``; records every session opened there
    as (lowest dtype, timing) and every model whose feeds were bound for timing."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[tuple[str, bool]] = []
        self.bound: list[str] = []
        self.clock = _Clock()

    def missing(self, options=None):
        if options is not None and options.provider == "cuda":
            return None
        return super().missing(options)

    def session(self, model, options, *, timing=False, hints=None):
        if options.provider != "cuda":
            return super().session(model, options, timing=timing, hints=hints)
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, bytes):
            proto = onnx.load_model_from_string(model)
        else:
            proto = onnx.load(model)
        dtype = _lowest(proto)
        self.opened.append((dtype, timing))
        cpu = dataclasses.replace(options, provider="cpu")
        if dtype == "bfloat16":  # bf16's rounding, computed in FP32 (no fusions to undo it)
            proto = emulate_low_precision(proto)
            cpu = dataclasses.replace(cpu, optimization="off")
        inner = super().session(proto, cpu, timing=timing, hints=hints)
        return _OnDevice(inner, dtype, self)


@pytest.fixture
def cuda(monkeypatch) -> Iterator[FakeCuda]:
    """The fake in ONNX Runtime's place (``register_engine`` refuses a name taken: the
    registry's entry is swapped, and restored after the test)."""
    fake = FakeCuda()
    monkeypatch.setitem(REGISTRY, "ort", fake)
    monkeypatch.setattr(timing_clock, "now", fake.clock)
    yield fake


def _weights(path: Path) -> set[int]:
    return {t.data_type for t in onnx.load(path).graph.initializer}


def test_gpu_candidates_are_built_checked_and_timed_on_the_device(
    cuda: FakeCuda, model_file: Path, samples, tmp_path: Path
) -> None:
    # the held-out rows are too few to confirm fp16/bf16 passes: accepted, the device's
    # choice is the point here (confirmation: tests/optimize/test_confirmation.py)
    result = mixprec.optimize(str(model_file), samples, device="cuda", accept_unconfirmed=True)
    rows = {r.name: r for r in result.table}
    assert list(rows) == ["fp32-cuda", "fp16-cuda", "bf16-cuda"]
    assert all(r.runtime == "ort" and r.hints == {"provider": "cuda"} for r in result.table)
    assert rows["fp32-cuda"].status == "baseline" and rows["fp32-cuda"].accurate
    for name in ("fp16-cuda", "bf16-cuda"):
        row = rows[name]
        assert row.status == "timed" and row.accurate, row
        assert row.note.startswith("mixprec.convert to ")
        assert row.timing is not None  # exactly the device's set speeds
    assert rows["fp16-cuda"].timing.ratio == pytest.approx(WAIT["float16"] / WAIT["float"])
    assert rows["bf16-cuda"].timing.ratio == pytest.approx(WAIT["bfloat16"] / WAIT["float"])
    # each checked once and timed once on the device; timing ran the bound feeds
    assert collections.Counter(cuda.opened) == {
        ("float", False): 1,  # the input checked on the device (the reference: ORT's CPU)
        ("float", True): 2,  # the baseline every candidate is timed beside, the control
        ("float16", False): 1,
        ("float16", True): 1,
        ("bfloat16", False): 1,
        ("bfloat16", True): 1,
    }
    # the input bound beside each timed session (the control, fp16, bf16) and the control
    assert collections.Counter(cuda.bound) == {"float": 4, "float16": 1, "bfloat16": 1}
    assert result.winner == "bf16-cuda"  # accurate, and the fastest by more than 3%
    assert result.runtime == RuntimeOptions("ort", threads=2, provider="cuda")
    assert result.summary.startswith("bf16-cuda wins: ") and "x fp32-cuda, " in result.summary
    assert result.summary.endswith(f"written with mixprec.runtime=ort, {HINTS_KEY}={CUDA}")
    assert "timed beside the input on cuda (fp32-cuda)" in result.notes[0]
    assert result.to_dict()["device"] == "cuda"
    assert "vs fp32-cuda" in result.format_table().splitlines()[0]
    assert "<th>vs fp32-cuda</th>" in candidates_html(result)
    out = tmp_path / "out.onnx"
    result.save(out)
    props = {p.key: p.value for p in onnx.load(out).metadata_props}
    assert props == {RUNTIME_KEY: "ort", HINTS_KEY: CUDA}
    assert TensorProto.BFLOAT16 in _weights(out)  # the bf16 model itself was written
    assert options_of_model(out) == RuntimeOptions("ort", provider="cuda")
    # validate and run_model run it where its metadata says: on the (fake) device
    before = len(cuda.opened)
    report = mixprec.validate(str(model_file), str(out), inputs=samples[:2])
    assert set(cuda.opened[before:]) == {("bfloat16", False)}
    assert report.passed and report.runtime["provider"] == "cuda"
    feeds = samples[0]
    got = run_model(out, feeds)["probs"]
    assert cuda.opened[-1] == ("bfloat16", False)
    ref = run_model(model_file, feeds)["probs"]
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    assert 0 < np.abs(got - ref).max() < 1e-2  # bf16's rounding, really there


def _max_rel_l2(reference, outputs) -> float:
    """Minus the worst relative L2 error of ``probs``: higher is better."""
    errors = [rel_l2_error(r["probs"], o["probs"]) for r, o in zip(reference, outputs, strict=True)]
    return -float(max(errors))


def test_an_inaccurate_gpu_candidate_cannot_win(
    cuda: FakeCuda, model_file: Path, samples, tmp_path: Path
) -> None:
    """bf16 is the fastest on the fake device, but its rounding (rel L2 ~2e-3 on this
    model, fp16's ~2e-4) misses a budget of 1e-3: it is not timed and fp16 wins."""
    result = mixprec.optimize(
        str(model_file), samples, device="cuda", metric=_max_rel_l2, metric_budget=-1e-3
    )
    rows = {r.name: r for r in result.table}
    assert rows["bf16-cuda"].verdict == "inaccurate" and rows["bf16-cuda"].timing is None
    assert rows["bf16-cuda"].checks[0].value < -1e-3 < rows["fp16-cuda"].checks[0].value
    assert "bfloat16" not in cuda.bound and ("bfloat16", True) not in cuda.opened
    assert result.winner == "fp16-cuda"
    out = tmp_path / "out.onnx"
    result.save(out)
    assert TensorProto.FLOAT16 in _weights(out)
    assert options_of_model(out) == RuntimeOptions("ort", provider="cuda")


def test_the_input_on_the_device_is_written_with_its_provider(
    cuda: FakeCuda, model_file: Path, samples, tmp_path: Path
) -> None:
    result = mixprec.optimize(str(model_file), samples, device="cuda", candidates=["fp32-cuda"])
    assert result.winner == "fp32-cuda" and not result.unchanged
    assert result.summary == (
        "no candidate beats the input on cuda (fp32-cuda): the input is written with "
        f"mixprec.runtime=ort, {HINTS_KEY}={CUDA}"
    )
    out = tmp_path / "out.onnx"
    result.save(out)
    saved = onnx.load(out)
    assert {p.key: p.value for p in saved.metadata_props} == {RUNTIME_KEY: "ort", HINTS_KEY: CUDA}
    given = onnx.load(model_file).graph  # the input itself, its nodes and weights
    assert list(saved.graph.node) == list(given.node)
    assert list(saved.graph.initializer) == list(given.initializer)


def _npz(tmp_path: Path, samples) -> Path:
    path = tmp_path / "calib.npz"
    np.savez(path, x=np.stack([s["x"] for s in samples]))
    return path


def test_cli_device_cuda_then_validate(
    cuda: FakeCuda, model_file: Path, samples, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out.onnx"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data"]
    argv += [str(_npz(tmp_path, samples)), "--device", "cuda"]
    assert main([*argv, "--candidates", "fp32-cuda,fp16-cuda", "--accept-unconfirmed"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("mixprec: fp16-cuda wins: ")
    assert [line.split()[0] for line in lines[-4:-2]] == ["fp32-cuda", "fp16-cuda"]
    assert lines[-2].startswith("ratios timed at "), lines[-2]
    assert main(["validate", str(model_file), str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] and data["runtime"]["provider"] == "cuda"
    assert cuda.opened[-1] == ("float16", False)


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--device", "xpu"], "unknown device 'xpu': use one of cpu, cuda, tensorrt"),
        (["--device", "cuda", "--candidates", "fp32-ort"], "unknown candidate 'fp32-ort'"),
        (["--device", "cuda", "--runtime", "openvino"], "runs in ONNX Runtime"),
    ],
)
def test_cli_bad_device_arguments_are_one_line(
    cuda: FakeCuda, model_file: Path, samples, tmp_path: Path, capsys, extra, error
) -> None:
    out = tmp_path / "out.onnx"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data"]
    assert main([*argv, str(_npz(tmp_path, samples)), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: ") and error in err[0], err
    assert not out.exists()


def test_a_callers_candidate_must_run_on_the_device(cuda: FakeCuda, model_file, samples) -> None:
    mine = Candidate("mine", "ort", None, "input", "on the CPU")
    with pytest.raises(MixprecError, match="'mine' does not run on the device asked for"):
        mixprec.optimize(str(model_file), samples, device="cuda", candidates=[mine])
    theirs = dataclasses.replace(mine, provider="cuda")
    result = mixprec.optimize(str(model_file), samples, device="cuda", candidates=[theirs])
    assert [r.name for r in result.table] == ["fp32-cuda", "mine"]


def _without(provider: str) -> str:
    options = RuntimeOptions(provider=provider)
    if ENGINES["ort"].missing(options) is None:
        pytest.skip(f"this onnxruntime has the {provider} provider")
    return device_candidates(provider)[0].name


@pytest.mark.parametrize(
    ("device", "wanted"),
    [("cuda", "CUDAExecutionProvider"), ("tensorrt", "TensorrtExecutionProvider")],
)
def test_cli_a_device_not_installed_is_one_line(
    model_file: Path, samples, tmp_path: Path, capsys, device: str, wanted: str
) -> None:
    _without(device)
    out = tmp_path / "out.onnx"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data"]
    assert main([*argv, str(_npz(tmp_path, samples)), "--device", device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(
        f"mixprec: error: device '{device}' cannot run here: onnxruntime's {wanted} is not "
        "available here (onnxruntime "
    )
    assert "CPUExecutionProvider" in err[0] and "install onnxruntime-gpu" in err[0]
    assert not out.exists()
    with pytest.raises(MixprecError, match=f"device '{device}' cannot run here"):
        mixprec.optimize(str(model_file), samples, device=device)


def test_a_model_stamped_for_cuda_says_it_cannot_run_here(
    model_file: Path, tmp_path: Path, capsys
) -> None:
    _without("cuda")
    out = tmp_path / "fast.onnx"
    onnx.save(stamp(separable_classifier(), RuntimeOptions("ort", provider="cuda")), out)
    assert main(["validate", str(model_file), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(
        "mixprec: error: the model's metadata mixprec.runtime='ort' names a runtime that "
        "cannot run here (onnxruntime's CUDAExecutionProvider is not available here"
    )
    assert err[0].endswith("name another runtime to run it anyway (--runtime ort)")
    assert main(["validate", str(model_file), str(out), "--runtime", "ort", "-q"]) == 0


@pytest.mark.parametrize(
    ("hints", "error"),
    [
        ('{"provider": 3}', "provider must be a string"),
        ('{"provider": "gpu"}', "unknown onnxruntime provider 'gpu'"),
        ('{"device": "cuda"}', "mixprec reads only INFERENCE_PRECISION_HINT and provider"),
    ],
)
def test_bad_provider_fields_are_one_line(hints: str, error: str) -> None:
    model = separable_classifier()
    model.metadata_props.add(key=RUNTIME_KEY, value="ort")
    model.metadata_props.add(key=HINTS_KEY, value=hints)
    with pytest.raises(MixprecError, match=error):
        options_from_metadata(model)


def test_the_provider_round_trips_through_the_metadata(cuda: FakeCuda) -> None:
    for options in (
        RuntimeOptions("ort", provider="cuda"),
        RuntimeOptions("ort"),
        RuntimeOptions("ort", provider="cpu"),
    ):
        assert options_from_metadata(stamp(separable_classifier(), options)) == options
