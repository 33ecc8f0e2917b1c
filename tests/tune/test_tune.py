"""``mixprec.tune``: the sensitivity ranking, the evaluation counts, the budget semantics,
the CLI. Numbers are checked against ONNX Runtime runs of the FP32 model."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.cli.main import main
from mixprec.core.rules import RULES
from mixprec.passes.emulate import emulate_low_precision
from mixprec.tune.metrics import rel_l2

BIG = 2048.0  # fp16 spacing is 2 here, bf16 16: x + BIG - BIG loses x (exact in both)


def _cancel_model() -> onnx.ModelProto:
    """MatMul -> Add(BIG) -> Sub(BIG) -> Relu -> Mul: the Add/Sub pair is sensitive by
    construction (the Sub cancels the large constant the Add put in)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w")
    big = numpy_helper.from_array(np.array(BIG, np.float32), "big")
    half = numpy_helper.from_array(np.array(0.5, np.float32), "half")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "big"], ["a"], name="add_big"),
        helper.make_node("Sub", ["a", "big"], ["s"], name="sub_big"),
        helper.make_node("Relu", ["s"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "half"], ["y"], name="scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "cancel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [w, big, half],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _data(n: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(n)]


def _measured_rel_l2(
    original: onnx.ModelProto, tuned: onnx.ModelProto, data, *, emulated: bool = False
) -> float:
    """Worst relative L2 of ``tuned`` against ``original``, both run in ONNX Runtime;
    ``emulated``: ``tuned`` with every low tensor rounded (what tune measures)."""
    if emulated:
        tuned = emulate_low_precision(tuned)
    ref = [run_ort(original, s) for s in data]
    out = [run_ort(tuned, s) for s in data]
    return rel_l2(ref, out)


# --- the ranking ---------------------------------------------------------------------------


def test_the_cancelling_pair_is_ranked_first_and_moved_to_float():
    model = _cancel_model()
    data = _data()
    result = mixprec.tune(model, "fp16", data, budget=1e-2)
    first_two = {s.name for s in result.ranking[:2]}
    assert first_two == {"add_big", "sub_big"}, [s.to_dict() for s in result.ranking]
    scores = {s.name: s.score for s in result.ranking}
    others = [v for k, v in scores.items() if k not in first_two]
    assert min(scores["add_big"], scores["sub_big"]) > 100 * max(others), scores
    assert result.passed, result.message
    # Moving the Add suffices: what it alone feeds (Sub, Relu, Mul) is then painted FP32.
    assert result.evaluations["full"] == 2 and result.path[-1].kept_float == 1
    downstream = {"add_big", "sub_big", "relu", "scale"}
    assert {s.name for s in result.kept_float} == downstream, result.message
    assert "1 of 5 candidate node(s) moved back to float (+3 that painting" in result.message
    precision = {n.name: n.precision for n in result.report.nodes}
    assert {k for k, v in precision.items() if v == "fp32"} == downstream, precision
    assert result.low_mac_share == 1.0  # the MatMul stays fp16
    measured = _measured_rel_l2(model, result.model_proto, data, emulated=True)
    assert measured <= 1e-2, measured
    assert result.achieved is not None and math.isclose(measured, result.achieved, rel_tol=1e-3)
    assert _measured_rel_l2(model, result.model_proto, data) <= 1e-2  # as is, too
    # the all-fp16 model misses the budget, as the first step of the path says
    assert result.path[0].kept_float == 0 and not result.path[0].passed
    plain = mixprec.convert(model, "fp16", calibration_data=data)
    assert _measured_rel_l2(model, plain.model_proto, data, emulated=True) > 0.1


def test_local_downstream_and_accumulated_errors_are_measured():
    result = mixprec.tune(_cancel_model(), "fp16", _data(), budget=1e-2)
    by_name = {s.name: s for s in result.ranking}
    # The Sub's own error is large (its inputs are rounded); the Add's is small but its
    # rounded output ruins its consumer, the Sub.
    assert by_name["sub_big"].local > 0.05, by_name["sub_big"]
    assert by_name["add_big"].local < 1e-3 < 0.05 < by_name["add_big"].downstream
    assert by_name["relu"].accumulated > 0.05  # the error reaches it through the stream
    assert all(s.measured for s in result.ranking)


# --- evaluation counts ---------------------------------------------------------------------


def test_evaluations_are_counted_and_full_set_ones_bounded():
    result = mixprec.tune(_cancel_model(), "fp16", _data(8), budget=1e-2)
    n = len(result.ranking)
    ev = result.evaluations
    assert ev["full"] <= math.ceil(math.log2(n)) + 3, (ev, n)
    assert ev["subset"] >= 1, ev  # 8 samples: the worst two are tried first
    assert ev["subset"] + ev["full"] == len(result.path)
    assert sum(1 for s in result.path if s.subset) == ev["subset"]
    assert result.to_dict()["evaluations"] == ev["subset"] + ev["full"]


def test_all_low_model_meeting_the_budget_takes_one_evaluation():
    result = mixprec.tune(_cancel_model(), "fp16", _data(), budget=10.0)
    assert result.passed and result.kept_float == []
    assert result.evaluations == {"subset": 0, "full": 1, "reference": 1}
    assert result.ranking == [] and result.candidates == 5  # no sensitivity run needed
    assert "meets" in result.message


def test_the_verdict_is_an_output_check_of_the_one_schema():
    """tune's verdict reads as validate's and the guards' do (issue 44): one OutputCheck,
    the metric as measured on the returned model against the budget, over the samples;
    a callable metric under its own name."""
    data = _data()
    result = mixprec.tune(_cancel_model(), "fp16", data, budget=1e-2)
    (check,) = result.checks
    assert (check.kind, check.output, check.rows) == ("rel-l2", "every output", len(data))
    assert check.passed is result.passed is True and check.limit == 1e-2
    measured = _measured_rel_l2(_cancel_model(), result.model_proto, data, emulated=True)
    assert check.value == result.achieved and check.value == pytest.approx(measured, rel=1e-3)
    assert result.to_dict()["checks"][0]["text"].startswith("rel L2 ")

    calls = []

    def score(candidate: mixprec.checks.user_metric.Candidate) -> float:
        calls.append(1)
        return 1.0 if len(calls) == 1 else 0.0  # only the FP32 reference scores 1

    missed = mixprec.tune(_cancel_model(), "fp16", data, metric=score, budget=0.1)
    (check,) = missed.checks
    assert (check.kind, check.output, check.passed) == ("metric", "score", False)
    assert check.value == 0.0 and check.limit == pytest.approx(0.9)


# --- budget semantics ----------------------------------------------------------------------


def test_a_budget_even_the_all_float_model_misses_is_said_plainly():
    calls = []

    def score(candidate: mixprec.checks.user_metric.Candidate) -> float:
        calls.append(len(candidate.outputs))
        return 1.0 if len(calls) == 1 else 0.0  # only the FP32 reference scores 1

    result = mixprec.tune(_cancel_model(), "fp16", _data(), metric=score, budget=0.1)
    assert not result.passed
    assert "even the all-float model misses" in result.message, result.message
    n = len(result.ranking)
    assert result.path[-1].kept_float == n and not result.path[-1].passed
    assert result.evaluations["subset"] == 0  # a callable sees the whole data each time
    assert result.evaluations["full"] <= math.ceil(math.log2(n)) + 3


def test_a_callable_with_a_relative_drop_is_met_by_the_all_float_model():
    data = _data()
    ref = [run_ort(_cancel_model(), s)["y"] for s in data]

    def closeness(candidate) -> float:  # a task score: higher is better
        outs = [o["y"] for o in candidate.outputs]
        err = sum(float(np.abs(o - r).mean()) for o, r in zip(outs, ref, strict=True))
        return 1.0 - err

    result = mixprec.tune(_cancel_model(), "fp16", data, metric=closeness, budget="0.5%")
    assert result.passed, result.message
    assert result.budget is not None and math.isclose(
        result.budget.limit, 1.0 - 0.005, abs_tol=1e-6
    )
    assert {s.name for s in result.kept_float} >= {"add_big", "sub_big"}


def test_max_evaluations_is_honoured():
    result = mixprec.tune(_cancel_model(), "fp16", _data(), budget=1e-2, max_evaluations=2)
    assert result.evaluations["subset"] + result.evaluations["full"] <= 2
    assert not result.passed
    assert "max_evaluations=2" in result.message, result.message


def test_bad_arguments_are_user_errors():
    with pytest.raises(mixprec.MixprecError, match="max_evaluations"):
        mixprec.tune(_cancel_model(), "fp16", _data(), max_evaluations=0)
    with pytest.raises(mixprec.MixprecError, match="unknown metric"):
        mixprec.tune(_cancel_model(), "fp16", _data(), metric="l3")
    with pytest.raises(mixprec.MixprecError, match="needs a budget"):
        mixprec.tune(_cancel_model(), "fp16", _data(), metric="max-abs")


# --- targets and shortcuts -----------------------------------------------------------------


def test_bf16_tuning_meets_the_budget_on_the_emulated_model():
    data = _data()
    result = mixprec.tune(_cancel_model(), "bf16", data, budget=2e-2)
    assert result.passed, result.message
    assert {"add_big", "sub_big"} <= {s.name for s in result.kept_float}
    assert _measured_rel_l2(_cancel_model(), result.model_proto, data, emulated=True) <= 2e-2


def test_convert_max_error_is_tune():
    data = _data()
    result = mixprec.convert(_cancel_model(), "fp16", calibration_data=data, max_error=1e-2)
    assert isinstance(result, mixprec.TuneResult) and result.passed
    assert _measured_rel_l2(_cancel_model(), result.model_proto, data, emulated=True) <= 1e-2


def _conv_model() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(0.2 * rng.standard_normal((4, 8, 3, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_int8_tuning_loose_and_tight():
    rng = np.random.default_rng(3)
    data = [{"x": rng.random((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    loose = mixprec.tune(_conv_model(), "int8", data, budget=0.5)
    assert isinstance(loose, mixprec.TuneResult) and loose.passed
    assert loose.kept_float == [] and loose.low_mac_share == 1.0
    assert loose.candidates == 2 and loose.ranking == []
    assert any(n.op_type == "QuantizeLinear" for n in loose.model_proto.graph.node)
    tight = mixprec.tune(_conv_model(), "int8", data, budget=1e-6)
    assert tight.passed  # only the all-float model gets there
    assert {s.name for s in tight.ranking} == {"conv1", "conv2"}
    assert all(s.local > 0 for s in tight.ranking), tight.ranking  # QDQ-emulated copies
    assert len(tight.kept_float) == 2 and tight.low_mac_share == 0.0
    assert _measured_rel_l2(_conv_model(), tight.model_proto, data) <= 1e-6


# --- the command line ----------------------------------------------------------------------


def _write(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_cancel_model(), src)
    stacked = {"x": np.stack([s["x"] for s in _data()])}
    np.savez(tmp_path / "x.npz", **stacked)
    return src, tmp_path / "x.npz"


def test_cli_json_is_one_object_and_the_model_is_written(tmp_path, capsys):
    src, inputs = _write(tmp_path)
    out = tmp_path / "out.onnx"
    args = ["tune", str(src), "-o", str(out), "--inputs", str(inputs), "--budget", "1e-2"]
    status = main([*args, "--json", "--log-dir", str(tmp_path / "log")])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    data = json.loads(captured.out)  # the whole stdout is one JSON object
    for key in ("evaluations", "budget", "achieved", "passed", "low_mac_share", "kept_float"):
        assert key in data, key
    kept = sorted(data["kept_float"])
    assert data["passed"] is True and kept == ["add_big", "relu", "scale", "sub_big"], kept
    assert 0.0 <= data["low_mac_share"] <= 1.0 and data["budget"] == 1e-2
    assert out.exists()
    log = json.loads((tmp_path / "log" / "tune.json").read_text())
    assert len(log["ranking"]) == 5 and log["ranking"][0]["name"] in ("add_big", "sub_big")
    assert (tmp_path / "log" / "tune.png").exists() or "matplotlib" in log["notes"][0]
    page = (tmp_path / "log" / "tune.html").read_text()
    assert "<th>tuner result</th><td>passed: 1 of 5 candidate node(s)" in page
    assert page.count("<circle ") == len(log["path"])  # the search curve, one dot a step
    measured = _measured_rel_l2(_cancel_model(), onnx.load(out), _data(), emulated=True)
    assert measured <= 1e-2 and math.isclose(measured, data["achieved"], rel_tol=1e-3)


def test_cli_budget_not_met_writes_nothing_and_exits_1(tmp_path, capsys):
    src, inputs = _write(tmp_path)
    out = tmp_path / "out.onnx"
    args = ["tune", str(src), "-o", str(out), "--inputs", str(inputs), "--budget", "1e-2"]
    status = main([*args, "--max-evaluations", "1"])
    captured = capsys.readouterr()
    assert status == 1
    assert not out.exists()
    lines = [line for line in captured.err.splitlines() if line.startswith("mixprec:")]
    assert len(lines) == 1 and "not written" in lines[0], captured.err
    assert "Traceback" not in captured.err


def test_candidates_inside_subgraphs_rank_last_unmeasured_and_the_budget_is_met():
    """The instrumented run copies main-graph nodes only; a model whose low nodes all sit
    in If branches is still tuned (its candidates in name order) and meets the budget."""
    big = numpy_helper.from_array(np.array(BIG, np.float32), "big")

    rng = np.random.default_rng(4)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}")
        for i in range(2)
    ]

    def branch(name: str, weight: str) -> onnx.GraphProto:
        nodes = [
            helper.make_node("MatMul", ["x", weight], [f"{name}_m"], name=f"{name}_op"),
            helper.make_node("Add", [f"{name}_m", "big"], [f"{name}_a"], name=f"{name}_add"),
            helper.make_node("Sub", [f"{name}_a", "big"], [f"{name}_y"], name=f"{name}_sub"),
        ]
        out = helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, [4, 8])
        return helper.make_graph(nodes, name, [], [out])

    graph = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["c"],
                ["y"],
                name="branch",
                then_branch=branch("then", "w0"),
                else_branch=branch("else", "w1"),
            )
        ],
        "with_if",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [big, *weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = [{"x": s["x"], "c": np.array(True)} for s in _data()]
    result = mixprec.tune(model, "fp16", data, budget=1e-2)
    assert result.passed, result.message
    assert not result.path[0].passed and result.candidates >= 4, result.path
    assert result.ranking and not any(s.measured for s in result.ranking)
    assert [s.name for s in result.ranking] == sorted(s.name for s in result.ranking)
    n = result.candidates
    assert result.evaluations["full"] <= math.ceil(math.log2(n)) + 3
    assert _measured_rel_l2(model, result.model_proto, data, emulated=True) <= 1e-2


def test_give_back_returns_heavy_nodes_the_budget_does_not_need():
    """The refinement after the bisection, on a stand-in scorer: the error is the sum of
    the low nodes' errors; the heavy node 'big' was moved but costs nothing."""
    from mixprec.tune.metrics import Budget
    from mixprec.tune.search import Search, Step

    errors = {"hot": 1.0, "big": 0.0, "mid": 0.004, "small": 0.003}
    search = object.__new__(Search)
    search.order = ["hot", "big", "mid", "small"]
    search.macs = {"hot": 0, "big": 1000, "mid": 100, "small": 10}
    search.counts = {"subset": 1, "full": 2, "reference": 1}
    search.path, search.passing, search.full = [], [], {}
    search.max_evaluations, search.deadline = None, math.inf
    search.budget = Budget(0.005, False, "err <= 0.005")

    def score(k, subset):
        moved = search.names(k)
        value = sum(e for name, e in errors.items() if name not in moved)
        step = Step(len(moved), subset is not None, value, value <= 0.005, 0.0, 0.0)
        search.path.append(step)
        search.counts["subset" if subset is not None else "full"] += 1
        if subset is None and step.passed:
            search.passing.append((tuple(moved), step))
        return value, []

    search.score = score  # type: ignore[method-assign]
    kept = search._give_back(("hot", "big", "mid", "small"), worst=[0])
    # 'big' goes back (error unchanged); then 'mid' (0.004 <= 0.005); 'small' is not
    # tried: two tries were left (ceil(log2 4) - 1 subset run = 1, at least 2).
    assert kept == ("hot", "small"), (kept, search.path)
    assert [s.subset for s in search.path] == [True, True, False]  # confirmed on all
    assert search.counts["full"] == 3


@contextlib.contextmanager
def _without_count_rule() -> Iterator[None]:
    """Issue 27's count rule (a float rounded into a count stays FP32) removed, the
    documented way, and put back."""
    saved = {op: RULES[("", op)] for op in ("Ceil", "Floor", "Round", "Cast")}
    try:
        for op in saved:
            mixprec.register_rule(op, mixprec.OpRule())
        yield
    finally:
        for op, rule in saved.items():
            mixprec.register_rule(op, rule)


def test_a_candidate_whose_output_length_changes_is_a_measured_miss() -> None:
    """Issue 17: a length predicted from values (VITS' durations) that fp16 moves by one
    used to crash the search (operands could not be broadcast); it is a miss. (Issue 27's
    count rule keeps this path FP32 from the start: it is removed here.)"""
    w = onnx.numpy_helper.from_array(np.array([[9.999]], np.float32), "w")
    zero = onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    one = onnx.numpy_helper.from_array(np.array(1.0, np.float32), "one")
    scalar = onnx.numpy_helper.from_array(np.array([], np.int64), "scalar")
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "w"], ["s"], name="duration"),
        onnx.helper.make_node("Reshape", ["s", "scalar"], ["s0"], name="squeeze"),
        onnx.helper.make_node("Floor", ["s0"], ["n"], name="floor"),
        onnx.helper.make_node("Range", ["zero", "n", "one"], ["frames"], name="frames"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "lengths",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1])],
        [onnx.helper.make_tensor_value_info("frames", onnx.TensorProto.FLOAT, [None])],
        [w, zero, one, scalar],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = [{"x": np.ones((1, 1), np.float32)}]
    assert run_ort(model, data[0])["frames"].shape == (9,)  # floor(9.999): 9 frames
    with _without_count_rule():
        result = mixprec.tune(model, "fp16", data, budget=1e-3)
    assert result.passed, result.message
    assert "shape" in result.path[0].note, result.path
    assert result.path[0].value == math.inf and not result.path[0].passed, result.path
    assert "duration" in {s.name for s in result.kept_float}, result.kept_float
    assert run_ort(result.model_proto, data[0])["frames"].shape == (9,)


