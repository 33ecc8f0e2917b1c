"""Tests of mixprec._calibrate and mixprec._observers: range calibration over samples."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mixprec._calibrate import collect_absmax
from mixprec._errors import MixprecError
from proto_builders import (
    F32,
    _const,
    _model,
    _tensor,
    _vi,
)


def _range_model() -> onnx.ModelProto:
    """x*1000 -> Exp (overflows), Tanh; an If whose then-branch holds a Constant."""
    then_branch = helper.make_graph(
        [
            _const("branch_k", np.array([-7.5, 2.0], np.float32)),
            helper.make_node("Mul", ["t", "branch_k"], ["then_out"]),
        ],
        "then",
        [],
        [_vi("then_out", F32, [2])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["t"], ["else_out"])], "else", [], [_vi("else_out", F32, [2])]
    )
    nodes = [
        helper.make_node("Mul", ["x", "k1000"], ["scaled"]),
        helper.make_node("Exp", ["scaled"], ["expd"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node(
            "If", ["cond"], ["branch"], then_branch=then_branch, else_branch=else_branch
        ),
        helper.make_node("Add", ["branch", "expd"], ["y"]),
    ]
    return _model(
        nodes,
        [_vi("x", F32, [2]), _vi("cond", TensorProto.BOOL, [])],
        [_vi("y", F32, [2])],
        [_tensor("k1000", np.array(1000.0, np.float32))],
    )


@pytest.mark.parametrize("chunk_size", [1, 2000])
def test_collect_absmax_exact_values(chunk_size: int) -> None:
    model = _range_model()
    before = model.SerializeToString()
    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(True)}
    absmax = collect_absmax(model, feeds, chunk_size=chunk_size, threads=1)
    assert model.SerializeToString() == before, "the input model was mutated"
    want = {
        "x": 0.5,
        "k1000": 1000.0,
        "scaled": 500.0,
        "expd": math.inf,
        "t": float(np.tanh(np.float32(500.0))),
        "branch_k": 7.5,
        "branch": float(np.tanh(np.float32(500.0))) * 7.5,
        "y": math.inf,
    }
    assert set(absmax) == set(want), f"got keys {sorted(absmax)}, want {sorted(want)}"
    for name, value in want.items():
        assert absmax[name] == pytest.approx(value, rel=1e-6), (name, absmax[name], value)


def test_collect_absmax_nan_is_ignored_inf_is_recorded() -> None:
    model = _model(
        [
            helper.make_node("Sqrt", ["x"], ["root"]),
            helper.make_node("Reciprocal", ["x"], ["recip"]),
            helper.make_node("Add", ["root", "recip"], ["y"]),
        ],
        [_vi("x", F32, [3])],
        [_vi("y", F32, [3])],
    )
    feeds = {"x": np.array([-1.0, 4.0, 0.0], np.float32)}
    absmax = collect_absmax(model, feeds)
    assert absmax["root"] == 2.0, absmax  # sqrt(-1) is nan: ignored
    assert absmax["recip"] == math.inf, absmax


def test_collect_absmax_raises_when_the_model_cannot_run() -> None:
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        [_vi("a", F32, ["N"]), _vi("b", F32, ["M"])],
        [_vi("y", F32, [None])],
    )
    feeds = {"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)}  # cannot broadcast
    with pytest.raises(MixprecError, match=r"^onnxruntime failed to run the model"):
        collect_absmax(model, feeds)


def test_collect_absmax_bisects_failing_chunks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor ORT refuses to expose is skipped with a warning; the others are kept."""
    from mixprec._probes import ProbeSession, VariantRunner

    real_run = VariantRunner.run

    def run(self: VariantRunner, outputs: Sequence[onnx.ValueInfoProto], feeds: dict) -> dict:
        if any(vi.name == "t" for vi in outputs):
            raise MixprecError("onnxruntime failed to run the model: refused")
        return real_run(self, outputs, feeds)

    monkeypatch.setattr(VariantRunner, "run", run)
    # Force the fetch-in-chunks fallback (used when the in-graph reduction cannot run).
    monkeypatch.setattr(ProbeSession, "create", classmethod(lambda cls, *a, **k: None))
    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(False)}
    with caplog.at_level("WARNING", logger="mixprec._calibrate"):
        absmax = collect_absmax(_range_model(), feeds)
    assert "t" not in absmax, absmax
    assert absmax["scaled"] == 500.0 and absmax["branch"] == pytest.approx(np.tanh(500.0)), absmax
    assert "skipped 1 tensor(s) ('t')" in caplog.text, caplog.text


def test_collect_absmax_in_graph_matches_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-graph ReduceMax(Abs) path gives the same ranges and shapes as fetching."""
    from mixprec._probes import ProbeSession

    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(False)}
    shapes_fast: dict[str, list[int]] = {}
    fast = collect_absmax(_range_model(), feeds, shapes_out=shapes_fast)
    monkeypatch.setattr(ProbeSession, "create", classmethod(lambda cls, *a, **k: None))
    shapes_slow: dict[str, list[int]] = {}
    slow = collect_absmax(_range_model(), feeds, shapes_out=shapes_slow)
    assert fast.keys() == slow.keys(), (sorted(fast), sorted(slow))
    for name in fast:
        assert fast[name] == pytest.approx(slow[name]), (name, fast[name], slow[name])
    for name, dims in shapes_slow.items():
        assert shapes_fast.get(name) == dims, (name, shapes_fast.get(name), dims)
