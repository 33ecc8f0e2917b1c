"""``mixprec.validate`` (``convert --validate``, ``mixprec validate``) reads each output as
rows of answers too (issue 43), not only by one relative L2 over the tensor: each case
below passed the whole-tensor check (rel L2 <= rtol) while an answer changed, and fails
now, saying which reading missed."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import mixprec
from mixprec.cli.main import main
from mixprec.cli.writing import _worst
from text_models import filled_model

RNG = np.random.default_rng(7)

_SCALED = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8, 2] x) => (float[8, 2] box) <float[2] s> {
        box = Mul (x, s)
    }
"""
_LOGITS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8, 4] x) => (float[8, 10] logits) <float[4, 10] w> {
        logits = MatMul (x, w)
    }
"""


def _pair(text: str, name: str, ref: np.ndarray, new: np.ndarray) -> tuple[onnx.ModelProto, ...]:
    return filled_model(text, **{name: ref}), filled_model(text, **{name: new})


def test_a_small_channel_beside_a_large_one_is_read_on_its_own():
    """Pixels (x1000) beside a unit-scale channel: 20% off the small one is 2e-4 of the
    tensor's norm, which the old check passed at rtol 1e-2."""
    original, changed = _pair(_SCALED, "s", np.array([1000.0, 1.0]), np.array([1000.0, 1.2]))
    feeds = {"x": RNG.uniform(1, 2, (8, 2)).astype(np.float32)}
    report = mixprec.validate(original, changed, inputs=feeds, rtol=1e-2)
    (compared,) = report.outputs
    assert compared.passed and compared.rel_l2_error < 1e-3  # the whole tensor: fine
    closeness, check = report.checks  # the tensor's rel L2, then its rows: one schema
    assert closeness.kind == "rel-l2" and closeness.passed
    assert closeness.value == pytest.approx(compared.rel_l2_error)
    assert check.kind == "channels" and check.value == pytest.approx(0.2, rel=1e-5)
    assert not check.passed and not report.passed
    table = report.format_table()
    assert " NO box: worst channel's rel L2 0.2 over 8 rows (needs <= 0.01)" in table, table
    assert "rel L2 of each of its 2 channels on axis 1" in table and "FAILED" in table
    same = mixprec.validate(original, original, inputs=feeds, rtol=1e-2)
    assert same.passed and [c.value for c in same.checks] == [0.0, 0.0], same.format_table()


def test_a_flipped_class_fails_where_the_logits_barely_moved(tmp_path, capsys):
    """Row 0 of 8 sits near a tie of two classes, and a nudge of the weights far below
    the logits' scale swaps them; the other rows keep their class."""
    weights = RNG.standard_normal((4, 10))
    x = RNG.standard_normal((8, 4))
    top, second = np.argsort(x[0] @ weights)[-1], np.argsort(x[0] @ weights)[-2]
    apart = weights[:, top] - weights[:, second]
    x[0] -= (x[0] @ apart - 1e-3) * apart / (apart @ apart)  # row 0: a gap of 1e-3
    x = x.astype(np.float32)
    nudged = weights.copy()
    nudged[:, second] += 2e-3 * x[0] / float(x[0] @ x[0])  # row 0's runner-up wins
    assert np.sum(np.argmax(x @ weights, 1) != np.argmax(x @ nudged, 1)) == 1
    original, changed = _pair(_LOGITS, "w", weights, nudged)
    report = mixprec.validate(original, changed, inputs={"x": x}, rtol=0.5)
    (compared,) = report.outputs
    assert compared.passed  # rel L2 within the (loose) rtol: the old verdict
    closeness, check = report.checks
    assert closeness.kind == "rel-l2" and closeness.passed
    assert check.kind == "top1" and check.rows == 8
    assert check.value == pytest.approx(7 / 8) and not report.passed
    assert report.to_dict()["checks"][1]["value"] == pytest.approx(7 / 8)
    paths = []
    for name, model in (("fp32", original), ("changed", changed)):
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(model, paths[-1])
    np.savez(tmp_path / "x.npz", x=x)
    code = main(["validate", *paths, "--inputs", str(tmp_path / "x.npz"), "--rtol", "0.5"])
    out = capsys.readouterr().out
    assert code == 1 and " NO logits: top-1 0.875 over 8 rows (needs >= 0.99)" in out, out
    # the one-line reason a convert without --validate warns with reads the same record
    assert _worst(report) == "output 'logits': top-1 0.875 over 8 rows (needs >= 0.99)"
    assert main(["validate", *paths, "--inputs", str(tmp_path / "x.npz"), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False
    assert [c["kind"] for c in data["checks"]] == ["rel-l2", "top1"]  # default rtol here
    assert data["checks"][1]["passed"] is False


def test_the_verdict_is_one_list_of_output_checks():
    """validate's pass is its OutputCheck records alone (issue 44: one schema of "is it
    still the same model?"): a tensor past its rel L2 fails as a ``rel-l2`` check, over
    every sample, with the samples' count as its rows."""
    from mixprec.checks.outputs import OutputCheck

    original, changed = _pair(_SCALED, "s", np.array([1.0, 1.0]), np.array([1.5, 1.0]))
    samples = [{"x": RNG.uniform(1, 2, (8, 2)).astype(np.float32)} for _ in range(3)]
    report = mixprec.validate(original, changed, inputs=samples, rtol=1e-2)
    assert all(isinstance(c, OutputCheck) for c in report.checks)
    closeness = next(c for c in report.checks if c.kind == "rel-l2")
    assert closeness.rows == 3 and not closeness.passed and not report.passed
    assert closeness.value == pytest.approx(max(o.rel_l2_error for o in report.outputs))
    assert report.to_dict()["checks"][0]["text"].startswith("rel L2 ")
