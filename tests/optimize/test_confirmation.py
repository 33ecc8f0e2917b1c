"""A pass the held-out rows cannot confirm is not a pass for ``optimize`` (issue 43):
a candidate whose checks pass, but whose 95% lower bound of agreement sits under its
budget, loses, and the last line says how many rows would confirm it; the user's
``--accept-unconfirmed`` takes it. FP32 in any runtime needs no confirming. And the
user's ``--output-kind`` replaces mixprec's reading of an output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

import mixprec
from guard_models import CLASSES
from mixprec.cli.main import main
from mixprec.optimize.candidates import Candidate
from mixprec.runtime.engines import run_model


def _nudged(model: onnx.ModelProto) -> onnx.ModelProto:
    """The input with every float weight moved by one part in 10^4: the same answers on
    every row, by a candidate whose numbers differ (as INT8's would, far less)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in out.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            array = numpy_helper.to_array(tensor) * np.float32(1.0001)
            tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float32), tensor.name))
    return out


NUDGED = Candidate("nudged-ort", "ort", None, _nudged, "the input, weights moved 1e-4")


def test_an_unconfirmed_pass_loses_unless_accepted(model_file: Path, samples) -> None:
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort", NUDGED])
    rows = {r.name: r for r in result.table}
    nudged = rows["nudged-ort"]
    assert nudged.passed and nudged.unconfirmed and not nudged.accurate
    top1 = nudged.checks[0]
    assert top1.kind == "top1" and top1.value == 1.0 and top1.bound < top1.limit
    assert nudged.verdict == "inaccurate" and nudged.timing is None
    assert nudged.reason.startswith(f"unconfirmed: {top1.rows} held-out rows cannot confirm")
    assert result.winner == "fp32-ort"
    assert "nudged-ort passed unconfirmed and was not taken" in result.summary
    assert "rows at this agreement would (--accept-unconfirmed takes it)" in result.summary
    assert nudged.to_dict()["confirmed"] is False
    # the input is the reference: it is never held to confirming rows
    assert rows["fp32-ort"].accurate and not rows["fp32-ort"].unconfirmed

    taken = mixprec.optimize(
        str(model_file), samples, candidates=["fp32-ort", NUDGED], accept_unconfirmed=True
    )
    row = {r.name: r for r in taken.table}["nudged-ort"]
    assert row.accurate and row.timing is not None and row.verdict in ("lost", "wins")
    assert "passed unconfirmed" not in taken.summary
    # a second session of the input timed as the candidates are: the run's noise floor,
    # its ratio and 95% interval in the notes and the JSON
    control = taken.control
    assert control is not None and control.low is not None and control.high is not None
    assert control.low <= control.ratio <= control.high
    assert any(n.startswith("control: a second session of the input") for n in taken.notes)
    assert taken.to_dict()["control"]["rounds"] == control.rounds
    assert row.to_dict()["ratio_interval"] == [row.timing.low, row.timing.high]


def test_fp32_in_another_runtime_needs_no_confirming(model_file: Path, samples) -> None:
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort", "fp32-openvino"])
    row = {r.name: r for r in result.table}["fp32-openvino"]
    assert row.checks and not row.unconfirmed and row.accurate, row
    assert any(c.bound is not None and c.bound < c.limit for c in row.checks)


def test_a_candidate_that_fits_nothing_is_checked_on_every_sample(model_file, samples) -> None:
    """12 samples of 16 rows: half are held out of the calibration, and a candidate built
    from them (INT8, a caller's function) is checked on those 96 rows; the input in
    another runtime fits nothing to any sample, so it is checked on all 192, which
    confirms more (before: 96 rows for every candidate)."""
    result = mixprec.optimize(
        str(model_file), samples, candidates=["fp32-ort", NUDGED, "fp32-openvino"]
    )
    rows = {r.name: r for r in result.table}
    (nudged,), (plain,) = rows["nudged-ort"].checks, rows["fp32-openvino"].checks
    assert (nudged.kind, plain.kind) == ("top1", "top1")
    assert nudged.rows == 6 * 16 and plain.rows == 12 * 16
    assert plain.bound is not None and nudged.bound is not None and plain.bound > nudged.bound
    assert any("checked on 12 sample(s): the held-out ones and calibration ones" in n
               for n in result.notes)  # fmt: skip


def test_the_user_reads_an_output_their_way(model_file: Path, samples, tmp_path, capsys) -> None:
    result = mixprec.optimize(
        str(model_file), samples, candidates=["fp32-ort"], output_kinds={"probs": "rel-l2"}
    )
    (check,) = result.table[0].checks
    assert check.kind == "rel-l2" and check.reason == "chosen by --output-kind rel-l2"
    quantized = mixprec.quantize(
        str(model_file), samples, speed="off", output_kinds=["probs=channels@1"]
    )
    assert quantized.report.guard["kinds"]["probs"]["check"] == "channels@1"
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.stack([s["x"] for s in samples]))
    argv = ["optimize", str(model_file), "-o", str(tmp_path / "o.onnx")]
    argv += ["--calibration-data", str(calib), "--output-kind", "nope=top1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mixprec: error: --output-kind names 'nope', not an output of the model "
                   "(its outputs: 'probs')"]  # fmt: skip
    assert not (tmp_path / "o.onnx").exists()


def test_optimize_without_data_tries_what_needs_none(model_file: Path, tmp_path, capsys):
    """No --calibration-data: generated inputs, no INT8 (the last line says it needs
    data), every other candidate held to convert's rel L2 for its precision; a valid
    model is written."""
    result = mixprec.optimize(str(model_file))
    rows = {r.name: r for r in result.table}
    for name in ("int8-ort", "int8-openvino", "int8-bf16-openvino"):
        if name in rows:
            assert rows[name].verdict == "skipped" and "INT8 needs representative data" in (
                rows[name].note
            )
    assert rows["fp32-ort"].checks[0].kind == "rel-l2"
    assert rows["fp32-ort"].checks[0].limit == 1e-4
    assert result.summary.endswith("INT8 needs representative data: give --calibration-data")
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(model_file), "-o", str(out), "-q"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("mixprec: ") and "INT8 needs representative data" in last
    onnx.checker.check_model(onnx.load(out), full_check=True)
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)}
    assert run_model(str(out), feeds)["probs"].shape == (4, CLASSES)
