"""Tests of mixprec.checks.validate: validating a converted model against its original."""

from __future__ import annotations

import pytest

from mixprec.checks.validate import validate_models
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import DEFAULT_RTOL
from mixprec.inputs.feeds import make_inputs
from mixprec.runtime.engine import RuntimeOptions
from proto_builders import (
    BF16,
    _fp16_mlp,
)


def test_validate_bfloat16_auto_falls_back_to_emulation() -> None:
    """In ONNX Runtime (asked for by name) a bf16 model is emulated: no bf16 kernels."""
    original, converted = _fp16_mlp(low=BF16)
    feeds, _ = make_inputs(original)
    report = validate_models(original, converted, feeds, runtime=RuntimeOptions("ort"))
    assert report.kind == "emulated" and report.fallback_reason, report
    assert "NOT_IMPLEMENTED" in report.fallback_reason, report.fallback_reason
    assert report.low_dtype == "bfloat16" and report.rtol == DEFAULT_RTOL["bfloat16"], report
    assert report.passed, report.format_table()
    (out,) = report.outputs
    assert 0 < out.rel_l2_error < 2e-2, out
    with pytest.raises(MixprecError, match=r"NOT_IMPLEMENTED"):
        validate_models(original, converted, feeds, mode="ort")
    emulated = validate_models(original, converted, feeds, mode="emulated")
    assert emulated.kind == "emulated" and emulated.fallback_reason == "", emulated
    assert emulated.outputs == report.outputs


def test_validate_fp16_runs_on_ort_and_reports() -> None:
    original, converted = _fp16_mlp()
    feeds, _ = make_inputs(original)
    report = validate_models(original, converted, feeds)
    assert report.kind == "onnxruntime" and report.fallback_reason == "", report
    assert report.low_dtype == "float16" and report.rtol == 1e-2, report
    assert report.passed, report.format_table()
    table = report.format_table()
    assert table.splitlines()[0].split() == [
        "output",
        "max",
        "abs",
        "err",
        "rel",
        "L2",
        "top-1",
        "ok",
    ]
    assert "PASSED" in table and "\ny " in table, table
    data = report.to_dict()
    assert data["passed"] is True and data["kind"] == "onnxruntime", data

    strict = validate_models(original, converted, feeds, rtol=1e-9, atol=0.0, mode="ort")
    assert not strict.passed and "FAILED" in strict.format_table(), strict.format_table()
    with pytest.raises(MixprecError, match=r"unknown validation mode 'gpu'"):
        validate_models(original, converted, feeds, mode="gpu")
