"""Every path that runs a user's model reads the runtime ``mixprec optimize`` wrote into
its ``metadata_props``: :func:`mixprec.runtime.engines.run_model` (the Python door) and
``mixprec.validate`` run an OpenVINO-stamped model in OpenVINO for real; an explicit
runtime still wins; an input stamped by an earlier optimize loses its stale fields."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

import mixprec
from guard_models import separable_classifier, separable_samples
from mixprec.io.runtime_fields import RUNTIME_KEY, runtime_fields_of
from mixprec.optimize.metadata import stamp
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import ENGINES, options_of_model, run_model

pytest.importorskip("openvino")


@pytest.fixture
def used(monkeypatch) -> Iterator[list[str]]:
    """The names of the engines sessions were opened in, in order (the real engines run:
    each one's ``session`` is wrapped to record its name first)."""
    names: list[str] = []
    for name, engine in ENGINES.items():
        real = engine.session

        def session(model, options, *, timing=False, hints=None, _real=real, _name=name):
            names.append(_name)
            return _real(model, options, timing=timing, hints=hints)

        monkeypatch.setattr(engine, "session", session)
    yield names


def _stamped(tmp_path: Path, precision: str = "f32") -> Path:
    path = tmp_path / "fast.onnx"
    options = RuntimeOptions("openvino", precision=precision)
    onnx.save(stamp(separable_classifier(), options), path)
    return path


def test_run_model_runs_a_stamped_model_where_its_metadata_says(tmp_path, used) -> None:
    path = _stamped(tmp_path)
    feeds = separable_samples(1, rows=4)[0]
    for given in (path, str(path), onnx.load(path), path.read_bytes()):
        got = run_model(given, feeds)
        assert used[-1] == "openvino"
    ref = run_model(tmp_path / "fast.onnx", feeds, RuntimeOptions())  # explicit: ORT
    assert used[-1] == "ort"
    np.testing.assert_allclose(got["probs"], ref["probs"], rtol=1e-4, atol=1e-6)
    plain = tmp_path / "plain.onnx"
    onnx.save(separable_classifier(), plain)
    run_model(plain, feeds)  # no fields: ONNX Runtime
    assert used[-1] == "ort"


def test_options_of_model_reads_every_form(tmp_path) -> None:
    path = _stamped(tmp_path, "f32")
    assert options_of_model(path) == RuntimeOptions("openvino", precision="f32")
    assert options_of_model(path, threads=1).threads == 1
    (tmp_path / "junk.onnx").write_text("not a model")
    assert options_of_model(tmp_path / "junk.onnx") is None  # the engine says what is wrong
    assert options_of_model(separable_classifier()) is None


def test_validate_runs_a_stamped_model_in_openvino(tmp_path, used) -> None:
    original = tmp_path / "m.onnx"
    onnx.save(separable_classifier(), original)
    path = _stamped(tmp_path)
    report = mixprec.validate(str(original), str(path), inputs=separable_samples(2, rows=4))
    assert report.passed and report.kind == "openvino"
    assert set(used) == {"ort", "openvino"}  # the original in ORT, the converted one not


def test_an_earlier_stamp_is_not_carried_over(tmp_path) -> None:
    path = _stamped(tmp_path)
    samples = separable_samples(12, rows=16)
    result = mixprec.optimize(str(path), samples, candidates=["fp32-ort"])
    assert result.winner == "fp32-ort" and result.unchanged
    out = tmp_path / "out.onnx"
    result.save(out)
    saved = onnx.load(out)
    assert runtime_fields_of(saved) == {}  # it runs in ONNX Runtime, as chosen
    assert options_of_model(out) is None
    assert any(f"{RUNTIME_KEY}='openvino'" in n for n in result.notes)


def test_convert_and_quantize_drop_an_optimized_inputs_runtime_fields(tmp_path: Path) -> None:
    """A stamped input (OpenVINO, f32) converted to fp16 or weight-quantized: the output
    no longer says OpenVINO f32 (those fields chose the input's runtime), and the report
    says they were dropped."""
    path = _stamped(tmp_path)
    samples = separable_samples(4)
    fp16 = mixprec.convert(path, "fp16", calibration_data=samples)
    int8w = mixprec.quantize(path, samples, weights="int8", guard=False)
    for result in (fp16, int8w):
        assert runtime_fields_of(result.model_proto) == {}
        assert any("runtime fields" in n and "dropped" in n for n in result.report.notes)
    assert runtime_fields_of(onnx.load(str(path)))  # the input is left as it was
