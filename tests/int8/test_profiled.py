"""INT8 placed per layer by ONNX Runtime's own profile (:mod:`mixprec.int8.profiled`,
``Engine.layer_profile``): kernel times attributed to the model's layers by
region, and the placement that keeps the slower layers float tried first (issue 43)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.int8 import speed
from mixprec.int8.profiled import slower_layers
from mixprec.runtime.engine import LayerProfile, RuntimeOptions
from mixprec.runtime.engines import engine_for


def _graph(nodes: list[tuple[str, str, list[str], list[str]]]) -> onnx.GraphProto:
    made = [helper.make_node(op, ins, outs, name=name) for op, name, ins, outs in nodes]
    return helper.make_graph(made, "g", [], [])


#: The model: Conv c1 -> PRelu p1 -> Conv c2 -> PRelu p2.
ORIGINAL = _graph([
    ("Conv", "c1", ["x", "w1"], ["y1"]), ("PRelu", "p1", ["y1", "s1"], ["z1"]),
    ("Conv", "c2", ["z1", "w2"], ["y2"]), ("PRelu", "p2", ["y2", "s2"], ["z2"]),
])  # fmt: skip
#: ORT's FP32 graph: each Conv in a blocked layout between reorders, renamed.
FP32 = _graph([
    ("ReorderInput", "in1", ["x"], ["a"]), ("Conv", "y1_nchwc", ["a", "w"], ["b"]),
    ("ReorderOutput", "out1", ["b"], ["y1"]), ("PRelu", "p1", ["y1", "s1"], ["z1"]),
    ("ReorderInput", "in2", ["z1"], ["c"]), ("Conv", "y2_nchwc", ["c", "w"], ["d"]),
    ("ReorderOutput", "out2", ["d"], ["y2"]), ("PRelu", "p2", ["y2", "s2"], ["z2"]),
])  # fmt: skip
#: ORT's INT8 graph: QuantizeLinear, QLinearConv, DequantizeLinear for each Conv.
INT8 = _graph([
    ("QuantizeLinear", "q1", ["x"], ["xq"]), ("QLinearConv", "c1_token_2", ["xq"], ["y1q"]),
    ("DequantizeLinear", "dq1", ["y1q"], ["y1"]), ("PRelu", "p1", ["y1", "s1"], ["p1_out"]),
    ("QuantizeLinear", "q2", ["p1_out"], ["z1q"]), ("QLinearConv", "c2_token_6", ["z1q"], ["y2q"]),
    ("DequantizeLinear", "dq2", ["y2q"], ["y2"]), ("PRelu", "p2", ["y2", "s2"], ["z2"]),
])  # fmt: skip


def test_each_layer_is_timed_by_its_region_up_to_the_next_common_node():
    """c1's region (everything up to and with p1): FP32 0.2 + 1.0 + 0.3 + 0.5 = 2.0 ms,
    INT8 0.1 + 1.6 + 0.5 + 0.5 = 2.7 ms: no faster, kept float (ratio 1.35); c2's: FP32
    3.0, INT8 1.6: left INT8. Names differ between the graphs (y1_nchwc, c1_token_2, the
    PRelu's output): only p1 and p2, the same op under the same name in all three, anchor."""
    fp32 = LayerProfile(FP32, {"in1": 0.2, "y1_nchwc": 1.0, "out1": 0.3, "p1": 0.5,
                               "in2": 0.3, "y2_nchwc": 2.0, "out2": 0.2, "p2": 0.5})  # fmt: skip
    int8 = LayerProfile(INT8, {"q1": 0.1, "c1_token_2": 1.6, "dq1": 0.5, "p1": 0.5,
                               "q2": 0.2, "c2_token_6": 0.8, "dq2": 0.1, "p2": 0.5})  # fmt: skip
    assert slower_layers(ORIGINAL, ["c1", "c2"], fp32, int8) == {"c1": pytest.approx(1.35)}
    faster = LayerProfile(INT8, {**int8.seconds, "c1_token_2": 0.8})
    assert slower_layers(ORIGINAL, ["c1", "c2"], fp32, faster) == {}
    # 2% slower is within one kernel's noise: not read as slower (MARGIN: 5%)
    even = LayerProfile(INT8, {**int8.seconds, "c1_token_2": 0.94})
    assert slower_layers(ORIGINAL, ["c1", "c2"], fp32, even) == {}


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.full((8, 1, 1), 0.1, np.float32), "s1"),
        numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.full((8, 1, 1), 0.1, np.float32), "s2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["y1"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["y1", "s1"], ["z1"], name="p1"),
        helper.make_node("Conv", ["z1", "w2"], ["y2"], name="c2", pads=[1, 1, 1, 1]),
        helper.make_node("PRelu", ["y2", "s2"], ["z2"], name="p2"),
    ]
    graph = helper.make_graph(
        nodes,
        "two_convs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16, 16])],
        [helper.make_tensor_value_info("z2", TensorProto.FLOAT, [2, 8, 16, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


def test_the_profile_names_the_kernels_of_the_graph_it_ran():
    ort = engine_for(RuntimeOptions())
    profile = ort.layer_profile(_model(), _samples(1)[0], RuntimeOptions())
    assert profile is not None and profile.seconds
    assert set(profile.seconds) <= {n.name for n in profile.graph.node}
    assert all(s > 0 for s in profile.seconds.values())
    assert {"p1", "p2"} <= set(profile.seconds)  # the PRelus keep their names: anchors
    # a GPU provider's kernels are not read: no profile, nothing placed by one
    assert ort.layer_profile(_model(), _samples(1)[0], RuntimeOptions(provider="cuda")) is None


def test_layers_the_profile_finds_slower_stay_float_in_the_placement_tried_first(monkeypatch):
    """The profile (its reading replaced: real kernel times depend on the machine) finds
    c1 no faster in INT8: a placement keeping c1 float is timed first, wins a tie with
    'all' (the timings replaced too: every placement as fast), and c1 stays float."""
    monkeypatch.setattr(speed, "slower_layers", lambda *a: {"c1": 1.2})

    def even(sessions, _feeds, _bar=None):
        return {label: [1e-3 if label == "fp32" else 5e-4] * 20 for label in sessions}

    monkeypatch.setattr(speed, "time_paired", even)
    result = mixprec.quantize(_model(), _samples(4), guard=False)
    plan = result.report.quantization["speed"]
    assert plan["chosen"].startswith("all but 1 layer(s)") and plan["profiled"] == {"c1": 1.2}
    ops = {n.name: n.op_type for n in result.model_proto.graph.node}
    fed = {n.name: list(n.input) for n in result.model_proto.graph.node}
    producers = {o: ops[n.name] for n in result.model_proto.graph.node for o in n.output}
    assert producers.get(fed["c1"][1]) != "DequantizeLinear", fed["c1"]  # a float weight
    assert producers.get(fed["c2"][1]) == "DequantizeLinear", fed["c2"]  # INT8 weights


def test_to_compete_the_fullest_placement_wins_a_tie_with_the_profiled_one(monkeypatch):
    """Under speed "compete" (optimize's INT8 candidates) the profiled placement is timed
    after 'all', which wins a tie: PP-OCRv4 det under OpenVINO's bf16 hint timed 'all'
    0.95x FP32 and the profiled placement 0.96x, and the profiled one, winning the plan's
    tie, then tied the bf16 hint in optimize's loop where 'all' beat it."""
    monkeypatch.setattr(speed, "slower_layers", lambda *a: {"c1": 1.2})

    def even(sessions, _feeds, _bar=None):
        return {label: [1e-3 if label == "fp32" else 5e-4] * 20 for label in sessions}

    monkeypatch.setattr(speed, "time_paired", even)
    result = mixprec.quantize(_model(), _samples(4), guard=False, speed="compete")
    plan = result.report.quantization["speed"]
    assert plan["chosen"] == "all" and plan["profiled"] == {"c1": 1.2}, plan["summary"]
    assert "all but 1 layer(s)" in plan["summary"]  # timed, and lost the tie
    fed = {n.name: list(n.input) for n in result.model_proto.graph.node}
    producers = {o: n.op_type for n in result.model_proto.graph.node for o in n.output}
    assert producers.get(fed["c1"][1]) == "DequantizeLinear", fed["c1"]  # INT8 weights


def test_openvino_counts_read_as_a_graph_of_its_layers():
    """OpenVINO's performance counts, named as in its runtime model, come back with that
    model's layers as a graph (edges between them), so regions read as in ORT's."""
    pytest.importorskip("openvino")
    options = RuntimeOptions(name="openvino")
    profile = engine_for(options).layer_profile(_model(), _samples(1)[0], options)
    assert profile is not None and profile.seconds
    names = {n.name for n in profile.graph.node}
    assert set(profile.seconds) <= names and all(s >= 0 for s in profile.seconds.values())
    produced = {out for n in profile.graph.node for out in n.output}
    assert all(i in produced for n in profile.graph.node for i in n.input)  # one graph


def test_a_repair_times_the_first_plans_placement_alone_without_a_profile(monkeypatch):
    """The guard's repaired quantization (a :class:`Reuse` from the first run) times only
    the placement the first plan chose, here the profiled one, with the repair's own
    exclusions added to what the profile kept float, and profiles nothing again."""
    import onnx_ir as ir

    from mixprec.int8.config import QuantizeConfig
    from mixprec.pipeline.quantize import Reuse, run_quantize

    monkeypatch.setattr(speed, "slower_layers", lambda *a: {"c1": 1.2})
    timed: list[set[str]] = []

    def even(sessions, _feeds, _bar=None):
        timed.append(set(sessions) - {"fp32"})
        return {label: [1e-3 if label == "fp32" else 5e-4] * 20 for label in sessions}

    profiles = []
    profile = speed._profile
    monkeypatch.setattr(speed, "_profile", lambda *a: profiles.append(1) or profile(*a))
    monkeypatch.setattr(speed, "time_paired", even)
    reuse = Reuse()
    config = QuantizeConfig(check=False)
    run_quantize(ir.from_proto(_model()), config, calibration_data=_samples(4), reuse=reuse)
    assert reuse.placement is not None and reuse.placement.startswith("all but 1 layer(s)")
    assert reuse.chosen == speed.Placement(("c1",), "chains") and len(profiles) == 2
    timed.clear()
    repaired = QuantizeConfig(check=False, exclude_nodes=("c2",))  # the repair's own
    _, report = run_quantize(
        ir.from_proto(_model()), repaired, calibration_data=_samples(4), reuse=reuse
    )
    assert timed == [{reuse.placement}] and len(profiles) == 2  # no profile again
    plan = report.quantization["speed"]
    assert plan["chosen"] == reuse.placement and plan["profiled"] == {}


@pytest.mark.parametrize(
    ("profiled", "says"),
    [
        ({"profile": None}, "the runtime gave none"),
        ({"slower": {}}, "it found no layer slower in INT8"),
        ({"slower": {"c1": 1.3, "c2": 1.2}}, "it found every layer no faster in INT8"),
    ],
)
def test_the_plan_says_why_no_placement_came_from_the_profile(monkeypatch, profiled, says):
    """When the profile gives no placement to time (no profile from the runtime, no layer
    slower, every layer slower), the plan's note and ``profile_note`` say which; before,
    only a log line at INFO said that the runtime gave no profile."""
    if "profile" in profiled:
        monkeypatch.setattr(speed, "_profile", lambda *a: None)
    else:
        monkeypatch.setattr(speed, "slower_layers", lambda *a: profiled["slower"])

    def even(sessions, _feeds, _bar=None):
        return {label: [1e-3 if label == "fp32" else 5e-4] * 20 for label in sessions}

    monkeypatch.setattr(speed, "time_paired", even)
    result = mixprec.quantize(_model(), _samples(4), guard=False)
    plan = result.report.quantization["speed"]
    assert plan["profile_note"] == says or plan["profile_note"].startswith(says)
    assert f"no placement from the per-layer profile: {says}" in plan["summary"]
    assert not plan["chosen"].startswith("all but"), plan["chosen"]