def test_int8_sensitivity_reads_weights_as_int8_codes_with_the_same_errors(monkeypatch):
    """The tuner's INT8 copies read their weights as int8 codes that a DequantizeLinear
    expands in the run: a quarter of the bytes a float copy of every weight held beside
    the model (MiniLM's guard repair). The errors measured are those of float copies of
    the same rounded weights (the path kept for opsets without per-channel
    DequantizeLinear), up to the kernels' summation order (a constant weight is prepacked:
    1e-6 relative on MiniLM), and rank the nodes the same."""
    targets = importlib.import_module("mixprec.tune.targets")
    sensitivity = importlib.import_module("mixprec.tune.sensitivity")
    rng = np.random.default_rng(3)
    data = [{"x": rng.random((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    seen: list[ir.Model] = []
    session = sensitivity._session

    def recording(model, options):
        seen.append(model)
        return session(model, options)

    monkeypatch.setattr(sensitivity, "_session", recording)
    codes = mixprec.tune(_conv_model(), "int8", data, budget=1e-6)
    weights = [
        n
        for n in seen[0].graph
        if n.op_type == "DequantizeLinear" and n.inputs[0].dtype == ir.DataType.INT8
    ]
    assert len(weights) == 2 and all(n.attributes["axis"].as_int() == 0 for n in weights)
    monkeypatch.setattr(targets, "PER_CHANNEL_OPSET", 99)  # the float copies' path
    seen.clear()
    floats = mixprec.tune(_conv_model(), "int8", data, budget=1e-6)
    assert not any(n.op_type == "DequantizeLinear" and n.inputs[0].dtype == ir.DataType.INT8
                   for n in seen[0].graph)  # fmt: skip
    assert [s.name for s in codes.ranking] == [s.name for s in floats.ranking]
    for a, b in zip(codes.ranking, floats.ranking, strict=True):
        got, want = (a.local, a.downstream, a.accumulated), (b.local, b.downstream, b.accumulated)
        assert got == pytest.approx(want, rel=1e-5), (a.name, got, want)
    assert all(s.local > 0 for s in codes.ranking), codes.ranking


def test_int8_sensitivity_emulates_the_specs_each_node_carries():
    """The tuner's fake quantization follows the specs annotate recorded on each INT8
    node (int8 zero points, per-tensor weights with codes bounded at 63 here), not the
    default quantizer it was built with: a quantizer whose specs differ from node to node
    is emulated as it will be written."""
    from mixprec.calibrate.measure import calibration_of
    from mixprec.int8.config import QuantizeConfig
    from mixprec.int8.plan import AnnotateInt8Pass
    from mixprec.int8.spec import REDUCED_RANGE, BackendQuantizer, QuantSpec
    from mixprec.pipeline.quantize import QuantizePipeline

    targets = importlib.import_module("mixprec.tune.targets")
    sensitivity = importlib.import_module("mixprec.tune.sensitivity")
    rng = np.random.default_rng(3)
    data = [{"x": rng.random((1, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    model = ir.from_proto(_conv_model())
    config = QuantizeConfig(speed="off")
    QuantizePipeline(config, calibration_data=data).run(model, until="annotate")
    other = BackendQuantizer(QuantSpec("int8"), QuantSpec("int8", qmax=REDUCED_RANGE))
    AnnotateInt8Pass(quantizer=other)(model)
    stats = calibration_of(model).stats

    def make(graph, names):
        return targets.QdqRounder(graph, names, stats, config.quantizer())

    copy, _, measured = sensitivity.instrument(model, ["conv1", "conv2"], make)
    assert measured == {"conv1", "conv2"}
    nodes = list(copy.graph)
    weights = [
        n
        for n in nodes
        if n.op_type == "DequantizeLinear" and n.inputs[0].dtype == ir.DataType.INT8
    ]
    assert len(weights) == 2 and all("axis" not in n.attributes for n in weights)
    codes = np.concatenate([n.inputs[0].const_value.numpy().ravel() for n in weights])
    assert int(np.abs(codes.astype(np.int32)).max()) == REDUCED_RANGE
    zeros = {n.inputs[2].dtype for n in nodes if n.op_type == "QuantizeLinear"}
    assert zeros == {ir.DataType.INT8}, zeros
