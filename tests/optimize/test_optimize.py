"""``mixprec.optimize`` and ``mixprec optimize`` end to end, in ONNX Runtime and OpenVINO
for real, on small classifiers built here. Only the structure and the choice logic are
asserted, never which runtime is faster on this CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from guard_models import separable_samples
from mixprec.cli.main import main
from mixprec.io.runtime_fields import HINTS_KEY, RUNTIME_KEY
from mixprec.optimize.candidates import CANDIDATES, Candidate
from mixprec.runtime.engines import ENGINES
from mixprec.runtime.timing import PRUNE_AFTER

pytest.importorskip("openvino")


def _npz(tmp_path: Path, samples: list[dict[str, np.ndarray]]) -> Path:
    path = tmp_path / "calib.npz"
    np.savez(path, x=np.stack([s["x"] for s in samples]))
    return path


def _wrong(model: onnx.ModelProto) -> onnx.ModelProto:
    """The input with its class weights rolled by one class: every answer changes."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name == "w2":
            w2 = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(np.roll(w2, 1, axis=1), "w2"))
    return out


def _slow(model: onnx.ModelProto) -> onnx.ModelProto:
    """The input plus a large MatMul chain on its input whose result is multiplied by zero
    and added to the answer: the same outputs, many times the work."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    big = np.random.default_rng(0).standard_normal((16, 768)).astype(np.float32) * 0.01
    sq = np.random.default_rng(1).standard_normal((768, 768)).astype(np.float32) * 0.01
    g.initializer.extend(
        [
            numpy_helper.from_array(big, "slow_w"),
            numpy_helper.from_array(sq, "slow_sq"),
            numpy_helper.from_array(np.zeros((1,), np.float32), "slow_zero"),
        ]
    )
    probs = g.output[0].name
    g.node[-1].output[0] = "probs_fast"
    nodes = [helper.make_node("MatMul", ["x", "slow_w"], ["s0"])]
    for k in range(12):
        nodes.append(helper.make_node("MatMul", [f"s{k}", "slow_sq"], [f"s{k + 1}"]))
    nodes += [
        helper.make_node("ReduceSum", ["s12"], ["s_sum"], keepdims=0),
        helper.make_node("Mul", ["s_sum", "slow_zero"], ["s_zero"]),
        helper.make_node("Add", ["probs_fast", "s_zero"], [probs]),
    ]
    g.node.extend(nodes)
    onnx.checker.check_model(out)
    return out


def test_every_candidate_gets_a_verdict(model_file: Path, samples) -> None:
    result = mixprec.optimize(str(model_file), samples)
    names = [r.name for r in result.table]
    assert names == [c.name for c in CANDIDATES]
    assert all(r.verdict for r in result.table)
    assert sum(r.verdict == "wins" for r in result.table) == 1
    rows = {r.name: r for r in result.table}
    assert rows["fp32-ort"].ratio == 1.0 and rows["fp32-ort"].accurate
    if not ENGINES["openvino"].computes_bf16():
        assert rows["bf16-openvino"].verdict == "skipped"
        assert rows["bf16-openvino"].reason == "this CPU does not compute bf16"
    # a classifier without LayerNormalization: ORT's transformer fusions have nothing to do
    assert rows["fused-ort"].verdict == "skipped"
    assert rows["fused-ort"].reason == "no LayerNormalization: no transformer fusion applies"
    for row in result.table:  # what the table shows of each: timed ones have rounds
        if row.status == "timed":
            assert row.timing is not None and row.timing.rounds >= PRUNE_AFTER
            assert row.accurate
    data = result.to_dict()
    assert json.loads(json.dumps(data))["winner"] == result.winner
    assert result.summary.startswith((f"{result.winner} wins", "no candidate beats"))


def test_an_inaccurate_candidate_is_not_timed_and_cannot_win(model_file: Path, samples) -> None:
    wrong = Candidate("wrong-ort", "ort", None, _wrong, "every answer shifted by one class")
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort", wrong])
    rows = {r.name: r for r in result.table}
    assert rows["wrong-ort"].verdict == "inaccurate"
    assert rows["wrong-ort"].timing is None
    assert "needs >= 0.99" in rows["wrong-ort"].reason
    assert result.winner == "fp32-ort" and result.unchanged


def test_a_user_metric_judges_every_candidate(model_file: Path, samples) -> None:
    def agreement(reference, outputs) -> float:
        same = [
            np.mean(r["probs"].argmax(-1) == o["probs"].argmax(-1))
            for r, o in zip(reference, outputs, strict=True)
        ]
        return float(np.mean(same))

    wrong = Candidate("wrong-ort", "ort", None, _wrong)
    result = mixprec.optimize(
        str(model_file),
        samples,
        candidates=["fp32-ort", "fp32-openvino", wrong],
        metric=agreement,
        metric_budget=0.99,
    )
    rows = {r.name: r for r in result.table}
    assert [c.kind for c in rows["fp32-openvino"].checks] == ["metric"]
    assert rows["fp32-openvino"].accurate
    assert rows["wrong-ort"].verdict == "inaccurate"
    assert "score" in rows["wrong-ort"].reason


def test_a_candidate_clearly_slower_stops_being_timed(model_file: Path, samples) -> None:
    slow = Candidate("slow-ort", "ort", None, _slow, "the same answers, far more work")
    result = mixprec.optimize(
        str(model_file), samples, candidates=["fp32-ort", slow], accept_unconfirmed=True
    )
    row = {r.name: r for r in result.table}["slow-ort"]
    assert row.accurate
    assert row.timing is not None and row.timing.pruned
    assert row.timing.rounds == PRUNE_AFTER
    assert row.to_dict()["rounds"] == PRUNE_AFTER
    assert row.reason == f"pruned after {PRUNE_AFTER} rounds: clearly slower than the best so far"
    assert result.winner == "fp32-ort"


def test_the_input_alone_is_written_byte_for_byte(model_file: Path, samples, tmp_path) -> None:
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort"])
    assert result.unchanged and result.winner == "fp32-ort"
    assert result.metadata == {}
    out = tmp_path / "out.onnx"
    result.save(out)
    assert out.read_bytes() == model_file.read_bytes()
    assert "written unchanged" in result.summary


def test_openvino_winner_runs_as_its_metadata_says(model_file: Path, samples, tmp_path) -> None:
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-openvino"])
    assert result.winner == "fp32-openvino" and not result.unchanged
    assert result.runtime.name == "openvino"
    out = tmp_path / "out.onnx"
    result.save(out)
    saved = onnx.load(out)
    props = {p.key: p.value for p in saved.metadata_props}
    assert props[RUNTIME_KEY] == "openvino"
    assert json.loads(props[HINTS_KEY]) == {"INFERENCE_PRECISION_HINT": "f32"}
    assert "written with mixprec.runtime=openvino" in result.summary
    report = mixprec.validate(str(model_file), str(out), inputs=samples[:2])
    assert report.kind == "openvino" and report.runtime["runtime"] == "openvino"
    assert report.passed
    # an FP32 model (no low tensor) is named so, not "none model" (was)
    assert "PASSED: float32 model checked with OpenVINO" in report.format_table()
    # an explicit runtime still wins over the metadata
    assert mixprec.validate(str(model_file), str(out), runtime="ort").kind == "onnxruntime"


def test_cli_validate_reads_the_metadata(model_file: Path, samples, tmp_path, capsys) -> None:
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-openvino"])
    out = tmp_path / "out.onnx"
    result.save(out)
    assert main(["validate", str(model_file), str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "openvino"


def test_cli_lists_every_candidate_then_the_winner(model_file: Path, samples, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    npz = _npz(tmp_path, samples)
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(npz)]
    assert main([*argv, "--candidates", "fp32-ort,fp32-openvino,bf16-openvino"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("mixprec: ")
    table = lines[-5:-2]
    assert [line.split()[0] for line in table] == ["fp32-ort", "fp32-openvino", "bf16-openvino"]
    assert lines[-2].startswith("ratios timed at x [16, 16] (batch 16), "), lines[-2]
    assert out.exists()
    assert main([*argv, "--candidates", "fp32-ort", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["winner"] == "fp32-ort" and data["metadata"] == {}
    assert out.read_bytes() == model_file.read_bytes()


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--candidates", "fp32-ort,fp64-ort"], "unknown candidate 'fp64-ort'"),
        (["--candidates", "int8-openvino", "--runtime", "ort"], "runs in openvino"),
        (["--time-budget", "0.01"], "too small to time any candidate"),
        (["--time-budget", "-1"], "--time-budget must be > 0"),
        (["--metric-budget", "0.9"], "needs metric"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(
    model_file: Path, samples, tmp_path, capsys, extra: list[str], error: str
) -> None:
    out = tmp_path / "out.onnx"
    npz = _npz(tmp_path, samples)
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(npz)]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: ") and error in err[0], err
    assert not out.exists()


def test_cli_a_runtime_named_but_missing_is_one_line(
    model_file: Path, samples, tmp_path, capsys, monkeypatch
) -> None:
    engine = ENGINES["openvino"]
    monkeypatch.setattr(engine, "missing", lambda options=None: "openvino is not installed")
    out = tmp_path / "out.onnx"
    npz = _npz(tmp_path, samples)
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data", str(npz)]
    assert main([*argv, "--runtime", "openvino"]) == 2
    assert capsys.readouterr().err.strip() == "mixprec: error: openvino is not installed"
    assert not out.exists()
    # under auto, the missing runtime's candidates are skipped with the reason
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort", "fp32-openvino"])
    row = {r.name: r for r in result.table}["fp32-openvino"]
    assert (row.verdict, row.reason) == ("skipped", "openvino is not installed")


def test_int8_candidates_are_built_by_the_guarded_quantize(model_file: Path, samples) -> None:
    result = mixprec.optimize(str(model_file), samples, candidates=["fp32-ort", "int8-ort"])
    row = {r.name: r for r in result.table}["int8-ort"]
    if row.status == "skipped":  # the speed plan or the guard kept it float: said why
        assert row.reason.startswith("no node runs in INT8: ")
    else:
        assert row.accurate and "accuracy guard passed" in row.note


def test_a_classifier_without_softmax_is_still_checked(tmp_path: Path) -> None:
    """A model whose output is plain logits gets its kind's check (top-1 too)."""
    w = np.eye(8, 3, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = [
        {"x": np.random.default_rng(k).standard_normal((4, 8)).astype(np.float32)} for k in range(6)
    ]
    result = mixprec.optimize(model, data, candidates=["fp32-ort", "fp32-openvino"])
    assert result.table[1].checks[0].kind == "top1"


def test_cli_metric_eval_data_and_json_metadata(model_file: Path, samples, tmp_path, capsys):
    """``--metric FILE.py:FUNCTION`` judges every candidate on ``--eval-data``, and
    ``--json`` carries the winner's metadata fields."""
    metric = tmp_path / "score.py"
    metric.write_text(
        "import numpy as np\n"
        "def agree(reference, outputs):\n"
        "    return float(np.mean([np.mean(r['probs'].argmax(-1) == o['probs'].argmax(-1))\n"
        "                          for r, o in zip(reference, outputs)]))\n"
    )
    evals = tmp_path / "eval.npz"
    np.savez(evals, x=np.stack([s["x"] for s in separable_samples(4, rows=16, seed=9)]))
    out = tmp_path / "out.onnx"
    argv = ["optimize", str(model_file), "-o", str(out), "--calibration-data"]
    argv += [str(_npz(tmp_path, samples)), "--eval-data", str(evals), "--json"]
    argv += ["--metric", f"{metric}:agree", "--metric-budget", "0.99"]
    assert main([*argv, "--candidates", "fp32-openvino"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["winner"] == "fp32-openvino" and data["output"] == str(out)
    assert data["metadata"][RUNTIME_KEY] == "openvino"
    row = data["candidates"][1]
    assert row["checks"][0]["kind"] == "metric" and row["accurate"]
    assert "checked on 4 sample(s) (eval data)" in data["notes"][0]


def test_a_budget_the_input_itself_misses_is_said(model_file: Path, samples) -> None:
    result = mixprec.optimize(
        str(model_file),
        samples,
        candidates=["fp32-ort", "fp32-openvino"],
        metric=lambda reference, outputs: 0.5,
        metric_budget=0.9,
    )
    assert result.unchanged and result.winner == "fp32-ort"
    assert result.summary.startswith("the input itself misses the budget (score 0.5")
    assert {r.name: r.verdict for r in result.table}["fp32-openvino"] == "inaccurate"


def test_a_tie_is_timed_again_head_to_head(model_file: Path, samples, monkeypatch) -> None:
    """Two candidates made to tie in their ratios to the input (the slow chain's 0.70x
    beside the same model's 0.66x, made up here) are then timed beside each other for
    real: the same model, without the slow chain, is surely faster, and wins; the table,
    the notes and the JSON say so."""
    from mixprec.optimize.timing import Timer, Timing

    made_up = iter(
        [
            Timing(1.0, 0.5, 1.0, 15, False, 0.95, 1.05, (0.97, 1.03)),  # the control
            Timing(0.70, 1.0, 0.7, 30, False, 0.64, 0.76, (0.66, 0.74)),
            Timing(0.66, 1.0, 0.66, 30, False, 0.61, 0.71, (0.63, 0.69)),
        ]
    )
    monkeypatch.setattr(Timer, "time", lambda self, session, bar: next(made_up))
    slow = Candidate("slow-ort", "ort", None, _slow, "the same answers, far more work")
    same = Candidate("same-ort", "ort", None, lambda m: m, "the input, as a candidate")
    result = mixprec.optimize(
        str(model_file), samples, candidates=["fp32-ort", slow, same], accept_unconfirmed=True
    )
    duel = result.head_to_head
    assert duel is not None and (duel.earlier, duel.later) == ("slow-ort", "same-ort")
    assert duel.timing is not None and duel.timing.high < 0.5, duel.timing.shown
    assert result.winner == "same-ort", result.format_table()
    rows = {r.name: r for r in result.table}
    assert rows["slow-ort"].reason.startswith("slower than same-ort head to head (same-ort 0.")
    assert duel.text() in result.notes
    assert json.loads(json.dumps(result.to_dict()))["head_to_head"]["decides"] is True
